#include "codec/fine_kernels.hpp"

namespace ciera::codec {

// One per compiled SIMD target (ciera_layer_kernels, cmake/CieraLayers.cmake).
extern const FineKernels kScalarKernels;
#if defined(CIERA_HAVE_X86_TARGETS)
extern const FineKernels kSse2Kernels;
extern const FineKernels kAvx2Kernels;
extern const FineKernels kAvx512Kernels;
#endif

namespace {
#if defined(CIERA_HAVE_X86_TARGETS)
constexpr common::KernelsByTarget<FineKernels> kTables = {&kScalarKernels, &kSse2Kernels,
                                                           &kAvx2Kernels, &kAvx512Kernels};
#else
constexpr common::KernelsByTarget<FineKernels> kTables = {&kScalarKernels};
#endif
}  // namespace

const FineKernels& fine_kernels_for(common::SimdTarget target) {
  return common::kernels_for(kTables, target);
}

const FineKernels& fine_kernels() {
  static const FineKernels& chosen = fine_kernels_for(common::chosen_simd_target());
  return chosen;
}

}  // namespace ciera::codec
