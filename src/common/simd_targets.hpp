// The SIMD targets every layer's kernels are compiled for (cmake/CieraLayers.cmake,
// ciera_layer_kernels) and the one run-time choice among them, so that the format, entropy and
// codec kernels of a process always run the same target. As in Highway: written once, compiled
// per target, dispatched at run time, with a scalar fallback always present.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string_view>

namespace ciera::common {

enum class SimdTarget : unsigned { kScalar = 0, kSse2 = 1, kAvx2 = 2, kAvx512 = 3 };
inline constexpr size_t kSimdTargetCount = 4;

// "scalar", "sse2", "avx2", "avx512": the names CIERA_KERNELS takes.
std::string_view simd_target_name(SimdTarget target);

// Every target compiled in and runnable on this CPU, fastest first (tests run each of them).
std::span<const SimdTarget> available_simd_targets();

// The fastest available target, unless the environment variable CIERA_KERNELS names another
// available one. Chosen once per process; throws ConfigError naming the available targets if
// CIERA_KERNELS names one this CPU cannot run.
SimdTarget chosen_simd_target();

// One layer's kernel tables, indexed by SimdTarget; null where a target is not compiled in.
template <class Kernels>
using KernelsByTarget = std::array<const Kernels*, kSimdTargetCount>;

// The table of `target` (which must be available).
template <class Kernels>
const Kernels& kernels_for(const KernelsByTarget<Kernels>& tables, SimdTarget target) {
  return *tables[static_cast<size_t>(target)];
}

}  // namespace ciera::common
