// Writing one symbol stream (docs/format.md, "Symbol stream") as steps that a GPU runs in
// parallel and the host tests run in loops (CIERA_HD), producing exactly the bytes of the CPU's
// write_symbol_stream: the same integer model, the same packed/constant/rANS choice
// (docs/architecture.md, "Deterministic encoding"), the same segments.
//
//   histogram        (the caller: counts of each symbol)
//   plan_writer      1 thread      model, sizes, whether to try rANS
//   encode_segment   per segment   each rANS segment into its own scratch region
//   finish_writer    1 thread      rANS if it fits in the packed size; header, table, lengths
//   copy_segment     per segment   the segments into place
//   packed_byte      per body byte the packed body (when rANS lost or was not tried)
#pragma once

#include <cstdint>

#include "common/bytes.hpp"
#include "common/host_device.hpp"
#include "entropy/model_math.hpp"
#include "entropy/rans_core.hpp"
#include "entropy/rans_segment.hpp"
#include "entropy/stream_header.hpp"

namespace ciera::entropy::device {

inline constexpr uint64_t kStreamHeader = kStreamHeaderBytes;
inline constexpr uint32_t kPackedMethod = static_cast<uint32_t>(StreamMethod::kPacked);
inline constexpr uint32_t kConstantMethod = static_cast<uint32_t>(StreamMethod::kConstant);
inline constexpr uint32_t kRansMethod = static_cast<uint32_t>(StreamMethod::kRans);
// Scratch bytes of one segment's region: the most a segment can take.
inline constexpr uint64_t kSegmentScratch = 2 * kRansSegmentSymbols + kRansStateBytes;

struct WriterPlan {
  uint64_t count[256] = {};  // the histogram, filled before plan_writer
  uint64_t total = 0;
  uint32_t method = kPackedMethod;  // kPackedMethod, kConstantMethod or kRansMethod
  uint32_t width = 1;
  uint32_t constant = 0;
  uint32_t try_rans = 0;
  uint16_t freq[256] = {};
  uint16_t start[256] = {};
  uint8_t first = 0;
  uint8_t last = 0;
  RansEncSymbol syms[256] = {};
  uint64_t packed_bytes = 0;  // the packed stream, header included
  uint64_t table_bytes = 0;
  uint64_t segments = 0;
  uint64_t bytes = 0;  // the stream written, header included
};

CIERA_HD inline void plan_writer(WriterPlan* w) {
  unsigned distinct = 0, max_symbol = 0;
  for (unsigned s = 0; s < 256; ++s) {
    if (w->count[s] == 0) continue;
    ++distinct;
    max_symbol = s;
  }
  unsigned width = 0;
  while ((max_symbol >> width) != 0) ++width;
  w->width = width < 1 ? 1 : width;
  w->packed_bytes = kStreamHeader + (w->total * w->width + 7) / 8;
  w->try_rans = 0;
  w->method = kPackedMethod;
  w->bytes = w->packed_bytes;
  if (w->total > 0 && distinct == 1) {
    w->method = kConstantMethod;
    w->constant = max_symbol;
    w->bytes = kStreamHeader;
    return;
  }
  if (w->total == 0) return;
  normalise_frequencies(w->count, w->total, w->freq, &w->first, &w->last);
  uint32_t cumulative = 0;
  uint64_t cost = 0;
  w->table_bytes = 2;
  for (unsigned s = 0; s < 256; ++s) {
    w->start[s] = static_cast<uint16_t>(cumulative);
    cumulative += w->freq[s];
    if (w->freq[s] != 0) w->syms[s] = rans_enc_symbol_of(w->freq[s], w->start[s]);
    if (w->count[s] != 0) cost += rans_cost_q16(w->count[s], w->freq[s]);
  }
  for (unsigned s = w->first; s <= w->last; ++s) w->table_bytes += w->freq[s] >= 128 ? 2 : 1;
  w->segments = rans_segment_count(w->total);
  constexpr uint64_t kByteQ16 = uint64_t{8} << 16;
  const uint64_t estimate = kStreamHeader + w->table_bytes + rans_framing_bytes(w->total) +
                            (cost + kByteQ16 - 1) / kByteQ16;
  w->try_rans = estimate < w->packed_bytes;
}

// Segment j of `symbols` into scratch region j (kSegmentScratch bytes each), ending at the
// region's end; its length to seg_bytes[j].
CIERA_HD inline void encode_segment(const WriterPlan* w, const uint8_t* symbols, uint8_t* scratch,
                                    uint64_t* seg_bytes, uint64_t j) {
  if (!w->try_rans || j >= w->segments) return;
  const uint64_t first = j * kRansSegmentSymbols;
  const uint64_t count = w->total - first < kRansSegmentSymbols ? w->total - first : kRansSegmentSymbols;
  uint8_t* end = scratch + (j + 1) * kSegmentScratch;
  seg_bytes[j] = static_cast<uint64_t>(end - rans_encode_segment(w->syms, symbols + first, count, end));
}

// 1 thread: the method, and the stream's header, table and segment lengths (rANS) at `out`;
// seg_offsets[j] = where segment j goes in `out`.
CIERA_HD inline void finish_writer(WriterPlan* w, const uint64_t* seg_bytes, uint64_t* seg_offsets,
                                   uint8_t* out) {
  if (w->try_rans) {
    uint64_t total = kStreamHeader + w->table_bytes + 4 * (w->segments - 1);
    for (uint64_t j = 0; j < w->segments; ++j) total += seg_bytes[j];
    if (total <= w->packed_bytes) {
      w->method = kRansMethod;
      w->bytes = total;
      uint8_t* at = out + kStreamHeader;
      *at++ = w->first;
      *at++ = w->last;
      for (unsigned s = w->first; s <= w->last; ++s) at = put_varint(at, w->freq[s]);
      uint64_t offset = static_cast<uint64_t>(at - out) + 4 * (w->segments - 1);
      for (uint64_t j = 0; j < w->segments; ++j) {
        if (j + 1 < w->segments) {
          for (unsigned b = 0; b < 4; ++b) at[4 * j + b] = static_cast<uint8_t>(seg_bytes[j] >> (8 * b));
        }
        seg_offsets[j] = offset;
        offset += seg_bytes[j];
      }
    }
  }
  const uint64_t body = w->bytes - kStreamHeader;
  out[0] = static_cast<uint8_t>(w->method);
  out[kStreamArgumentAt] = static_cast<uint8_t>(w->method == kPackedMethod     ? w->width
                                                : w->method == kConstantMethod ? w->constant
                                                                               : 0);
  for (unsigned b = 0; b < 8; ++b)
    out[kStreamBodyBytesAt + b] = static_cast<uint8_t>(body >> (8 * b));
}

// Segment j from its scratch region into place.
CIERA_HD inline void copy_segment(const WriterPlan* w, const uint8_t* scratch, const uint64_t* seg_bytes,
                                  const uint64_t* seg_offsets, uint8_t* out, uint64_t j) {
  if (w->method != kRansMethod || j >= w->segments) return;
  const uint8_t* from = scratch + (j + 1) * kSegmentScratch - seg_bytes[j];
  for (uint64_t b = 0; b < seg_bytes[j]; ++b) out[seg_offsets[j] + b] = from[b];
}

// Byte k of a packed body: the bits of the symbols it holds, LSB first; padding bits 0.
CIERA_HD inline void packed_byte(const WriterPlan* w, const uint8_t* symbols, uint8_t* out, uint64_t k) {
  if (w->method != kPackedMethod || k >= w->bytes - kStreamHeader) return;
  const uint64_t bit = 8 * k;
  const uint32_t width = w->width;
  uint32_t byte = 0;
  for (uint64_t i = bit / width; i < w->total && i * width < bit + 8; ++i) {
    const int64_t shift = static_cast<int64_t>(i * width) - static_cast<int64_t>(bit);
    const uint32_t v = symbols[i];
    byte |= shift >= 0 ? v << shift : v >> -shift;
  }
  out[kStreamHeader + k] = static_cast<uint8_t>(byte);
}

}  // namespace ciera::entropy::device
