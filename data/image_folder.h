// image_folder: the ImageNet layout, root/<class>/<image> (JPEG or PNG), listed exactly as
// torchvision's ImageFolder lists it: classes = the sorted names of root's subfolders (index = rank),
// samples = for each class in order, its files found recursively, sorted by (folder path, file name).
// A file without a .jpg/.jpeg/.png extension and a class folder without images are bad data (one
// DataError naming the path; counted and left out under on_bad_sample: skip — the empty class keeps
// its index, so labels never shift).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "strobe/config/config.h"
#include "strobe/data/data_error.h"

namespace strobe::data {

struct ImageFolderListing {
  std::vector<std::string> classes;
  std::vector<std::pair<std::string, int64_t>> samples;  // (path, class index)
};

ImageFolderListing list_image_folder(const std::string& root, const BadSampleLog& log);

// Keys shared by the image datasets.
OnBadSample read_on_bad_sample(config::Section& cfg);
// A list of `n` numbers (each > min_exclusive); the default is written back into the resolved config.
std::vector<double> read_double_list(config::Section& cfg, const std::string& key, const std::vector<double>& def, double min_exclusive);

}  // namespace strobe::data
