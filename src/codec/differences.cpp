// The difference section of value-delta frames: docs/format.md, "Value-delta frames".
#include "codec/differences.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "ciera/error.hpp"
#include "codec/kernels.hpp"
#include "codec/stream_stats.hpp"
#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "entropy/rans_core.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/kernels.hpp"

namespace ciera::codec {
namespace {

// Values per pass: a multiple of the group size, small enough that a chunk's values, base and
// differences stay in L1/L2 between the steps of the pass.
constexpr uint64_t kChunkValues = 3 * 2048;
static_assert(kChunkValues % kGroupValues == 0);
// Symbols per piece of a stream decoded in open(): four rANS segments (decoded two at a time),
// whole chunks of the pass.
constexpr uint64_t kOpenPieceGroups = 4 * entropy::kRansSegmentSymbols;
static_assert(kOpenPieceGroups % (kChunkValues / kGroupValues) == 0);

}  // namespace

void DifferenceWriter::reserve_escapes(uint64_t escaped, unsigned max_extra_bits,
                                       SlackBitWriter& extra) {
  const uint64_t escapes = escape_count_ + escaped;
  if (escapes_.size() < escapes) escapes_.resize(std::max<uint64_t>(escapes, 2 * escapes_.size()));
  // The writer stores 8 bytes at its current byte: room for the chunk's bits and that slack.
  const uint64_t extra_bytes = (extra.bits() + escaped * max_extra_bits + 7) / 8 + 8;
  if (extra_.size() < extra_bytes) {
    extra_.resize(std::max<uint64_t>(extra_bytes, 2 * extra_.size()));
    extra.relocate(extra_.data());
  }
}

template <typename U>
void DifferenceWriter::scan(const uint8_t* values, U* base, uint64_t n,
                            format::ContentChecksum* checksum) {
  const CodecKernels& k = codec_kernels();
  U* z = chunk_.z<U>(kChunkValues);
  U* escaped_z = chunk_.escaped<U>(kChunkValues);
  uint8_t* groups = groups_.data();
  SlackBitWriter extra(extra_.data());
  for (uint64_t first = 0; first < n; first += kChunkValues) {
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kChunkValues, n - first));
    const uint8_t* v = values + first * sizeof(U);
    uint8_t* g = groups + first / kGroupValues;
    uint64_t escaped;
    if constexpr (sizeof(U) == 2) {
      changed_ += k.differences16(v, base + first, count, z);
      std::fill(z + count, z + group_count(count) * kGroupValues, U{0});
      escaped = k.group_symbols16(z, count, g);
    } else {
      changed_ += k.differences32(v, base + first, count, z);
      std::fill(z + count, z + group_count(count) * kGroupValues, U{0});
      escaped = k.group_symbols32(z, count, g);
    }
    group_counter_.add(g, group_count(count));
    if (checksum) checksum->update(v, count * sizeof(U));
    if (escaped == 0) continue;
    reserve_escapes(escaped, 8 * sizeof(U) - 1, extra);
    if constexpr (sizeof(U) == 2) {
      k.collect_escapes16(z, count, escaped_z);
    } else {
      k.collect_escapes32(z, count, escaped_z);
    }
    uint8_t* symbols = escapes_.data() + escape_count_;
    if constexpr (sizeof(U) == 2) {
      k.escape_symbols16(escaped_z, escaped, symbols, extra);
    } else {
      for (uint64_t e = 0; e < escaped; ++e) {
        const uint32_t value = escaped_z[e] - kEscapeClass;
        const unsigned bucket = escape_bucket(value);
        symbols[e] = static_cast<uint8_t>(bucket);
        extra.put_wide(value - escape_base(bucket), escape_extra_bits(bucket));
      }
    }
    escape_counter_.add(symbols, escaped);
    escape_count_ += escaped;
  }
  extra_bits_ = extra.bits();
  extra.finish();
  format::stream_fence();  // the copy of the values went past the caches
}

DifferenceWriter::Result DifferenceWriter::write(DType dtype, const uint8_t* values, uint8_t* base,
                                                 uint64_t n, uint8_t* out, uint64_t capacity,
                                                 format::ContentChecksum* checksum,
                                                 FrameStats& stats) {
  const uint64_t groups = group_count(n);
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  // The escapes and their extra bits grow chunk by chunk to what the frames need (reserve_escapes):
  // sized for the worst case (every value escaped, 15 or 31 extra bits each) they would hold more
  // than the previous values themselves, in every encoder.
  if (groups_.size() < groups) groups_.resize(groups);
  if (extra_.size() < 8) extra_.resize(8);
  escape_count_ = 0;
  changed_ = 0;
  extra_bits_ = 0;
  group_counter_.clear();
  escape_counter_.clear();
  if (value_bytes == 2) {
    scan(values, reinterpret_cast<uint16_t*>(base), n, checksum);
  } else {
    scan(values, reinterpret_cast<uint32_t*>(base), n, checksum);
  }
  Result result;
  result.changed = changed_;
  const entropy::Histogram group_histogram = group_counter_.take();
  const entropy::Histogram escape_histogram = escape_counter_.take();
  if (changed_ == 0) return result;  // the 'unchanged' section: empty

  const uint64_t extra_bytes = (extra_bits_ + 7) / 8;
  const std::initializer_list<SectionStream> streams = {
      {{groups_.data(), groups}, kGroupSymbolBits, &group_histogram},
      {{escapes_.data(), escape_count_}, kEscapeSymbolBits, &escape_histogram}};
  if (streams_then_extra_bound(streams, extra_bytes) > capacity) {
    result.fits = false;
    return result;
  }
  result.bytes = write_streams_then_extra(streams, extra_.data(), extra_bytes, out, capacity, scratch_, stats);
  return result;
}

template <typename U>
void DifferenceReader::chunk_differences(uint64_t chunk, size_t count, U* z,
                                         const uint8_t*& escape, uint64_t& bit) {
  const CodecKernels& k = codec_kernels();
  const uint8_t* g = groups_.data() + chunk * (kChunkValues / kGroupValues);
  if constexpr (sizeof(U) == 2) {
    k.expand_groups16(g, group_count(count), z);
  } else {
    k.expand_groups32(g, group_count(count), z);
  }
  const uint32_t escaped = chunk_escapes_[chunk];
  if (escaped == 0) return;
  // Escaped values (class 3) take their difference from the escape stream, in value order.
  constexpr uint64_t kMaxZ = static_cast<U>(~U(0));
  U* escaped_z = chunk_.escaped<U>(kChunkValues);
  const auto overflow = [](const std::string& value) {
    return FormatError("difference section escapes a difference of " + value + ", beyond the dtype's " +
                       std::to_string(8 * sizeof(U)) + " bits");
  };
  if constexpr (sizeof(U) == 2) {
    const uint64_t next = k.escape_values16(escape, escaped, extra_data_, bit, escaped_z);
    if (next == kEscapeOverflow) throw overflow("2^16 or more");
    bit = next;
  } else {
    for (uint32_t e = 0; e < escaped; ++e) {
      const unsigned bucket = escape[e];
      const unsigned bits = escape_extra_bits(bucket);
      // Branch-free: most escapes have no extra bits (bucket 0 or 1), unpredictably.
      const uint64_t value = kEscapeClass + escape_base(bucket) + PaddedBitReader::read(extra_data_, bit, bits);
      bit += bits;
      if (value > kMaxZ) throw overflow(std::to_string(value));
      escaped_z[e] = static_cast<U>(value);
    }
  }
  escape += escaped;
  if constexpr (sizeof(U) == 2) {
    k.place_escapes16(z, count, escaped_z);
  } else {
    k.place_escapes32(z, count, escaped_z);
  }
}

template <typename U>
uint64_t DifferenceReader::reconstruct(U* base, uint64_t n, uint8_t* out,
                                       format::ContentChecksum* checksum) {
  const CodecKernels& k = codec_kernels();
  U* z = chunk_.z<U>(kChunkValues);
  const uint8_t* escape = escapes_.data();
  uint64_t bit = 0;
  uint64_t changed = 0;
  applied_chunks_ = 0;
  for (uint64_t first = 0; first < n; first += kChunkValues) {
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kChunkValues, n - first));
    chunk_differences(applied_chunks_, count, z, escape, bit);
    if constexpr (sizeof(U) == 2) {
      changed += k.apply_differences16(base + first, z, count, out + first * sizeof(U));
    } else {
      changed += k.apply_differences32(base + first, z, count, out + first * sizeof(U));
    }
    ++applied_chunks_;
    if (checksum) checksum->update(out + first * sizeof(U), count * sizeof(U));
  }
  format::stream_fence();  // the previous values went past the caches
  return changed;
}

// The error path: the differences of the chunks applied so far, subtracted again.
template <typename U>
void DifferenceReader::undo(U* base, uint64_t n) {
  U* z = chunk_.z<U>(kChunkValues);
  const uint8_t* escape = escapes_.data();
  uint64_t bit = 0;
  for (uint64_t chunk = 0; chunk < applied_chunks_; ++chunk) {
    const uint64_t first = chunk * kChunkValues;
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kChunkValues, n - first));
    chunk_differences(chunk, count, z, escape, bit);
    U* b = base + first;
    for (size_t i = 0; i < count; ++i) {
      b[i] = from_ordered<U>(U(to_ordered<U>(b[i]) - unzigzag<U>(z[i])));
    }
  }
  applied_chunks_ = 0;
}

void DifferenceReader::open(const uint8_t* section, uint64_t size, uint64_t n,
                            uint32_t value_bits) {
  const uint64_t groups = group_count(n);
  ByteReader in(section, size, "difference section");
  // Sized from this decoder's own value count, never from the payload.
  if (groups_.size() < groups) groups_.resize(groups);
  // The group symbols, decoded a piece at a time and their escapes counted (per chunk of the
  // reconstruction pass) while the piece is in cache.
  constexpr uint64_t kChunkGroups = kChunkValues / kGroupValues;
  chunk_escapes_.resize((groups + kChunkGroups - 1) / kChunkGroups);
  entropy::SymbolStreamReader group_stream;
  group_stream.open(in, groups, (1u << kGroupSymbolBits) - 1, "difference groups stream");
  uint64_t escapes = 0;
  for (uint64_t first = 0; first < groups; first += kOpenPieceGroups) {
    const uint64_t piece = std::min<uint64_t>(kOpenPieceGroups, groups - first);
    group_stream.get(groups_.data() + first, piece);
    for (uint64_t g = first; g < first + piece; g += kChunkGroups) {
      const uint64_t e = codec_kernels().count_escapes(
          groups_.data() + g, std::min<uint64_t>(kChunkGroups, groups - g));
      chunk_escapes_[g / kChunkGroups] = static_cast<uint32_t>(e);
      escapes += e;
    }
  }
  group_stream.finish();
  // The missing values of a last partial group are unchanged: class 0.
  const uint64_t tail = groups * kGroupValues - n;
  if (tail != 0 && (groups_[groups - 1] >> (2 * (kGroupValues - tail))) != 0) {
    throw FormatError("difference groups stream gives a class to values past the end of the shard");
  }
  escapes_.resize(escapes + 1);  // +1: data() stays valid when there are none
  entropy::SymbolStreamReader escape_stream;
  // A zigzagged difference is below 2^bits; minus the escape class, its bucket is at most bits.
  escape_stream.open(in, escapes, value_bits, "difference escapes stream");
  uint64_t extra_bits = 0;
  for (uint64_t first = 0; first < escapes; first += kOpenPieceGroups) {
    const uint64_t piece = std::min<uint64_t>(kOpenPieceGroups, escapes - first);
    escape_stream.get(escapes_.data() + first, piece);
    extra_bits += codec_kernels().escape_extra_bits_total(escapes_.data() + first, piece);
  }
  escape_stream.finish();
  const uint64_t extra_bytes = in.u64();
  if (extra_bytes != (extra_bits + 7) / 8) {
    throw FormatError("difference section has " + std::to_string(extra_bytes) +
                      " bytes of extra bits, its escapes need " + std::to_string((extra_bits + 7) / 8));
  }
  PaddedBitReader padded(in.take(extra_bytes), extra_bytes, extra_);
  if (in.remaining() != 0) {
    throw FormatError("difference section has " + std::to_string(in.remaining()) + " trailing bytes");
  }
  padded.set_position(extra_bits);
  if (!padded.exhausted_canonically()) {
    throw FormatError("difference section's extra bits have non-zero padding");
  }
  extra_data_ = padded.data();
}

uint64_t DifferenceReader::read(DType dtype, const uint8_t* section, uint64_t size, uint8_t* base,
                                uint64_t n, uint8_t* out, format::ContentChecksum* checksum) {
  const uint32_t value_bits = 8 * dtype_info(dtype).value_bytes;
  applied_chunks_ = 0;
  open(section, size, n, value_bits);
  try {
    if (value_bits == 16) {
      return reconstruct(reinterpret_cast<uint16_t*>(base), n, out, checksum);
    }
    return reconstruct(reinterpret_cast<uint32_t*>(base), n, out, checksum);
  } catch (...) {
    revert(dtype, base, n);
    throw;
  }
}

void DifferenceReader::revert(DType dtype, uint8_t* base, uint64_t n) {
  if (dtype_info(dtype).value_bytes == 2) {
    undo(reinterpret_cast<uint16_t*>(base), n);
  } else {
    undo(reinterpret_cast<uint32_t*>(base), n);
  }
}

}  // namespace ciera::codec
