#include "common/simd_targets.hpp"

#include <cstdlib>
#include <string>
#include <vector>

#include "ciera/error.hpp"

namespace ciera::common {
namespace {

std::vector<SimdTarget> detect_available() {
  std::vector<SimdTarget> found;
#if defined(CIERA_HAVE_X86_TARGETS)
  __builtin_cpu_init();
  // The AVX-512 kernels use BW, CD, VL, VBMI and VBMI2 (byte permutes and compresses).
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vbmi") &&
      __builtin_cpu_supports("avx512vbmi2")) {
    found.push_back(SimdTarget::kAvx512);
  }
  if (__builtin_cpu_supports("avx2")) found.push_back(SimdTarget::kAvx2);
  found.push_back(SimdTarget::kSse2);
#endif
  found.push_back(SimdTarget::kScalar);
  return found;
}

const std::vector<SimdTarget>& available_list() {
  static const std::vector<SimdTarget> list = detect_available();
  return list;
}

SimdTarget choose() {
  const auto& list = available_list();
  const char* wanted = std::getenv("CIERA_KERNELS");
  if (wanted == nullptr || *wanted == '\0') return list.front();
  for (SimdTarget target : list) {
    if (simd_target_name(target) == wanted) return target;
  }
  std::string names;
  for (SimdTarget target : list) {
    names += std::string(names.empty() ? "" : ", ") + std::string(simd_target_name(target));
  }
  throw ConfigError("CIERA_KERNELS=" + std::string(wanted) +
                    " is not available on this CPU (available: " + names + ")");
}

}  // namespace

std::string_view simd_target_name(SimdTarget target) {
  switch (target) {
    case SimdTarget::kScalar: return "scalar";
    case SimdTarget::kSse2: return "sse2";
    case SimdTarget::kAvx2: return "avx2";
    case SimdTarget::kAvx512: return "avx512";
  }
  return "unknown";
}

std::span<const SimdTarget> available_simd_targets() { return available_list(); }

SimdTarget chosen_simd_target() {
  static const SimdTarget chosen = choose();
  return chosen;
}

}  // namespace ciera::common
