// Splitting values into an exponent plane and a sign-mantissa plane, and merging them back
// (docs/format.md, "Exponent and sign-mantissa split"). Pure bit permutations: every bit pattern
// round-trips, NaN payloads and -0.0 included.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "ciera/dtype.hpp"
#include "codec/wire.hpp"
#include "common/bits.hpp"
#include "entropy/rans_core.hpp"

namespace ciera::format {

// Storage for one streaming XXH3-64 state (xxHash's XXH3_state_t, which each kernel target
// checks fits), so that the content checksum can run xxHash's code compiled for that target.
struct alignas(64) ChecksumState {
  std::byte bytes[576];
};

// Where fine_positions has got to, carried from one call to the next.
struct FinePositionState {
  uint64_t bit = 0;                 // next unread extra bit
  size_t block = 0;                 // changed blocks begun so far (index into the offsets)
  int64_t local = -1;               // the last change's position within its block
  const uint8_t* escape = nullptr;  // next escaped step
  bool bad = false;                 // some position reached the block size
};

// One SIMD target's kernels. Pointers carry no alignment requirement. `n` counts values.
struct PlaneKernels {
  const char* target;  // "avx512", "avx2", "sse2" or "scalar"
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
  // Fine coding's change symbols (docs/format.md, "Exponent section", fine) for `n` changes in
  // block order: `positions` are tagged (tag_change) and carry kBlockStartFlag on each block's
  // first change (positions[0] must). Writes n symbols and appends each gap's extra bits to
  // `extra`.
  void (*fine_symbols)(const uint16_t* positions, size_t n, uint8_t* symbols, SlackBitWriter& extra);
  // The inverse, on the decoder side: `n` change symbols (0..wire::kMaxChangeSymbol, with bit 7
  // set on each block's first change) and the gap extra bits they call for (LSB first from bit
  // state.bit of `bits`, which the caller has checked are there, with 8 readable bytes past them)
  // give each change's position, offsets[block] + its position in the block (state.block counts
  // the flags seen; `offsets` has an entry per flag plus two readable past the last), and its
  // step: +1, -1 (`exponent_mask`) or the next of state.escape (one per escaped symbol, which the
  // caller has counted). Sets state.bad if a position within its block reaches `block_values`.
  void (*fine_positions)(const uint8_t* symbols, size_t n, const uint8_t* bits,
                         const uint16_t* offsets, uint32_t block_values, uint8_t exponent_mask,
                         FinePositionState& state, uint16_t* positions, uint8_t* steps);
  // rANS-encodes `groups` groups of entropy::kRansStates symbols, the last group first, exactly
  // as entropy::rans_put would one symbol at a time: symbols[kRansStates * g + j] uses
  // states[j] and is below kRansGroupSymbols. Words go below *out, which moves down; the caller
  // guarantees 2 bytes of room per symbol.
  void (*rans_encode_groups)(const entropy::RansGroupTables& tables, uint32_t* states,
                             const uint8_t* symbols, size_t groups, uint8_t** out);
  // rANS-decodes `groups` groups of entropy::kRansStates symbols: symbol kRansStates * g + j
  // from states[j], through the decoder's 4096-slot table (symbol | (freq - 1) << 8 |
  // start << 20). Renormalisation words are read from *in, which moves forward; the caller
  // guarantees 32 readable bytes per group left.
  void (*rans_decode_groups)(const uint32_t* slots, uint32_t* states, const uint8_t** in,
                             uint8_t* out, size_t groups);
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

// The fastest kernels this CPU runs, unless CIERA_KERNELS names another available target.
const PlaneKernels& kernels();
// Every target compiled in and runnable on this CPU (tests run each of them).
std::span<const PlaneKernels* const> available_kernels();

// Byte layout of a shard's sign-mantissa plane.
struct SignMantissaLayout {
  SignMantissaLayout(DType dtype, uint64_t num_values);
  uint64_t total_bytes() const { return total_bytes_; }

  DType dtype;
  uint64_t num_values;
  uint64_t first_plane_bytes;   // BF16: sm; FP16: lo8; FP32: hi
  uint64_t second_plane_bytes;  // BF16: 0; FP16: packed hi3; FP32: lo16

 private:
  uint64_t total_bytes_;
};

// Extra entries split_detect_bf16 may write past the changes and escapes it reports.
inline constexpr size_t kChangeSlack = 64;

// A change's tagged position: its position in the block (below 4096) in bits 0..11, its step
// class (wire::StepClass: +1, -1 or escaped) in bits 13..14, and kBlockStartFlag on a block's
// first change (set by the encoder).
inline constexpr unsigned kStepClassShift = 13;
inline constexpr uint16_t kPositionMask = 0x0FFF;
inline constexpr uint16_t kBlockStartFlag = 0x8000;
inline uint16_t tag_change(uint32_t position, unsigned step_class) {
  return static_cast<uint16_t>(position | step_class << kStepClassShift);
}
// A change at `position` whose exponent moved by `step` (mod 2^E, `mask` = 2^E - 1): its tagged
// position, with the step appended to `escapes` at `escape_count` when it is escaped (branch-free:
// the step is always stored, and counted only then; `escapes` needs room for one more).
inline uint16_t tag_step(uint32_t position, uint8_t step, uint8_t mask, uint8_t* escapes,
                         size_t& escape_count) {
  const unsigned step_class = wire::step_class_of(step, mask);
  escapes[escape_count] = step;
  escape_count += step_class == wire::kStepEscape;
  return tag_change(position, step_class);
}

// Largest `count` accepted by split_values / merge_values in one call.
inline constexpr size_t kMaxChunkValues = 16384;

// Splits values [first, first + count) of a shard. `values` points at value `first`; `exps`
// receives `count` exponents; the sign-mantissa bits go into their place in `sm_plane`, which
// covers the whole shard. Bytes of the FP16 packed plane that hold other values' bits keep them.
void split_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* values,
                  uint64_t first, size_t count, uint8_t* exps, uint8_t* sm_plane);
// Inverse of split_values: writes values [first, first + count) to `values` (pointing at `first`).
void merge_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* exps,
                  const uint8_t* sm_plane, uint64_t first, size_t count, uint8_t* values);
// The exponents of `count` values.
void extract_exponents(DType dtype, const PlaneKernels& k, const uint8_t* values, size_t count,
                       uint8_t* exps);

// Exponent field of the value at `value` / replacing it in place (inline: the decoder patches
// one value per changed exponent).
inline uint8_t exponent_of(DType dtype, const uint8_t* value) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      return static_cast<uint8_t>(x >> 7);
    }
    case DType::kFP16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      return static_cast<uint8_t>((x >> 10) & 0x1F);
    }
    case DType::kFP32: {
      uint32_t x;
      std::memcpy(&x, value, 4);
      return static_cast<uint8_t>(x >> 23);
    }
  }
  return 0;
}

inline void set_exponent(DType dtype, uint8_t* value, uint8_t exponent) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      x = static_cast<uint16_t>((x & 0x807F) | (uint16_t{exponent} << 7));
      std::memcpy(value, &x, 2);
      return;
    }
    case DType::kFP16: {
      uint16_t x;
      std::memcpy(&x, value, 2);
      x = static_cast<uint16_t>((x & 0x83FF) | (uint16_t{static_cast<uint8_t>(exponent & 0x1F)} << 10));
      std::memcpy(value, &x, 2);
      return;
    }
    case DType::kFP32: {
      uint32_t x;
      std::memcpy(&x, value, 4);
      x = (x & 0x807FFFFFu) | (uint32_t{exponent} << 23);
      std::memcpy(value, &x, 4);
      return;
    }
  }
}


// The literal, one-value-at-a-time reading of docs/format.md; tests hold the kernels to it.
namespace reference {
void split(DType dtype, const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* sm_plane);
void merge(DType dtype, const uint8_t* exps, const uint8_t* sm_plane, uint64_t n,
           uint8_t* values);
}  // namespace reference

}  // namespace ciera::format
