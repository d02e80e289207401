// The module ciera._ext: its version attributes, then each area's bindings (bind.hpp).
#include "bind.hpp"
#include "build_info.hpp"
#include "ciera/ciera.hpp"

PYBIND11_MODULE(_ext, m) {
  namespace cp = ciera::python;
  m.doc() = "CIERA: lossless compressed allgather for sharded MoE training (C++ core)";
  m.attr("__version__") = ciera::kLibraryVersion;
  m.attr("format_version") = ciera::kFormatVersion;
  m.attr("git_commit") = ciera::kGitCommit;  // the commit built from, or "unknown"
  m.attr("MAX_WORKER_THREADS") =
      ciera::kMaxWorkerThreads;  // Engine/CollectivesConfig.worker_threads
  m.attr("with_mpi") =
#if defined(CIERA_WITH_MPI)
      true;
#else
      false;
#endif
  m.attr("with_cuda") =
#if defined(CIERA_WITH_CUDA)
      true;
#else
      false;
#endif
  m.attr("with_nccl") =
#if defined(CIERA_WITH_NCCL)
      true;
#else
      false;
#endif
  cp::bind_errors(m);
  cp::bind_config(m);
  cp::bind_codec(m);
  cp::bind_transport(m);
  cp::bind_engine(m);
  cp::bind_selection(m);
  cp::bind_analysis(m);
  cp::bind_collectives(m);
}
