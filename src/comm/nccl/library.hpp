// NCCL, loaded at run time. The transport never links libnccl: it dlopen()s libnccl.so.2 and
// calls it through a table of function pointers, for two reasons:
//   * in a PyTorch process it must use the NCCL torch already loaded (dlopen by soname returns
//     that library), not a second copy with its own state;
//   * the build needs only nccl.h, not a 340 MB library (scripts/nccl-header.sh).
// The table's types come from nccl.h (decltype), so a signature mismatch does not compile.
#pragma once

#include <nccl.h>

#include <string>

namespace ciera::nccl::detail {

// An NCCL version; ncclGetVersion's code decoded (2.9 and later: major*10000 + minor*100 + patch;
// older: major*1000 + minor*100 + patch).
struct Version {
  int major = 0, minor = 0, patch = 0;

  static Version from_code(int code);
  bool at_least(int major_at_least, int minor_at_least) const {
    return major != major_at_least ? major > major_at_least : minor >= minor_at_least;
  }
  std::string text() const;  // "2.21.5"
};

// The oldest NCCL the transport runs on: non-blocking communicators (ncclConfig_t.blocking),
// ncclCommFinalize and ncclGetLastError arrived in 2.14.
inline constexpr Version kOldestSupported{2, 14, 0};
// The oldest NCCL that lets several ranks of one communicator share a GPU (with
// NCCL_MULTI_RANK_GPU_ENABLE=1).
inline constexpr Version kOldestMultiRankGpu{2, 30, 0};

struct Library {
  std::string path;  // as passed to dlopen
  Version version;
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&::ncclCommFinalize) comm_finalize = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclGetLastError) get_last_error = nullptr;
  decltype(&::ncclAllGather) all_gather = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;

  // "unhandled cuda error (run with NCCL_DEBUG=INFO for details)", and the like.
  std::string error_text(ncclResult_t result) const;
};

// Loads the library at `path` (a file name dlopen searches for, or a path) and every function
// the transport calls, and checks its version. Throws CommError naming the file and dlerror(),
// the missing function, or the version. The handle stays open for the life of the process:
// NCCL keeps threads that must not lose their code.
Library open_library(const std::string& path);

// The process's NCCL, loaded on first use and then kept: the file CIERA_NCCL_LIBRARY names if it
// is set, else libnccl.so.2 as the dynamic loader finds it (the copy already in the process, if
// any), else the library beside the nccl.h the build used, if it had one. Throws CommError naming
// every file tried and why each failed; a later call tries again.
const Library& library();

// Whether library() has loaded NCCL in this process (so CIERA_NCCL_LIBRARY no longer applies).
bool library_loaded();

}  // namespace ciera::nccl::detail
