// The plane kernels compiled for the 'scalar' target (flags set per file in CMakeLists.txt).
// No intrinsics and no auto-vectorisation here: this is the portable fallback.
#define CIERA_SCALAR_ONLY 1
#include <cstring>
#include <new>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

// xxHash's implementation inlined and compiled for this target (the content checksum kernels).
#define XXH_INLINE_ALL
#define XXH_VECTOR 0  // XXH_SCALAR: no SIMD in the scalar target
#include <xxhash.h>

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kScalarKernels = make_kernels("scalar");
}  // namespace ciera::format
