#include "strobe/core/optimizer_reshard.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace strobe {

namespace {

using Shape = std::vector<int64_t>;
using Fields = std::vector<std::pair<std::string, c10::IValue>>;

int64_t dim0_of(const Shape& s) { return s.empty() ? 1 : s[0]; }

int64_t rest_of(const Shape& s) {
  int64_t n = 1;
  for (size_t d = 1; d < s.size(); ++d) n *= s[d];
  return n;
}

int64_t rows_of(const Shape& s, const OptimizerSharding& sh) {
  const int64_t dim0 = dim0_of(s);
  return sh.sharded ? (dim0 + sh.world - 1) / sh.world : dim0;
}

// A field's shape on a side: the parameter's, or its chunk's ([rows] + the trailing dims).
Shape slice_shape(const Shape& s, const OptimizerSharding& sh) {
  if (!sh.sharded) return s;
  Shape out{rows_of(s, sh)};
  out.insert(out.end(), s.begin() + std::min<size_t>(1, s.size()), s.end());
  return out;
}

Fields read_fields(torch::serialize::InputArchive& a) {
  Fields out;
  for (const auto& key : a.keys()) {
    c10::IValue v;
    a.read(key, v);
    out.emplace_back(key, std::move(v));
  }
  return out;
}

}  // namespace

std::string reshard_optimizer_state(const std::vector<std::vector<Shape>>& shapes, const OptimizerSharding& from,
                                    const std::function<std::string(int64_t)>& read_source, const OptimizerSharding& to,
                                    int64_t to_rank, const std::function<std::string(int64_t)>& what) {
  torch::NoGradGuard ng;
  const int64_t groups = static_cast<int64_t>(shapes.size());
  struct Param {
    bool has = false;
    Fields fields;  // the target's: per-row tensors re-cut, anything else source 0's
  };
  std::vector<std::vector<Param>> out(groups);
  std::vector<std::vector<std::string>> keys0(groups);  // source 0's parameter keys
  std::vector<Fields> options0(groups);
  c10::IValue version;
  for (int64_t g = 0; g < groups; ++g) out[g].resize(shapes[g].size());

  for (int64_t k = 0; k < from.world; ++k) {
    auto fail = [&](const std::string& why) { throw std::runtime_error(fmt::format("{}: {}", what(k), why)); };
    torch::serialize::InputArchive a;
    {
      std::istringstream is(read_source(k));
      try {
        a.load_from(is, torch::Device(torch::kCPU));
      } catch (const std::exception&) {
        fail("it is not an optimizer state archive");
      }
    }
    torch::serialize::InputArchive pg, st;
    if (!a.try_read("param_groups", pg) || !a.try_read("state", st)) fail("it is not an optimizer state archive");
    if (k == 0 && !a.try_read("pytorch_version", version)) fail("it is not an optimizer state archive");
    torch::Tensor n;
    pg.read("param_groups/size", n);
    if (n.item<int64_t>() != groups)
      fail(fmt::format("it has {} parameter group(s), this run's optimizer {}", n.item<int64_t>(), groups));
    std::vector<std::vector<std::string>> keys(groups);
    for (int64_t g = 0; g < groups; ++g) {
      torch::serialize::InputArchive ga;
      pg.read("param_groups/" + std::to_string(g), ga);
      torch::Tensor size;
      ga.read("params/size", size);
      if (size.item<int64_t>() != static_cast<int64_t>(shapes[g].size()))
        fail(fmt::format("its parameter group {} holds {} tensor(s), this run's {}", g, size.item<int64_t>(), shapes[g].size()));
      for (size_t j = 0; j < shapes[g].size(); ++j) {
        c10::IValue key;
        ga.read("params/" + std::to_string(j), key);
        keys[g].push_back(key.toStringRef());
      }
      if (k == 0) {
        torch::serialize::InputArchive oa;
        ga.read("options", oa);
        options0[g] = read_fields(oa);
      }
    }
    if (k == 0) keys0 = keys;
    const auto present = st.keys();
    for (int64_t g = 0; g < groups; ++g) {
      for (size_t j = 0; j < shapes[g].size(); ++j) {
        Param& p = out[g][j];
        const bool here = std::find(present.begin(), present.end(), keys[g][j]) != present.end();
        if (k == 0) p.has = here;
        if (here != p.has)
          fail(fmt::format("parameter {} of group {} has {} state here and {} in the first shard", j, g, here ? "a" : "no",
                           p.has ? "a" : "no"));
        if (!here) continue;
        torch::serialize::InputArchive ps;
        st.read(keys[g][j], ps);
        const Fields fields = read_fields(ps);
        const Shape& shape = shapes[g][j];
        const int64_t dim0 = dim0_of(shape), rest = rest_of(shape);
        const int64_t rows_from = rows_of(shape, from), rows_to = rows_of(shape, to);
        const int64_t start_from = from.sharded ? k * rows_from : 0, start_to = to.sharded ? to_rank * rows_to : 0;
        // The rows this source holds of the target's chunk (none: it still is read, for its checks).
        const int64_t lo = std::max(start_from, start_to),
                      hi = std::min({start_from + rows_from, start_to + rows_to, dim0});
        const Shape want = slice_shape(shape, from);
        if (k == 0) {
          for (const auto& [name, v] : fields) {
            if (!v.isTensor() || name == "step") {
              p.fields.emplace_back(name, v);
              continue;
            }
            p.fields.emplace_back(name, torch::zeros(slice_shape(shape, to), v.toTensor().options()));
          }
        }
        if (fields.size() != p.fields.size())
          fail(fmt::format("parameter {} of group {} has {} state field(s) here and {} in the first shard", j, g,
                           fields.size(), p.fields.size()));
        for (size_t f = 0; f < fields.size(); ++f) {
          const auto& [name, v] = fields[f];
          if (name != p.fields[f].first)
            fail(fmt::format("parameter {} of group {}'s state field '{}' is '{}' in the first shard", j, g, name,
                             p.fields[f].first));
          if (!v.isTensor() || name == "step") continue;
          const torch::Tensor src = v.toTensor();
          if (src.sizes().vec() != want)
            fail(fmt::format("parameter {} of group {}'s '{}' has shape [{}], not [{}] (a parameter of shape [{}] cut for {} "
                             "process(es))",
                             j, g, name, fmt::join(src.sizes(), ", "), fmt::join(want, ", "), fmt::join(shape, ", "), from.world));
          if (hi <= lo || rest == 0) continue;
          torch::Tensor dst = p.fields[f].second.toTensor();
          dst.reshape({rows_to, rest})
              .narrow(0, lo - start_to, hi - lo)
              .copy_(src.reshape({rows_from, rest}).narrow(0, lo - start_from, hi - lo));
        }
      }
    }
  }

  torch::serialize::OutputArchive root;
  auto cu = root.compilation_unit();
  root.write("pytorch_version", version);
  torch::serialize::OutputArchive st(cu);
  for (int64_t g = 0; g < groups; ++g)
    for (size_t j = 0; j < shapes[g].size(); ++j) {
      if (!out[g][j].has) continue;
      torch::serialize::OutputArchive ps(cu);
      for (const auto& [name, v] : out[g][j].fields) ps.write(name, v);
      st.write(keys0[g][j], ps);
    }
  root.write("state", st);
  torch::serialize::OutputArchive pg(cu);
  pg.write("param_groups/size", torch::tensor(groups));
  for (int64_t g = 0; g < groups; ++g) {
    torch::serialize::OutputArchive ga(cu), oa(cu);
    ga.write("params/size", torch::tensor(static_cast<int64_t>(shapes[g].size())));
    for (size_t j = 0; j < shapes[g].size(); ++j) ga.write("params/" + std::to_string(j), c10::IValue(keys0[g][j]));
    for (const auto& [name, v] : options0[g]) oa.write(name, v);
    ga.write("options", oa);
    pg.write("param_groups/" + std::to_string(g), ga);
  }
  root.write("param_groups", pg);
  std::ostringstream os;
  root.save_to(os);
  return os.str();
}

}  // namespace strobe
