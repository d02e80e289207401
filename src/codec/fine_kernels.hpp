// The codec layer's kernel table: fine coding of changed exponents (docs/format.md, "Exponent
// section", fine), compiled once per SIMD target (kernels_impl.inc) and chosen as every layer's
// kernels are (common::chosen_simd_target()).
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

struct FineKernels {
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
};

// The kernels of the process's SIMD target.
const FineKernels& fine_kernels();
// The kernels of `target`, which must be available (tests run every available target).
const FineKernels& fine_kernels_for(common::SimdTarget target);

}  // namespace ciera::codec
