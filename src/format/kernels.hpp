// The format layer's kernel table: splitting and merging the bit fields of BF16/FP16/FP32
// values, finding changed exponents, streaming copies and the content checksum, compiled once
// per SIMD target (kernels_impl.inc). The entropy layer (entropy/kernels.hpp) and the codec
// (codec/kernels.hpp) own their kernels; all three follow common::chosen_simd_target().
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/simd_targets.hpp"

namespace ciera::format {

// Storage for one streaming XXH3-64 state (xxHash's XXH3_state_t, which each kernel target
// checks fits), so that the content checksum can run xxHash's code compiled for that target.
struct alignas(64) ChecksumState {
  std::byte bytes[576];
};

// One SIMD target's kernels. Pointers carry no alignment requirement. `n` counts values.
struct PlaneKernels {
  const char* target;  // common::simd_target_name(): "avx512", "avx2", "sse2" or "scalar"
  // BF16: values are u16; exps and sm one byte per value.
  void (*split_bf16)(const uint8_t* values, size_t n, uint8_t* exps, uint8_t* sm);
  void (*merge_bf16)(const uint8_t* exps, const uint8_t* sm, size_t n, uint8_t* values);
  void (*exponents_bf16)(const uint8_t* values, size_t n, uint8_t* exps);
  // FP16: lo8 = mantissa[7:0]; hi3 = (sign << 2) | mantissa[9:8], one byte per value (unpacked).
  void (*split_fp16)(const uint8_t* values, size_t n, uint8_t* exps, uint8_t* lo8, uint8_t* hi3);
  void (*merge_fp16)(const uint8_t* exps, const uint8_t* lo8, const uint8_t* hi3, size_t n,
                     uint8_t* values);
  void (*exponents_fp16)(const uint8_t* values, size_t n, uint8_t* exps);
  // FP32: hi = BF16 sign-mantissa byte of the upper half; lo16 = mantissa[15:0] (2 bytes/value).
  void (*split_fp32)(const uint8_t* values, size_t n, uint8_t* exps, uint8_t* hi, uint8_t* lo16);
  void (*merge_fp32)(const uint8_t* exps, const uint8_t* hi, const uint8_t* lo16, size_t n,
                     uint8_t* values);
  void (*exponents_fp32)(const uint8_t* values, size_t n, uint8_t* exps);
  // Positions i < n (n <= 65536) where now[i] != before[i], in increasing order, with the step
  // now[i] - before[i] (mod 256). Returns how many; `positions` and `steps` hold n entries.
  size_t (*find_changes)(const uint8_t* now, const uint8_t* before, size_t n, uint16_t* positions,
                         uint8_t* steps);
  // split_bf16 fused with change detection against `cache`, which is then updated to the new
  // exponents (exact detection in one pass; n <= 4096). Writes each change's tagged position
  // (tag_change) in increasing order and returns how many; appends the escaped steps (neither
  // +1 nor -1) to `escapes` and adds their number to `*escape_count`. `positions` and
  // `escapes` need kChangeSlack entries beyond n: vector targets store whole registers.
  // With `stream_sm`, whole cache lines of `sm` are written with non-temporal stores where `sm`
  // is aligned for them (callers then call stream_fence() before anyone reads the plane).
  size_t (*split_detect_bf16)(const uint8_t* values, size_t n, uint8_t* sm, uint8_t* cache,
                              uint16_t* positions, uint8_t* escapes, size_t* escape_count,
                              bool stream_sm);
  // memcpy whose stores bypass the caches (non-temporal), for large outputs nobody reads soon:
  // it saves the read-for-ownership of every destination line. Call stream_fence() before
  // another thread may read `dst`.
  void (*stream_copy)(uint8_t* dst, const uint8_t* src, size_t n);
  // Streaming XXH3-64 with seed 0 (the content checksum, docs/format.md): xxHash's own code,
  // inlined (XXH_INLINE_ALL) and compiled for this target. The shared library's entry points
  // cost a call, a copy into the state's buffer and a reload of its accumulators per update,
  // which for the codec's one update per chunk was a fifth of an encode (docs/benchmarks.md).
  void (*checksum_reset)(ChecksumState& state);
  void (*checksum_update)(ChecksumState& state, const uint8_t* data, size_t bytes);
  uint64_t (*checksum_digest)(const ChecksumState& state);
};

// Orders earlier stream_copy stores before later stores (x86 sfence; a no-op elsewhere).
void stream_fence();

// Outputs at least this large are written with stream_copy: about the L2 of one core, beyond
// which the data would leave the cache before anyone reads it anyway.
inline constexpr uint64_t kStreamingBytes = 4ull << 20;

// The kernels of the process's SIMD target (common::chosen_simd_target(): the fastest this CPU
// runs, unless CIERA_KERNELS names another available one).
const PlaneKernels& kernels();
// The kernels of `target`, which must be available (tests run every available target).
const PlaneKernels& kernels_for(common::SimdTarget target);

}  // namespace ciera::format
