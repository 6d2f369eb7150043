// safetensors reading and writing (strobe/checkpoint/safetensors.h). Interop with the safetensors
// package itself is tests/python/test_safetensors.py; here: every dtype bit-exactly through our own
// writer and reader, every refusal of a hostile header with its message, and atomic writes.
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/safetensors.h"
#include "strobe/checkpoint/safetensors_format.h"
#include "tests/cli/cli_test_util.h"

namespace strobe {
namespace {

namespace st = safetensors;
using testing::slurp;
using testing::temp_dir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file of the given JSON header (padded to 8) and `buffer` bytes of data.
std::string file_of(const std::string& header, size_t buffer) {
  std::string text = header;
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text + std::string(buffer, '\x01');
}

// Bitwise equality, NaN payloads included.
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return ca.nbytes() == cb.nbytes() && std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

TEST(Safetensors, EveryDtypeRoundTripsBitExactlyWithMetadataAndOrder) {
  torch::manual_seed(0);
  st::NamedTensors tensors;
  auto x = torch::randn({3, 5}) * 100;
  x[0][0] = std::numeric_limits<float>::quiet_NaN();
  x[0][1] = -std::numeric_limits<float>::infinity();
  for (auto type : {torch::kFloat64, torch::kFloat32, torch::kFloat16, torch::kBFloat16, torch::kInt64, torch::kInt32,
                    torch::kInt16, torch::kInt8, torch::kUInt8})
    tensors.emplace_back(std::string("t_") + c10::toString(type), x.to(type));
  tensors.emplace_back("mask", x.gt(0));
  tensors.emplace_back("scalar", torch::tensor(2.5, torch::kFloat64));
  tensors.emplace_back("empty", torch::zeros({0, 7}));
  tensors.emplace_back("strided", torch::arange(24, torch::kInt32).view({4, 6}).t());  // not contiguous
  const std::string path = temp_dir("safetensors") + "/w.safetensors";
  st::write_file(path, tensors, {{"format", "pt"}, {"strobe.step", "12"}});

  st::File back = st::read_file(path);
  EXPECT_EQ(back.metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"strobe.step", "12"}}));
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);  // written in the given order, read in buffer order
    EXPECT_TRUE(same_bits(back.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  // The buffer starts 8-byte aligned, as the safetensors package writes it.
  const std::string bytes = slurp(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, WritingRefusesWhatTheFormatCannotHold) {
  const std::string dir = temp_dir("safetensors");
  auto refused = [&](const st::NamedTensors& t, const std::string& what) {
    try {
      st::write_file(dir + "/x.safetensors", t);
      ADD_FAILURE() << "expected a refusal: " << what;
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({{"c", torch::zeros({2}, torch::kComplexFloat)}}, "tensor 'c' has dtype ComplexFloat, which safetensors files cannot hold");
  refused({{"a", torch::zeros({2})}, {"a", torch::zeros({2})}}, "the name 'a' appears twice");
  refused({{"__metadata__", torch::zeros({2})}}, "a tensor cannot be named __metadata__");
  EXPECT_FALSE(std::filesystem::exists(dir + "/x.safetensors"));
}

TEST(Safetensors, HostileFilesAreRefusedNamingTheFileAndTheProblem) {
  const std::string dir = temp_dir("safetensors");
  const std::string entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32 bytes of header
  std::string beyond(8, '\0');
  beyond[0] = 100;
  struct Case {
    std::string bytes, what;
  };
  const std::vector<Case> cases = {
      {"", "0 bytes, shorter than the 8-byte header length"},
      {std::string("\x02\0\0", 3), "3 bytes, shorter than the 8-byte header length"},
      {huge + "{}", "header length 4294967296 is above the limit of 100000000 bytes"},
      {beyond + "{}", "header length 100 is beyond the file's 10 bytes"},
      {file_of("{\"a\":", 0), "the header is not valid JSON"},
      {file_of("[1,2]", 0), "the header is not a JSON object"},
      {file_of("{" + entry + "," + entry + "}", 8), "the name 'a' appears twice"},
      {file_of(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
       "the key 'dtype' appears twice in an entry"},
      {file_of(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8),
       "the JSON header nests deeper than a tensor entry"},
      {file_of(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2),
       "tensor 'a' has an unknown dtype 'F8_E4M3' (known: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)"},
      {file_of(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "tensor 'a': a dimension is not a non-negative integer"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
       "tensor 'a': data_offsets [0, 8] are beyond the data buffer's 4 bytes"},
      {file_of(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "tensor 'a': shape [3] of F32 is 12 bytes, but data_offsets [0, 8] hold 8"},
      {file_of(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "tensor 'a': shape [4294967296, 4294967296] of F32 is more than 2^64 bytes"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensor 'b' (data_offsets [4, 12]) overlaps tensor 'a' (ending at 8)"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "bytes [0, 4) of the data buffer belong to no tensor"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 9),
       "bytes [8, 9) of the data buffer belong to no tensor"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "tensor 'a' has no data_offsets"},
      {file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8), "tensor 'a' has an unknown key 'x'"},
      {file_of(R"({"__metadata__":{"k":1}})", 0), "__metadata__ 'k' is not a string"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir + "/case" + std::to_string(i) + ".safetensors";
    write_bytes(path, cases[i].bytes);
    try {
      st::read_file(path);
      ADD_FAILURE() << "case " << i << " accepted: " << cases[i].what;
    } catch (const checkpoint::CheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(path + ": not a safetensors file: ", 0), 0u) << msg;
      EXPECT_NE(msg.find(cases[i].what), std::string::npos) << "case " << i << ": " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  // A BOOL byte that is not 0 or 1 (file_of fills the buffer with 0x01, which is valid).
  std::string bad_bool = file_of(R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", 2);
  write_bytes(dir + "/bool_ok.safetensors", bad_bool);
  EXPECT_TRUE(st::read_file(dir + "/bool_ok.safetensors").tensors.at(0).second.all().item<bool>());
  bad_bool.back() = '\x07';
  write_bytes(dir + "/bool.safetensors", bad_bool);
  try {
    st::read_file(dir + "/bool.safetensors");
    ADD_FAILURE() << "a BOOL byte 7 was accepted";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'm' (BOOL) holds the byte 7 at element 1"), std::string::npos) << e.what();
  }
}

// The header check is linear in its entries: 100,000 of them (a duplicate name last, the worst case)
// are read, or refused, in well under a second; nlohmann's callback parser took minutes (quadratic).
TEST(Safetensors, AHeaderOf100000EntriesIsCheckedInLinearTime) {
  const std::string dir = temp_dir("safetensors-many");
  std::string header = "{";
  constexpr int kEntries = 100000;
  for (int i = 0; i < kEntries; ++i)
    header += fmt::format(R"("t{}":{{"dtype":"U8","shape":[1],"data_offsets":[{},{}]}},)", i, i, i + 1);
  std::string dup = header + R"("t7":{"dtype":"U8","shape":[1],"data_offsets":[100000,100001]}})";
  header.back() = '}';
  write_bytes(dir + "/many.safetensors", file_of(header, kEntries));
  write_bytes(dir + "/dup.safetensors", file_of(dup, kEntries + 1));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(st::read_file(dir + "/many.safetensors").tensors.size(), size_t(kEntries));
  try {
    st::read_file(dir + "/dup.safetensors");
    ADD_FAILURE() << "a duplicate name was accepted";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("the name 't7' appears twice"), std::string::npos) << e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0) << "100,000 entries read and refused in " << seconds << " s";
}

TEST(Safetensors, AFailedWriteLeavesThePreviousFileAndNoTempFile) {
  const std::string dir = temp_dir("safetensors");
  const std::string path = dir + "/w.safetensors";
  st::write_file(path, {{"w", torch::ones({1024})}});
  const std::string before = slurp(path);
  checkpoint::set_write_observer_for_testing([](size_t written) {
    if (written > 100) throw checkpoint::CheckpointError("simulated crash mid-write");
  });
  EXPECT_THROW(st::write_file(path, {{"w", torch::zeros({1024})}}), checkpoint::CheckpointError);
  checkpoint::set_write_observer_for_testing(nullptr);
  EXPECT_EQ(slurp(path), before);
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);
}

}  // namespace
}  // namespace strobe
