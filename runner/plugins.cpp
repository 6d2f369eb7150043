#include "runner/plugins.h"

#include <dlfcn.h>
#include <elf.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "strobe/checkpoint/mapped_file.h"
#include "strobe/checkpoint/sha256.h"
#include "strobe/config/registry.h"

namespace strobe {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMarkerSection = ".strobe_plugin";
constexpr const char* kMarkerPrefix = "strobe-plugin 1 ";
// The C++ library ABI, as the plugin marker's generated source (cmake/StrobePlugin.cmake) names it.
#if defined(_LIBCPP_VERSION)
constexpr const char* kCxxAbi = "libc++";
#elif defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
constexpr const char* kCxxAbi = "libstdc++-cxx11";
#else
constexpr const char* kCxxAbi = "libstdc++-old";
#endif

std::string read_range(std::ifstream& in, uint64_t offset, uint64_t size, uint64_t file_size, const std::string& path) {
  if (offset > file_size || size > file_size - offset)
    throw PluginError(fmt::format("plugin {}: is not a valid shared library (a section lies outside the file)", path));
  std::string out(size, '\0');
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(out.data(), static_cast<std::streamsize>(size));
  if (!in) throw PluginError(fmt::format("plugin {}: cannot be read", path));
  return out;
}

// The plugin being loaded, for the terminate handler: an exception thrown by a static initialiser
// outside a STROBE_REGISTER line unwinds into the dynamic loader, which cannot pass it on, so
// std::terminate runs before any catch around dlopen could see it.
const std::string* g_loading = nullptr;

[[noreturn]] void plugin_initialiser_threw() {
  std::string what = "std::terminate was called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "an exception that is not a std::exception";
    }
  }
  std::fflush(stdout);
  fmt::print(stderr, "strobe: plugin error: plugin {}: a static initialiser threw while it loaded: {}\n",
             g_loading ? *g_loading : std::string("?"), what);
  std::fflush(stderr);
  std::_Exit(2);
}

}  // namespace

PluginMarker read_plugin_marker(const std::string& path) {
  std::error_code ec;
  if (const std::string kind = checkpoint::non_regular_kind(path); !kind.empty())
    throw PluginError(fmt::format("plugin {}: is {}, not a shared library file", path, kind));
  if (!fs::is_regular_file(path, ec)) throw PluginError(fmt::format("plugin {}: no such file", path));
  const uint64_t file_size = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw PluginError(fmt::format("plugin {}: cannot be read", path));
  Elf64_Ehdr eh{};
  in.read(reinterpret_cast<char*>(&eh), sizeof eh);
  if (!in || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_type != ET_DYN)
    throw PluginError(fmt::format("plugin {}: is not a shared library (build it with strobe_add_plugin)", path));
  if (eh.e_shentsize != sizeof(Elf64_Shdr) || eh.e_shnum == 0 || eh.e_shstrndx >= eh.e_shnum)
    throw PluginError(fmt::format("plugin {}: is not a valid shared library (no section table)", path));
  const std::string table = read_range(in, eh.e_shoff, uint64_t(eh.e_shnum) * sizeof(Elf64_Shdr), file_size, path);
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  std::memcpy(sections.data(), table.data(), table.size());
  const auto& names_header = sections[eh.e_shstrndx];
  const std::string names = read_range(in, names_header.sh_offset, names_header.sh_size, file_size, path);
  for (const auto& sh : sections) {
    if (sh.sh_name >= names.size() || std::strcmp(names.c_str() + sh.sh_name, kMarkerSection) != 0) continue;
    std::string text = read_range(in, sh.sh_offset, std::min<uint64_t>(sh.sh_size, 4096), file_size, path);
    text = text.substr(0, text.find('\0'));
    PluginMarker m;
    if (text.rfind(kMarkerPrefix, 0) == 0) {
      std::istringstream fields(text.substr(std::strlen(kMarkerPrefix)));
      for (std::string f; fields >> f;) {
        if (f.rfind("strobe=", 0) == 0) m.strobe_version = f.substr(7);
        if (f.rfind("torch=", 0) == 0) m.torch_version = f.substr(6);
        if (f.rfind("headers=", 0) == 0) m.headers = f.substr(8);
        if (f.rfind("cxxabi=", 0) == 0) m.cxx_abi = f.substr(7);
      }
    }
    if (m.strobe_version.empty() || m.torch_version.empty())
      throw PluginError(fmt::format("plugin {}: its Strobe marker '{}' cannot be read (rebuild it with strobe_add_plugin)", path,
                                    config::shown(text)));
    return m;
  }
  throw PluginError(fmt::format("plugin {}: has no Strobe marker: not built with strobe_add_plugin (find_package(Strobe))", path));
}

std::vector<LoadedPlugin> load_plugins(const std::vector<std::string>& paths) {
  std::vector<config::PluginSpec> specs;
  for (const auto& p : paths) specs.push_back(config::PluginSpec{p, "", "", ""});
  return load_plugins(specs, false);
}

std::vector<config::PluginSpec> with_recorded_plugins(std::vector<config::PluginSpec> plugins,
                                                      const std::vector<config::PluginSpec>& recorded) {
  for (const auto& r : recorded) {
    auto same = std::find_if(plugins.begin(), plugins.end(), [&](const auto& p) { return p.path == r.path; });
    if (same == plugins.end())
      same = std::find_if(plugins.begin(), plugins.end(),
                          [&](const auto& p) { return fs::path(p.path).filename() == fs::path(r.path).filename(); });
    if (same == plugins.end()) {
      plugins.push_back(r);
    } else if (!r.sha256.empty()) {
      same->sha256 = r.sha256;
      same->recorded_by = r.recorded_by;
    }
  }
  return plugins;
}

std::vector<LoadedPlugin> load_plugins(const std::vector<config::PluginSpec>& plugins, bool allow_changed) {
  // Absolute path -> the hash of what was loaded from it (what runs, whatever the file holds now).
  static std::map<std::string, std::string> loaded;
  std::vector<LoadedPlugin> out;
  // One plugin; a PluginError names the config file and line of a `plugins:` entry before it.
  auto load_one = [&](const config::PluginSpec& want) {
    const std::string& given = want.path;
    std::error_code ec;
    const std::string path = fs::absolute(given, ec).lexically_normal().string();
    LoadedPlugin got;
    got.spec.path = path;
    const auto already = loaded.find(path);
    PluginMarker marker;
    if (already != loaded.end()) {
      got.spec.sha256 = already->second;
    } else {
      try {
        marker = read_plugin_marker(given);  // a missing or unreadable file is named before it is hashed
      } catch (const PluginError& e) {
        if (want.recorded_by.empty()) throw;
        throw PluginError(fmt::format("{} (recorded by {})", e.what(), want.recorded_by));
      }
      try {
        got.spec.sha256 = checkpoint::sha256_file(path);
      } catch (const std::runtime_error& e) {
        throw PluginError(fmt::format("plugin {}", e.what()));
      }
    }
    if (!want.sha256.empty() && want.sha256 != got.spec.sha256) {
      const std::string change = fmt::format("plugin {}: changed since {} recorded it (sha256 {} there, {} now)", given,
                                             want.recorded_by.empty() ? "the run" : want.recorded_by, want.sha256,
                                             got.spec.sha256);
      if (!allow_changed)
        throw PluginError(change + ": rebuild the plugin the run was made with, or pass --allow-changed-plugins to go on with this one");
      got.changed = change + "; going on with it (--allow-changed-plugins): the run may not reproduce";
      got.spec.replaced_sha256 = want.sha256;
    } else {
      got.spec.replaced_sha256 = want.replaced_sha256;
    }
    out.push_back(got);
    if (already != loaded.end()) return;
    const PluginMarker& m = marker;
    if (m.strobe_version != STROBE_VERSION || m.torch_version != TORCH_VERSION)
      throw PluginError(fmt::format("plugin {}: built against Strobe {} with libtorch {}, but this is Strobe {} with libtorch {}: "
                                    "rebuild it against this installation",
                                    given, m.strobe_version, m.torch_version, STROBE_VERSION, TORCH_VERSION));
    // The same version can still be another ABI: edited public headers, another C++ library ABI.
    if (m.headers.empty() || m.cxx_abi.empty())
      throw PluginError(fmt::format("plugin {}: its marker has no ABI fingerprint (built by an older strobe_add_plugin): "
                                    "rebuild it against this installation",
                                    given));
    if (m.headers != built_headers_fingerprint())
      throw PluginError(fmt::format("plugin {}: built against other Strobe headers (fingerprint {}, this Strobe's {}): its "
                                    "classes may not match this Strobe's; rebuild it against this installation",
                                    given, m.headers, built_headers_fingerprint()));
    if (m.cxx_abi != kCxxAbi)
      throw PluginError(fmt::format("plugin {}: built for the C++ library ABI {}, but this Strobe uses {}: rebuild it against "
                                    "this installation with the same C++ library (for libstdc++: _GLIBCXX_USE_CXX11_ABI={})",
                                    given, m.cxx_abi, kCxxAbi, std::string(kCxxAbi) == "libstdc++-cxx11" ? 1 : 0));
    RegistrationLog log;
    current_registration_log() = &log;
    g_loading = &given;
    const std::terminate_handler previous = std::set_terminate(plugin_initialiser_threw);
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    std::set_terminate(previous);
    g_loading = nullptr;
    current_registration_log() = nullptr;
    if (handle == nullptr) {
      const char* why = dlerror();
      throw PluginError(fmt::format("plugin {}: cannot be loaded: {}", given, why ? why : "unknown error"));
    }
    loaded.emplace(path, got.spec.sha256);  // never unloaded: what registered stays registered
    if (!log.errors.empty()) {
      std::string all;
      for (const auto& e : log.errors) all += (all.empty() ? "" : "; ") + e;
      throw PluginError(fmt::format("plugin {}: {}", given, all));
    }
  };
  for (const auto& want : plugins) {
    try {
      load_one(want);
    } catch (const PluginError& e) {
      if (want.listed_at.empty()) throw;
      throw PluginError(want.listed_at + ": " + e.what());
    }
  }
  return out;
}

void add_plugins_to(config::Document& doc, const std::vector<std::string>& paths) {
  if (paths.empty()) return;
  YAML::Node root = doc.root().node();
  YAML::Node list = root["plugins"];
  if (!list.IsDefined() || list.IsNull()) list = YAML::Node(YAML::NodeType::Sequence);
  for (const auto& p : paths) list.push_back(std::filesystem::absolute(p).lexically_normal().string());
  root["plugins"] = list;
}

}  // namespace strobe
