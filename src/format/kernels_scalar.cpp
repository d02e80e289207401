// The plane kernels compiled for the 'scalar' target (flags set per file in CMakeLists.txt).
// No intrinsics and no auto-vectorisation here: this is the portable fallback.
#define CIERA_SCALAR_ONLY 1
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kScalarKernels = make_kernels("scalar");
}  // namespace ciera::format
