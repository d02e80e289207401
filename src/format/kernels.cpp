#include "format/kernels.hpp"

namespace ciera::format {

// One per compiled SIMD target (ciera_layer_kernels, cmake/CieraLayers.cmake).
extern const PlaneKernels kScalarKernels;
#if defined(CIERA_HAVE_X86_TARGETS)
extern const PlaneKernels kSse2Kernels;
extern const PlaneKernels kAvx2Kernels;
extern const PlaneKernels kAvx512Kernels;
#endif

namespace {
#if defined(CIERA_HAVE_X86_TARGETS)
constexpr common::KernelsByTarget<PlaneKernels> kTables = {&kScalarKernels, &kSse2Kernels,
                                                           &kAvx2Kernels, &kAvx512Kernels};
#else
constexpr common::KernelsByTarget<PlaneKernels> kTables = {&kScalarKernels};
#endif
}  // namespace

const PlaneKernels& kernels_for(common::SimdTarget target) {
  return common::kernels_for(kTables, target);
}

const PlaneKernels& kernels() {
  static const PlaneKernels& chosen = kernels_for(common::chosen_simd_target());
  return chosen;
}

void stream_fence() {
#if defined(CIERA_HAVE_X86_TARGETS)
  __builtin_ia32_sfence();
#endif
}

}  // namespace ciera::format
