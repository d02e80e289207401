// Decoding one rANS segment (docs/format.md, "Symbol stream", rANS) as a plain function the CUDA
// kernels share with the host tests (CIERA_HD): a GPU gives every segment its own thread. The CPU
// decoder (rans.cpp) decodes the same segments with its SIMD kernels.
#pragma once

#include <cstdint>

#include "common/host_device.hpp"
#include "entropy/rans_core.hpp"

namespace ciera::entropy {

// Decodes the `symbols` symbols of the segment at `bytes` (`size` bytes: sixteen u32 states,
// then u16 words) with the decoder table `slots` (kRansTotal entries, rans_slot_entry). Returns
// false for a malformed segment: a state out of range, words that end early or are left over,
// or final states other than kRansLowerBound. `out` is then partly written.
CIERA_HD inline bool rans_decode_segment(const uint32_t* slots, const uint8_t* bytes,
                                         uint64_t size, uint64_t symbols, uint8_t* out) {
  if (size < kRansStateBytes) return false;
  uint32_t x[kRansStates];
  for (unsigned j = 0; j < kRansStates; ++j) {
    const uint8_t* p = bytes + 4 * j;
    x[j] = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    if (x[j] < kRansLowerBound || x[j] >= (uint32_t{1} << 31)) return false;
  }
  const uint8_t* in = bytes + kRansStateBytes;
  const uint8_t* end = bytes + size;
  uint64_t i = 0;
  for (; i < symbols; i += kRansStates) {
    const unsigned group = symbols - i < kRansStates ? static_cast<unsigned>(symbols - i) : kRansStates;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (unsigned j = 0; j < kRansStates; ++j) {
      if (j >= group) break;
      uint32_t slot = x[j] & (kRansTotal - 1);
      const uint32_t entry = slots[slot];
      x[j] = (((entry >> 8) & 0xFFF) + 1) * (x[j] >> kRansScaleBits) + slot - (entry >> 20);
      out[i + j] = static_cast<uint8_t>(entry);
      if (x[j] < kRansLowerBound) {
        if (end - in < 2) return false;
        x[j] = (x[j] << 16) | uint32_t{in[0]} | uint32_t{in[1]} << 8;
        in += 2;
      }
    }
  }
  if (in != end) return false;
  for (unsigned j = 0; j < kRansStates; ++j) {
    if (x[j] != kRansLowerBound) return false;
  }
  return true;
}

// Encodes the `count` symbols of one segment with `syms` (each symbol's constants,
// rans_enc_symbol_of), downward so that its bytes end at `out_end`: the words, and below them the
// sixteen final states, state 0 first. Returns where the segment begins. The caller leaves
// 2 * count + kRansStateBytes bytes below `out_end`. The CPU encoder writes the same bytes for
// the same segment (RansEncoder: segments are coded independently).
CIERA_HD inline uint8_t* rans_encode_segment(const RansEncSymbol* syms, const uint8_t* symbols,
                                             uint64_t count, uint8_t* out_end) {
  uint32_t x[kRansStates];
  for (unsigned j = 0; j < kRansStates; ++j) x[j] = kRansLowerBound;
  uint8_t* out = out_end;
  for (uint64_t i = count; i-- > 0;) rans_put(x[i % kRansStates], syms[symbols[i]], out);
  out -= kRansStateBytes;
  for (unsigned j = 0; j < kRansStates; ++j) {
    for (unsigned b = 0; b < 4; ++b) out[4 * j + b] = static_cast<uint8_t>(x[j] >> (8 * b));
  }
  return out;
}

}  // namespace ciera::entropy
