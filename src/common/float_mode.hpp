// The floating-point mode that arithmetic with promised bits runs in.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ciera {

// IEEE 754's default arithmetic (round to nearest, ties to even; subnormals kept, neither flushed
// nor read as zero) for this object's life, whatever the thread's mode was, then that mode back.
// For arithmetic whose bits are promised: the same on every thread and every rank. A thread that
// flushes subnormals (torch.set_flush_denormal(True), -ffast-math's start-up code) computes
// otherwise, and work spread over a pool runs partly on the caller's thread, partly on workers.
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
    asm volatile("msr fpcr, %0" : : "r"(defined) : "memory");
  }
  ~DefinedFloatingPoint() { asm volatile("msr fpcr, %0" : : "r"(saved_) : "memory"); }

 private:
  uint64_t saved_;
#else
  // Other targets: the thread's mode (docs/collectives.md says so).
  DefinedFloatingPoint() {}
#endif
 public:
  DefinedFloatingPoint(const DefinedFloatingPoint&) = delete;
  DefinedFloatingPoint& operator=(const DefinedFloatingPoint&) = delete;
};

}  // namespace ciera
