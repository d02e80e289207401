// Built with -ffp-contract=off (src/collectives/CMakeLists.txt): a fused multiply-add would round
// differently from the documented additions.
#include "collectives/reduction.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "common/floats.hpp"

namespace ciera::collectives {
namespace {

// Values per pass: the FP32 accumulators of one pass stay in L1 while every part is added.
constexpr uint64_t kPassValues = 2048;

template <typename Bits, float (*widen)(Bits), Bits (*narrow)(float)>
void reduce_16(ReduceOp op, std::span<const std::byte* const> parts, std::byte* out,
               uint64_t values) {
  std::array<float, kPassValues> sum;
  std::array<Bits, kPassValues> bits;
  const float ranks = static_cast<float>(parts.size());
  for (uint64_t begin = 0; begin < values; begin += kPassValues) {
    const uint64_t n = std::min(kPassValues, values - begin);
    for (size_t p = 0; p < parts.size(); ++p) {
      std::memcpy(bits.data(), parts[p] + begin * sizeof(Bits), n * sizeof(Bits));
      if (p == 0) {
        for (uint64_t i = 0; i < n; ++i) sum[i] = widen(bits[i]);
      } else {
        for (uint64_t i = 0; i < n; ++i) sum[i] += widen(bits[i]);
      }
    }
    if (op == ReduceOp::kAvg) {
      for (uint64_t i = 0; i < n; ++i) sum[i] /= ranks;
    }
    for (uint64_t i = 0; i < n; ++i) bits[i] = narrow(sum[i]);
    std::memcpy(out + begin * sizeof(Bits), bits.data(), n * sizeof(Bits));
  }
}

void reduce_fp32(ReduceOp op, std::span<const std::byte* const> parts, std::byte* out,
                 uint64_t values) {
  std::array<float, kPassValues> sum, part;
  const float ranks = static_cast<float>(parts.size());
  for (uint64_t begin = 0; begin < values; begin += kPassValues) {
    const uint64_t n = std::min(kPassValues, values - begin);
    std::memcpy(sum.data(), parts[0] + begin * sizeof(float), n * sizeof(float));
    for (size_t p = 1; p < parts.size(); ++p) {
      std::memcpy(part.data(), parts[p] + begin * sizeof(float), n * sizeof(float));
      for (uint64_t i = 0; i < n; ++i) sum[i] += part[i];
    }
    if (op == ReduceOp::kAvg) {
      for (uint64_t i = 0; i < n; ++i) sum[i] /= ranks;
    }
    std::memcpy(out + begin * sizeof(float), sum.data(), n * sizeof(float));
  }
}

}  // namespace

void reduce_in_rank_order(DType dtype, ReduceOp op, std::span<const std::byte* const> parts,
                          std::byte* out, uint64_t values) {
  switch (dtype) {
    case DType::kBF16:
      return reduce_16<uint16_t, bf16_to_float, float_to_bf16>(op, parts, out, values);
    case DType::kFP16:
      return reduce_16<uint16_t, fp16_to_float, float_to_fp16>(op, parts, out, values);
    case DType::kFP32:
      return reduce_fp32(op, parts, out, values);
  }
}

}  // namespace ciera::collectives
