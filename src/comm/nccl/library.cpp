#include "comm/nccl/library.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "ciera/transport.hpp"

namespace ciera::nccl::detail {

Version Version::from_code(int code) {
  if (code >= 20900) return {code / 10000, code % 10000 / 100, code % 100};
  return {code / 1000, code % 1000 / 100, code % 100};
}

std::string Version::text() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string Library::error_text(ncclResult_t result) const {
  const char* text = get_error_string ? get_error_string(result) : nullptr;
  return text ? std::string(text) : "NCCL error " + std::to_string(static_cast<int>(result));
}

namespace {

std::string last_dl_error() {
  const char* e = dlerror();
  return e ? std::string(e) : std::string("unknown dlerror");
}

// Closes a handle unless it was handed over (only libraries that failed a check are closed, and
// nothing of theirs has run but ncclGetVersion).
struct HandleCloser {
  void operator()(void* handle) const { dlclose(handle); }
};

template <typename Function>
void bind(void* handle, const std::string& path, const char* name, Function& slot) {
  dlerror();
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    throw CommError("NCCL library " + path + " has no " + name + " (" + last_dl_error() +
                    "); the NCCL transport needs NCCL " + kOldestSupported.text() + " or newer");
  }
  slot = reinterpret_cast<Function>(symbol);
}

}  // namespace

Library open_library(const std::string& path) {
  dlerror();
  // RTLD_LOCAL: NCCL's symbols stay out of the global namespace, so that a second NCCL (torch's)
  // never resolves against this one or the other way round.
  std::unique_ptr<void, HandleCloser> handle(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (!handle) throw CommError("cannot load the NCCL library " + path + ": " + last_dl_error());
  Library lib;
  lib.path = path;
  void* h = handle.get();
  bind(h, path, "ncclGetVersion", lib.get_version);
  bind(h, path, "ncclGetErrorString", lib.get_error_string);
  int code = 0;
  if (const ncclResult_t r = lib.get_version(&code); r != ncclSuccess) {
    throw CommError("NCCL library " + path + ": ncclGetVersion failed: " + lib.error_text(r));
  }
  lib.version = Version::from_code(code);
  if (!lib.version.at_least(kOldestSupported.major, kOldestSupported.minor)) {
    throw CommError(
        "NCCL " + lib.version.text() + " (" + path + ") is older than " + kOldestSupported.text() +
        ", the oldest the NCCL transport supports (it needs non-blocking communicators)");
  }
  bind(h, path, "ncclGetUniqueId", lib.get_unique_id);
  bind(h, path, "ncclCommInitRankConfig", lib.comm_init_rank_config);
  bind(h, path, "ncclCommGetAsyncError", lib.comm_get_async_error);
  bind(h, path, "ncclCommFinalize", lib.comm_finalize);
  bind(h, path, "ncclCommDestroy", lib.comm_destroy);
  bind(h, path, "ncclCommAbort", lib.comm_abort);
  bind(h, path, "ncclGetLastError", lib.get_last_error);
  bind(h, path, "ncclAllGather", lib.all_gather);
  bind(h, path, "ncclBroadcast", lib.broadcast);
  bind(h, path, "ncclAllReduce", lib.all_reduce);
  bind(h, path, "ncclGroupStart", lib.group_start);
  bind(h, path, "ncclGroupEnd", lib.group_end);
  handle.release();  // kept open for the life of the process
  return lib;
}

namespace {
std::mutex library_mutex;
std::unique_ptr<const Library> loaded;  // guarded by library_mutex
}  // namespace

bool library_loaded() {
  std::lock_guard<std::mutex> lock(library_mutex);
  return loaded != nullptr;
}

const Library& library() {
  std::lock_guard<std::mutex> lock(library_mutex);
  if (loaded) return *loaded;

  std::vector<std::string> candidates;
  const char* chosen = std::getenv("CIERA_NCCL_LIBRARY");
  if (chosen != nullptr && *chosen != '\0') {
    candidates.push_back(chosen);  // the user's choice, and nothing else
  } else {
    candidates.push_back("libnccl.so.2");
#ifdef CIERA_NCCL_FALLBACK_LIBRARY
    candidates.push_back(CIERA_NCCL_FALLBACK_LIBRARY);
#endif
  }
  std::string reasons;
  for (const std::string& path : candidates) {
    try {
      loaded = std::make_unique<const Library>(open_library(path));
      return *loaded;
    } catch (const CommError& e) {
      reasons += (reasons.empty() ? "" : "; ") + std::string(e.what());
    }
  }
  throw CommError(reasons +
                  (chosen != nullptr && *chosen != '\0'
                       ? std::string(" (from CIERA_NCCL_LIBRARY)")
                       : std::string(" (set CIERA_NCCL_LIBRARY to the path of libnccl.so.2; "
                                     "pip's nvidia-nccl-cu13 installs it in "
                                     "site-packages/nvidia/nccl/lib)")));
}

}  // namespace ciera::nccl::detail
