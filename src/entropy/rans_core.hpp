// The rANS coder's constants and one-symbol encoding step (docs/format.md, "Symbol stream",
// rANS), shared by the encoder in rans.cpp and the SIMD kernels that encode whole groups of
// states (entropy/kernels_impl.inc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/bytes.hpp"
#include "common/host_device.hpp"

namespace ciera::entropy {

inline constexpr unsigned kRansScaleBits = 12;
inline constexpr uint32_t kRansTotal = 1u << kRansScaleBits;
// Sixteen interleaved states, one per 32-bit lane of an AVX-512 register, renormalised by 16-bit
// words: states stay in [kRansLowerBound, 2^31), so a symbol moves at most one word.
inline constexpr unsigned kRansStates = 16;
inline constexpr uint32_t kRansLowerBound = 1u << 15;
inline constexpr size_t kRansStateBytes = 4 * kRansStates;
// A stream is cut into segments of this many symbols (the last may be shorter), each coded with
// its own sixteen states, so that segments decode independently: a GPU decodes them in parallel
// (docs/format.md, "Symbol stream", rANS). A multiple of kRansStates, so symbol i of a stream and
// of its segment use the same state.
inline constexpr uint64_t kRansSegmentSymbols = 16384;
static_assert(kRansSegmentSymbols % kRansStates == 0);
inline constexpr uint64_t rans_segment_count(uint64_t symbols) {
  return (symbols + kRansSegmentSymbols - 1) / kRansSegmentSymbols;
}
// Bytes a rANS body of `symbols` symbols spends beside its table and words: the byte length of
// every segment but the last (u32 each) and every segment's states.
inline constexpr uint64_t rans_framing_bytes(uint64_t symbols) {
  const uint64_t segments = rans_segment_count(symbols);
  return segments == 0 ? 0 : 4 * (segments - 1) + kRansStateBytes * segments;
}
// Group kernels look symbols up in register-held tables of this many entries.
inline constexpr unsigned kRansGroupSymbols = 64;

// One symbol's encoding constants: x / freq becomes a multiply-high and shift (exact for
// x < 2^31), and x_max bounds the state before encoding (renormalise while x >= x_max).
struct RansEncSymbol {
  uint32_t x_max = 0;
  uint32_t rcp_freq = 0;
  uint32_t bias = 0;
  uint32_t cmpl_shift = 0;  // (kRansTotal - freq) | rcp_shift << 16
};

// The constants of symbols 0..kRansGroupSymbols-1, one array per field, for the group kernels.
struct RansGroupTables {
  uint32_t x_max[kRansGroupSymbols];
  uint32_t rcp_freq[kRansGroupSymbols];
  uint32_t bias[kRansGroupSymbols];
  uint32_t cmpl_shift[kRansGroupSymbols];
};

// The constants of any byte symbols for the wide kernels: the `width` symbols [base, base +
// width) in group tables (window.x_max[s - base], ...), every symbol in `all` (256 entries). The
// window is where most of a stream's symbols fall; the others are looked up one by one. A window
// of 32 (kRansNarrowSymbols) is looked up with half the permutes of one of 64.
inline constexpr unsigned kRansNarrowSymbols = 32;
struct RansWideTables {
  RansGroupTables window;
  uint32_t base = 0;
  uint32_t width = kRansGroupSymbols;  // kRansGroupSymbols or kRansNarrowSymbols
  const RansEncSymbol* all = nullptr;
};

// The encoding constants of a symbol of frequency `freq` (>= 1) and cumulative start `start`.
CIERA_HD inline RansEncSymbol rans_enc_symbol_of(uint32_t freq, uint32_t start) {
  RansEncSymbol e;
  // x must stay below 2^31 after encoding; renormalise while x >= x_max.
  e.x_max = ((kRansLowerBound >> kRansScaleBits) << 16) * freq;
  uint32_t rcp_shift = 0;
  // Division by freq as a multiply-high and shift (exact for x < 2^31), so that the encoder's
  // inner loop has no divide. For freq = 1 the reciprocal overflows; the bias absorbs it:
  // x + (start + M - 1) + (x - 1) * (M - 1) == x * M + start.
  if (freq < 2) {
    e.rcp_freq = ~0u;
    e.bias = start + kRansTotal - 1;
  } else {
    uint32_t shift = 0;
    while (freq > (1u << shift)) ++shift;
    e.rcp_freq = static_cast<uint32_t>(((uint64_t{1} << (shift + 31)) + freq - 1) / freq);
    rcp_shift = shift - 1;
    e.bias = start;
  }
  e.cmpl_shift = (kRansTotal - freq) | rcp_shift << 16;
  return e;
}

// Encodes one symbol into state `x`, writing its renormalisation word (if any) just below `out`.
// Branch-free: the word is always stored and kept only when the state sheds it; the caller
// guarantees two bytes of room below `out`.
CIERA_HD inline void rans_put(uint32_t& x, const RansEncSymbol& e, uint8_t*& out) {
  const uint32_t shed = x >= e.x_max;
#if defined(__CUDA_ARCH__)
  out[-2] = static_cast<uint8_t>(x);
  out[-1] = static_cast<uint8_t>(x >> 8);
#else
  store_le16(out - 2, static_cast<uint16_t>(x));
#endif
  out -= 2 * shed;
  x >>= 16 * shed;
  const uint32_t q = static_cast<uint32_t>((uint64_t{x} * e.rcp_freq) >> 32) >> (e.cmpl_shift >> 16);
  x = x + e.bias + q * (e.cmpl_shift & 0xFFFF);
}

// The decoder's table entry for each slot of [start, start + freq): the symbol, freq - 1 and
// start, packed so that one load serves a decoding step.
CIERA_HD inline uint32_t rans_slot_entry(unsigned symbol, uint32_t freq, uint32_t start) {
  return symbol | (freq - 1) << 8 | start << 20;
}

// One decoding step before renormalisation: the symbol that state `x` holds, and `x` without it.
inline uint8_t rans_take(uint32_t& x, const uint32_t* slots) {
  const uint32_t slot = x & (kRansTotal - 1);
  const uint32_t entry = slots[slot];
  x = (((entry >> 8) & 0xFFF) + 1) * (x >> kRansScaleBits) + slot - (entry >> 20);
  return static_cast<uint8_t>(entry);
}

}  // namespace ciera::entropy
