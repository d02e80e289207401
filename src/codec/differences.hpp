// The difference section of value-delta frames (docs/format.md, "Value-delta frames"): every
// value's exact step-to-step difference in an order-preserving integer space, grouped three to a
// symbol, with escapes for the large ones. Shared by the encoder and the decoder (which never
// include each other); the frame around it (header, streams, checksum) is theirs.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/dtype.hpp"
#include "common/host_device.hpp"
#include "entropy/histogram.hpp"
#include "entropy/stream_header.hpp"
#include "format/content_checksum.hpp"

namespace ciera {
class SlackBitWriter;  // common/bits.hpp
}  // namespace ciera

namespace ciera::codec {

// Three values per group symbol, two bits each: a difference class 0, 1 or 2 (the zigzagged
// difference itself) or 3 (an escape: the zigzagged difference minus 3 follows in the escape
// stream). Symbols stay below 64, which the sixteen-lane rANS kernels need.
inline constexpr unsigned kGroupValues = 3;
inline constexpr unsigned kGroupSymbolBits = 6;
inline constexpr uint32_t kEscapeClass = 3;
// Escape symbols are buckets (bit widths) of values below 2^32: at most 32.
inline constexpr unsigned kMaxEscapeBucket = 32;
inline constexpr unsigned kEscapeSymbolBits = 6;

// Order-preserving map of a float's bit pattern to an unsigned integer: negative values (sign
// set) reversed below positive ones, so that neighbouring floats are neighbouring integers,
// -0.0 and +0.0 included. A bijection on all patterns (NaN payloads, ±Inf, subnormals).
// Branch-free, so that the passes over a shard vectorise.
template <typename U>
CIERA_HD inline U to_ordered(U bits) {
  constexpr unsigned kTop = 8 * sizeof(U) - 1;
  constexpr U kSign = U(U(1) << kTop);
  return U(bits ^ (U(U(0) - U(bits >> kTop)) | kSign));  // sign set: ~bits; else bits | sign
}
template <typename U>
CIERA_HD inline U from_ordered(U ordered) {
  constexpr unsigned kTop = 8 * sizeof(U) - 1;
  constexpr U kSign = U(U(1) << kTop);
  return U(ordered ^ (U(U(ordered >> kTop) - 1) | kSign));  // top set: ^ sign; else ~ordered
}
// Zigzag of a difference taken mod 2^bits as a signed integer: 0, -1, +1, -2, ... -> 0, 1, 2, 3.
template <typename U>
CIERA_HD inline U zigzag(U difference) {
  constexpr unsigned kTop = 8 * sizeof(U) - 1;
  return U(U(difference << 1) ^ U(U(0) - (difference >> kTop)));
}
template <typename U>
CIERA_HD inline U unzigzag(U z) {
  return U((z >> 1) ^ U(U(0) - (z & 1)));
}
// Groups of `n` values (the last may be partial).
CIERA_HD inline uint64_t group_count(uint64_t n) { return (n + kGroupValues - 1) / kGroupValues; }
// The largest frame of a value-delta stream (docs/format.md, "Size bound"): the bound of the key
// frame, whose plane starts at `key_plane_at` and is `plane_bytes` long, with its `n` exponents
// packed (`exponent_bits` each). A value-delta frame coded larger goes as that key frame, which
// updates the receivers' previous values as well, so the stream never costs more than the values
// raw plus 90 bytes a frame (FP16 91; 48 more where the plane is 64 KiB or more).
// max_payload_bytes() is larger by an exponent-delta frame's bitmap and its padding, which a
// value-delta frame never carries: the value-delta frames of tiny shards reached it.
CIERA_HD inline uint64_t value_delta_frame_bound(uint64_t key_plane_at, uint64_t plane_bytes,
                                                 uint64_t n, unsigned exponent_bits) {
  return key_plane_at + plane_bytes + entropy::kStreamHeaderBytes + (n * exponent_bits + 7) / 8;
}
// Escape buckets: bucket(v) is v's bit width; a bucket b >= 2 is followed by b - 1 extra bits.
inline unsigned escape_bucket(uint32_t v) { return static_cast<unsigned>(std::bit_width(v)); }
CIERA_HD inline unsigned escape_extra_bits(unsigned bucket) { return bucket - (bucket != 0); }
CIERA_HD inline uint64_t escape_base(unsigned bucket) { return (uint64_t{1} << bucket) >> 1; }

// A pass's scratch: a chunk's z and its escaped z (room for `values` + 32), in the width of the
// shard's values. One vector per width, so that no buffer is read through a pointer to another
// type than its own.
class ChunkScratch {
 public:
  template <typename U>
  U* z(uint64_t values) {
    return sized(pick<U>(z16_, z32_), values);
  }
  template <typename U>
  U* escaped(uint64_t values) {
    return sized(pick<U>(escaped16_, escaped32_), values + 32);
  }

 private:
  template <typename U>
  static std::vector<U>& pick(std::vector<uint16_t>& narrow, std::vector<uint32_t>& wide) {
    static_assert(sizeof(U) == 2 || sizeof(U) == 4);
    if constexpr (sizeof(U) == 2) {
      return narrow;
    } else {
      return wide;
    }
  }
  template <typename U>
  static U* sized(std::vector<U>& v, uint64_t values) {
    if (v.size() < values) v.resize(values);
    return v.data();
  }
  std::vector<uint16_t> z16_, escaped16_;
  std::vector<uint32_t> z32_, escaped32_;
};

// Sender side: codes `values` against `base` (what the receivers hold) and then makes `base`
// equal to `values`, in one pass that also feeds `checksum`.
class DifferenceWriter {
 public:
  struct Result {
    bool fits = true;        // false: the section would exceed `capacity` (nothing usable written)
    uint64_t bytes = 0;      // the section; 0 when no value changed (the 'unchanged' section)
    uint64_t changed = 0;    // values whose bit pattern differs from the base
  };
  Result write(DType dtype, const uint8_t* values, uint8_t* base, uint64_t n, uint8_t* out,
               uint64_t capacity, format::ContentChecksum* checksum, FrameStats& stats);

 private:
  template <typename U>
  void scan(const uint8_t* values, U* base, uint64_t n, format::ContentChecksum* checksum);
  // Room for `escaped` more escapes of at most `max_extra_bits` extra bits each.
  void reserve_escapes(uint64_t escaped, unsigned max_extra_bits, SlackBitWriter& extra);

  std::vector<uint8_t> groups_;
  entropy::SymbolCounter<1u << kGroupSymbolBits> group_counter_;  // of groups_, chunk by chunk
  std::vector<uint8_t> escapes_;
  entropy::SymbolCounter<1u << kEscapeSymbolBits> escape_counter_;  // of escapes_, chunk by chunk
  std::vector<uint8_t> extra_;
  std::vector<uint8_t> scratch_;
  ChunkScratch chunk_;
  uint64_t escape_count_ = 0;
  uint64_t changed_ = 0;
  uint64_t extra_bits_ = 0;
};

// Receiver side: decodes a 'differences' section and moves the receiver's previous values
// (`base`) on to base + differences, writing them to `out` too, in one pass that feeds
// `checksum`. Throws FormatError for any malformed or non-canonical section, with `base` as it
// was. After a successful read(), revert() puts `base` back (the frame failed its checksum).
class DifferenceReader {
 public:
  // Returns the number of values that differ from the base.
  uint64_t read(DType dtype, const uint8_t* section, uint64_t size, uint8_t* base, uint64_t n,
                uint8_t* out, format::ContentChecksum* checksum);
  void revert(DType dtype, uint8_t* base, uint64_t n);

 private:
  // The section's parts, checked and kept for the pass (and for revert()).
  void open(const uint8_t* section, uint64_t size, uint64_t n, uint32_t value_bits);
  // z of the values of chunk `chunk` (of chunk_values() values): from the group symbols and the
  // escapes, which are consumed in order from `escape` and `bit`.
  template <typename U>
  void chunk_differences(uint64_t chunk, size_t count, U* z, const uint8_t*& escape, uint64_t& bit);
  template <typename U>
  uint64_t reconstruct(U* base, uint64_t n, uint8_t* out, format::ContentChecksum* checksum);
  template <typename U>
  void undo(U* base, uint64_t n);

  std::vector<uint8_t> groups_;
  std::vector<uint8_t> escapes_;
  std::vector<uint8_t> extra_;
  ChunkScratch chunk_;
  std::vector<uint32_t> chunk_escapes_;  // escaped values per chunk of the pass
  const uint8_t* extra_data_ = nullptr;
  uint64_t applied_chunks_ = 0;  // chunks whose differences are in the base
};

}  // namespace ciera::codec
