// The codec layer's kernel table: fine coding of changed exponents (docs/format.md, "Exponent
// section", fine) and the passes of value-delta frames (docs/format.md, "Value-delta frames";
// codec/differences.hpp), compiled once per SIMD target (kernels_impl.inc) and chosen as every
// layer's kernels are (common::chosen_simd_target()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/fine_alphabet.hpp"
#include "common/bits.hpp"
#include "common/simd_targets.hpp"
#include "format/changes.hpp"

namespace ciera::codec {

// Where fine_positions has got to, carried from one call to the next.
struct FinePositionState {
  uint64_t bit = 0;                 // next unread extra bit
  size_t block = 0;                 // changed blocks begun so far (index into the offsets)
  int64_t local = -1;               // the last change's position within its block
  const uint8_t* escape = nullptr;  // next escaped step
  bool bad = false;                 // some position reached the block size
};

struct CodecKernels {
  const char* target;  // common::simd_target_name()
  // Fine coding's change symbols (docs/format.md, "Exponent section", fine) for `n` changes in
  // block order: `positions` are tagged (format::tag_change) and carry format::kBlockStartFlag
  // on each block's first change (positions[0] must). Writes n symbols and appends each gap's
  // extra bits to `extra`.
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

  // Value-delta frames, for 16-bit (…16) and 32-bit (…32) values. `values` and `out` are the
  // caller's shard, at any byte alignment (read and written as bytes); `base` and `z` are the
  // codec's own, aligned to their type. `differences`: for n values,
  // z[i] = zigzag(to_ordered(values[i]) - to_ordered(base[i])) (codec/differences.hpp), then
  // base[i] = values[i] (non-temporal stores where `base` is on a cache line: call
  // format::stream_fence() before it is read on another thread); returns how many z[i] are
  // not 0. `group_symbols`: the symbols of
  // ceil(n / 3) groups of z (z holds zeros up to the next multiple of 3); returns how many of
  // the n values are escaped (z >= 3).
  uint64_t (*differences16)(const uint8_t* values, uint16_t* base, size_t n, uint16_t* z);
  uint64_t (*differences32)(const uint8_t* values, uint32_t* base, size_t n, uint32_t* z);
  uint64_t (*group_symbols16)(const uint16_t* z, size_t n, uint8_t* groups);
  uint64_t (*group_symbols32)(const uint32_t* z, size_t n, uint8_t* groups);
  // The inverse passes. `expand_groups`: z of 3 * groups values from their group symbols
  // (escaped values get 3, for the caller to patch). `apply_differences`: out[i] = base[i] =
  // from_ordered(to_ordered(base[i]) + unzigzag(z[i])) (the receiver's previous values move on
  // in the same pass, with non-temporal stores where `base` is on a cache line: call
  // format::stream_fence() before they are read on another thread); returns how many z[i] are
  // not 0.
  void (*expand_groups16)(const uint8_t* groups, size_t groups_n, uint16_t* z);
  void (*expand_groups32)(const uint8_t* groups, size_t groups_n, uint32_t* z);
  uint64_t (*apply_differences16)(uint16_t* base, const uint16_t* z, size_t n, uint8_t* out);
  uint64_t (*apply_differences32)(uint32_t* base, const uint32_t* z, size_t n, uint8_t* out);
  // Escapes. `collect_escapes`: the z >= 3 of n values, in order, to `escaped` (room for n + 32);
  // returns how many. `place_escapes`: replaces each z == 3 of n values, in order, with the next
  // of `escaped` (which the caller has counted; 32 readable past the last).
  uint64_t (*collect_escapes16)(const uint16_t* z, size_t n, uint16_t* escaped);
  uint64_t (*collect_escapes32)(const uint32_t* z, size_t n, uint32_t* escaped);
  void (*place_escapes16)(uint16_t* z, size_t n, const uint16_t* escaped);
  void (*place_escapes32)(uint32_t* z, size_t n, const uint32_t* escaped);
  // Escaped values among the 3 * n values of n group symbols.
  uint64_t (*count_escapes)(const uint8_t* groups, size_t n);
  // The extra bits of `m` escape symbols (buckets, each at most 32): the sum of
  // escape_extra_bits over them.
  uint64_t (*escape_extra_bits_total)(const uint8_t* buckets, size_t m);
  // The escape symbols (buckets of z - 3) of `m` escaped 16-bit z, to `symbols`, and their
  // extra bits, appended to `extra`.
  void (*escape_symbols16)(const uint16_t* escaped, size_t m, uint8_t* symbols, SlackBitWriter& extra);
  // The inverse: the 16-bit z of `m` escapes from their buckets (each at most 16) and the extra
  // bits from bit `bit` of `extra` (checked present by the caller, 8 readable bytes past them).
  // Returns the bit after the last one read, or kEscapeOverflow if some z exceeds 16 bits
  // (z is then unspecified).
  uint64_t (*escape_values16)(const uint8_t* buckets, size_t m, const uint8_t* extra, uint64_t bit,
                              uint16_t* z);
};

inline constexpr uint64_t kEscapeOverflow = ~uint64_t{0};

// The kernels of the process's SIMD target.
const CodecKernels& codec_kernels();
// The kernels of `target`, which must be available (tests run every available target).
const CodecKernels& codec_kernels_for(common::SimdTarget target);

}  // namespace ciera::codec
