// The reduction itself is the layer's kernels (kernels_impl.inc), one copy per SIMD target; this
// file picks the dtype's.
#include "collectives/reduction.hpp"

#include <cstdint>

#include "collectives/kernels.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ciera::collectives {

namespace {

// The definition's floating point (reduction.hpp: round to nearest, ties to even; subnormals
// added as they are) for the duration of one reduction, whatever the calling thread's mode, then
// the caller's mode back. A thread that flushes subnormals (torch.set_flush_denormal(True), -ffast-
// math's start-up code) would otherwise reduce differently from the pool's workers, which keep
// the default: which of them reduced a round depended on timing, and so did the bits.
class DefinedFloatingPoint {
 public:
#if defined(__x86_64__) || defined(__i386__)
  // MXCSR at power-on: every exception masked, round to nearest, no flush-to-zero, no
  // denormals-are-zero.
  DefinedFloatingPoint() : saved_(_mm_getcsr()) { _mm_setcsr(0x1F80u); }
  ~DefinedFloatingPoint() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  // FPCR: round to nearest (RMode 0), no flush-to-zero (FZ, FZ16), IEEE NaN handling (DN off),
  // no alternate handling (AH, FIZ): the reset value's arithmetic.
  DefinedFloatingPoint() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t defined = saved_ & ~((3ull << 22) | (1ull << 24) | (1ull << 19) | (1ull << 25) |
                                        (1ull << 1) | (1ull << 0));
    asm volatile("msr fpcr, %0" : : "r"(defined));
  }
  ~DefinedFloatingPoint() { asm volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#else
  // Other targets: the caller's mode (docs/collectives.md says so).
  DefinedFloatingPoint() {}
#endif
 public:
  DefinedFloatingPoint(const DefinedFloatingPoint&) = delete;
  DefinedFloatingPoint& operator=(const DefinedFloatingPoint&) = delete;
};

}  // namespace

void reduce_in_rank_order(DType dtype, ReduceOp op, std::span<const std::byte* const> parts,
                          std::byte* out, uint64_t values) {
  reduce_in_rank_order(reduction_kernels(), dtype, op, parts, out, values);
}

void reduce_in_rank_order(const ReductionKernels& kernels, DType dtype, ReduceOp op,
                          std::span<const std::byte* const> parts, std::byte* out,
                          uint64_t values) {
  const DefinedFloatingPoint defined;
  const bool average = op == ReduceOp::kAvg;
  switch (dtype) {
    case DType::kBF16:
      return kernels.reduce_bf16(parts.data(), parts.size(), average, out, values);
    case DType::kFP16:
      return kernels.reduce_fp16(parts.data(), parts.size(), average, out, values);
    case DType::kFP32:
      return kernels.reduce_fp32(parts.data(), parts.size(), average, out, values);
  }
}

}  // namespace ciera::collectives
