// Kernel tables of each compiled SIMD target (defined in kernels_<target>.cpp).
#pragma once

#include "codec/wire.hpp"  // fine_symbols codes the wire format's fine change symbols
#include "common/bits.hpp"
#include "format/planes.hpp"

namespace ciera::format {
extern const PlaneKernels kScalarKernels;
#if defined(CIERA_HAVE_X86_TARGETS)
extern const PlaneKernels kSse2Kernels;
extern const PlaneKernels kAvx2Kernels;
extern const PlaneKernels kAvx512Kernels;
#endif
}  // namespace ciera::format
