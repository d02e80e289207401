// A written symbol stream's share of a frame's statistics (FrameStats): what every coded stream
// adds, and, for rANS-coded ones, their bytes against the order-0 entropy bound. Shared by the
// encoder's exponent sections and the difference section.
#pragma once

#include "ciera/codec.hpp"
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

}  // namespace ciera::codec
