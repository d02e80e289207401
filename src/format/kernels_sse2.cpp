// The plane kernels compiled for the 'sse2' target (flags set per file in CMakeLists.txt).
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "format/kernels_targets.hpp"

namespace ciera::format {
namespace {
#include "format/kernels_impl.inc"
}  // namespace

const PlaneKernels kSse2Kernels = make_kernels("sse2");
}  // namespace ciera::format
