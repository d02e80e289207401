// The plane kernels compiled for the 'avx2' target (flags set per file in CMakeLists.txt).
#include <cstring>
#include <new>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// xxHash's implementation inlined and compiled for this target (the content checksum kernels).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kAvx2Kernels = make_kernels("avx2");
}  // namespace ciera::format
