// The coded tail that fine exponent sections and difference sections share: symbol streams, then
// the 8-byte length of the extra bits and the bits (docs/format.md), and each written stream's
// share of a frame's statistics (FrameStats). Shared by the encoder and the difference writer.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "common/bytes.hpp"
#include "entropy/symbol_stream.hpp"

namespace ciera::codec {

inline void add_stream_stats(FrameStats& stats, const entropy::StreamStats& s) {
  stats.coded_symbols += s.symbols;
  stats.coded_symbols_entropy_bits += s.entropy_bits;
  if (s.method == entropy::StreamMethod::kRans) {
    stats.entropy_symbols += s.symbols;
    stats.entropy_coded_bytes += s.bytes;
    stats.entropy_bound_bytes += s.entropy_bits / 8;
  }
}

// One symbol stream of a section: its symbols, their width and, when the caller took it while
// making them, their histogram (else it is taken here, in another pass over them).
struct SectionStream {
  std::span<const uint8_t> symbols;
  unsigned symbol_bits;
  const entropy::Histogram* histogram = nullptr;
};

// The most bytes `streams` then `extra_bytes` of extra bits can take.
inline uint64_t streams_then_extra_bound(std::initializer_list<SectionStream> streams, uint64_t extra_bytes) {
  uint64_t bound = 8 + extra_bytes;
  for (const SectionStream& s : streams) bound += entropy::symbol_stream_bound(s.symbols.size(), s.symbol_bits);
  return bound;
}

// Writes `streams` then the extra bits at `out` (capacity >= streams_then_extra_bound); returns
// the bytes written.
inline uint64_t write_streams_then_extra(std::initializer_list<SectionStream> streams, const uint8_t* extra,
                                         uint64_t extra_bytes, uint8_t* out, uint64_t capacity,
                                         std::vector<uint8_t>& scratch, FrameStats& stats) {
  uint8_t* at = out;
  for (const SectionStream& stream : streams) {
    const entropy::ArraySource source(stream.symbols);
    const entropy::Histogram hist =
        stream.histogram ? *stream.histogram : entropy::histogram_of(source, scratch);
    const entropy::StreamStats s = entropy::write_symbol_stream(
        source, hist, stream.symbol_bits, at, capacity - static_cast<uint64_t>(at - out), scratch);
    add_stream_stats(stats, s);
    at += s.bytes;
  }
  store_le64(at, extra_bytes);
  at += 8;
  if (extra_bytes != 0) std::memcpy(at, extra, extra_bytes);
  at += extra_bytes;
  return static_cast<uint64_t>(at - out);
}

}  // namespace ciera::codec
