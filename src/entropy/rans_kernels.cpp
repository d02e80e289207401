#include "entropy/rans_kernels.hpp"

namespace ciera::entropy {

// One per compiled SIMD target (ciera_layer_kernels, cmake/CieraLayers.cmake).
extern const RansKernels kScalarKernels;
#if defined(CIERA_HAVE_X86_TARGETS)
extern const RansKernels kSse2Kernels;
extern const RansKernels kAvx2Kernels;
extern const RansKernels kAvx512Kernels;
#endif

namespace {
#if defined(CIERA_HAVE_X86_TARGETS)
constexpr common::KernelsByTarget<RansKernels> kTables = {&kScalarKernels, &kSse2Kernels,
                                                          &kAvx2Kernels, &kAvx512Kernels};
#else
constexpr common::KernelsByTarget<RansKernels> kTables = {&kScalarKernels};
#endif
}  // namespace

const RansKernels& rans_kernels_for(common::SimdTarget target) {
  return common::kernels_for(kTables, target);
}

const RansKernels& rans_kernels() {
  static const RansKernels& chosen = rans_kernels_for(common::chosen_simd_target());
  return chosen;
}

}  // namespace ciera::entropy
