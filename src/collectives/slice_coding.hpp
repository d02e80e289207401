// A coded slice of the lossless collectives (docs/format.md, "Lossless collectives"): stateless
// key frames of at most CollectivesConfig::frame_values values each, back to back, each with an
// rANS table of its own, so that the tables follow exponent statistics that change along a
// buffer (a gradient's, from one parameter to the next).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ciera/codec.hpp"

namespace ciera::collectives {

// The most bytes a coded slice of `values` values in frames of `frame_values` can take.
uint64_t coded_slice_bound(const CodecConfig& c, uint64_t values, uint64_t frame_values);

// Codes `slice` as frames of `frame_values` values (the last one the rest) into `out`, which
// holds at least coded_slice_bound() bytes. Returns the frames' stats added up: payload_bytes is
// the coded slice's length; sign_mantissa_bytes and coded_symbols_entropy_bits are sums too.
FrameStats encode_slice(const CodecConfig& c, uint64_t frame_values,
                        std::span<const std::byte> slice, std::span<std::byte> out);

// Decodes a coded slice (frames of any sizes, back to back) into `out`, which its frames must
// fill exactly: each frame non-empty, none past the end of `out`, no byte of `in` left over.
// Throws FormatError naming what does not fit, or the codec's own for a frame.
void decode_slice(const CodecConfig& c, std::span<const std::byte> in, std::span<std::byte> out);

}  // namespace ciera::collectives
