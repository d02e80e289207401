// The GPU encoder's steps (docs/gpu.md, "The device encoder"), as CIERA_HD functions: the CUDA
// encoder (src/cuda/encoder.cu) runs each as a kernel, one thread per index, and the host
// emulation (codec/device_encode_emulation.hpp) runs the same functions in loops, so that tests
// hold every payload to the CPU encoder's, byte for byte (every dtype, frame kind, exponent
// coding and change detection, and value-delta streams).
//
// The host decides what it knows without the device (key or delta frame, epoch, sequence, the
// plane's offset); every choice that depends on the data is made on the device by the CPU
// encoder's integer rules (docs/architecture.md, "Deterministic encoding"), and kernels whose
// work was not chosen do nothing.
#pragma once

#include <cstdint>

#include "ciera/config.hpp"
#include "codec/device_codes.hpp"
#include "codec/differences.hpp"
#include "codec/fine_alphabet.hpp"
#include "codec/wire.hpp"
#include "common/hash_bits.hpp"
#include "common/host_device.hpp"
#include "entropy/model_math.hpp"
#include "entropy/stream_writer_hd.hpp"
#include "format/content_checksum.hpp"
#include "format/value_bits.hpp"
#include "format/xxh3.hpp"

namespace ciera::codec::device {

namespace writer = entropy::device;

// What the encoder is set up for, and what the host knows of this frame.
struct EncodeConfig {
  uint8_t dtype = 1;  // wire code
  uint8_t exponent_bits = 8;
  uint8_t value_bytes = 2;
  uint8_t checksum = 1;
  uint8_t coding = 0;  // ExponentCoding (block whenever detection is by hash, as on the CPU)
  uint8_t hash = 0;    // hash change detection (XXH3-128 per block) instead of exact
  uint32_t hash_bits = 128;
  uint32_t block_values = 512;
  uint64_t num_values = 0;
  uint64_t blocks = 0;
  uint64_t sign_mantissa_bytes = 0;
  uint64_t capacity = 0;  // of the payload buffer (max_payload_bytes)
  // This frame:
  uint8_t key = 1;
  // A value-delta stream (docs/format.md, "Value-delta frames"): its frames other than key frames
  // are value-delta frames, unless the differences do not fit (then a key frame goes instead,
  // decided on the device: `fallback` marks the copy of the configuration its steps run with).
  uint8_t value_delta = 0;
  uint8_t fallback = 0;
  uint64_t plane_bytes = 0;          // the sign-mantissa plane's length (key and exponent-delta frames)
  uint64_t key_sign_mantissa_at = 0;  // where a key frame's plane starts
  uint32_t stream = 0;
  uint32_t epoch = 0;
  uint64_t sequence = 0;
  uint64_t bitmap_bytes = 0;  // 0 for a key frame
  uint64_t sign_mantissa_at = 0;
};

// One frame's device-side record.
struct EncodePlan {
  uint64_t content_checksum = 0;
  uint64_t changed_blocks = 0;
  uint64_t changes = 0;
  uint64_t block_symbols = 0;  // exponents of the changed blocks
  uint64_t escapes = 0;
  uint64_t extra_bits = 0;
  uint64_t extra_bytes = 0;
  uint32_t fine_fits = 0;  // the fine section's bound fits the payload
  uint32_t use_fine = 0;
  uint32_t section = 0;
  uint64_t fine_bytes = 0;
  uint64_t exponent_bytes = 0;
  uint64_t payload_bytes = 0;
  writer::WriterPlan stream;  // the stream being written (one at a time)
  uint64_t stream_at = 0;     // its payload offset
  // Value-delta frames (`changes` counts the changed values, `escapes` and `extra_*` are the
  // difference section's):
  // A key frame goes instead: the differences do not fit, or code past the key frame's bound.
  uint32_t use_key = 0;
};

struct EncodeBuffers {
  const uint8_t* values = nullptr;  // the shard
  uint8_t* payload = nullptr;
  uint8_t* sent = nullptr;             // N: the exponents the receivers hold (exact detection)
  uint64_t* sent_hashes = nullptr;     // 2 per block: their blocks' hashes (hash detection)
  uint8_t* exps = nullptr;             // N: this frame's exponents
  uint8_t* block_symbols = nullptr;    // N: the changed blocks' exponents, in block order
  uint32_t* changes_in_block = nullptr;  // per block
  uint64_t* change_base = nullptr;     // per block: its first change's index
  uint64_t* block_rank = nullptr;      // per block: its index among the changed blocks
  uint64_t* block_at = nullptr;        // per block: its first exponent's index in block_symbols
  uint16_t* positions = nullptr;       // N: each change's position in its block
  uint8_t* steps = nullptr;            // N: each change's step (new - old, mod 2^E)
  uint8_t* count_symbols = nullptr;    // per changed block
  uint8_t* change_symbols = nullptr;   // N
  uint8_t* escape_symbols = nullptr;   // N
  uint8_t* extra = nullptr;            // the fine extra bits
  uint8_t* scratch = nullptr;          // the stream writer's segment regions
  uint64_t* seg_bytes = nullptr;
  uint64_t* seg_offsets = nullptr;
  uint64_t* digests = nullptr;
  uint8_t* digest_bytes = nullptr;
  EncodePlan* plan = nullptr;
  const uint8_t* secret = nullptr;
  // Value-delta streams:
  uint8_t* sent_values = nullptr;     // N values: what the receivers hold
  uint32_t* z = nullptr;              // N: each value's zigzagged difference
  uint8_t* groups = nullptr;          // ceil(N/3): the group symbols
  uint64_t* chunk_escapes = nullptr;  // per difference chunk: its escapes, then its first one's index
  uint64_t* chunk_bits = nullptr;     // per difference chunk: its extra bits, then its first one's bit
  uint32_t* extra_words = nullptr;    // the difference section's extra bits (32-bit words, LSB first)
};

CIERA_HD inline void atomic_add64(uint64_t* at, uint64_t v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(at), static_cast<unsigned long long>(v));
#else
  *at += v;
#endif
}

CIERA_HD inline uint64_t block_length(const EncodeConfig& c, uint64_t block) {
  const uint64_t first = block * c.block_values;
  return c.num_values - first < c.block_values ? c.num_values - first : c.block_values;
}

CIERA_HD inline unsigned bucket_of(uint32_t v) {
  unsigned b = 0;
  while ((v >> b) != 0) ++b;
  return b;
}

CIERA_HD inline uint64_t stream_bound(uint64_t symbols, unsigned bits) {
  return writer::kStreamHeader + (symbols * bits + 7) / 8;
}

// Whether a step of the key frame that replaces a value-delta frame (c.fallback) is skipped:
// the differences fitted.
CIERA_HD inline bool fallback_unused(const EncodeBuffers& b, const EncodeConfig& c) {
  return c.fallback && !b.plan->use_key;
}

// --- the scan of the values --------------------------------------------------------------------

// Clears the bitmap and the padding before the plane: one thread per byte.
CIERA_HD inline void clear_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t k) {
  if (fallback_unused(b, c)) return;
  if (wire::kHeaderBytes + k < c.sign_mantissa_at) b.payload[wire::kHeaderBytes + k] = 0;
}

// Split: exponents to `exps`, sign-mantissa bits into the payload's plane. BF16/FP32 one thread
// per value, FP16 one per 8 values (3 bytes of the 3-bit plane).
CIERA_HD inline void split_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t g) {
  if (fallback_unused(b, c)) return;
  format::bits::split_group(c.dtype, b.values, c.num_values, g, b.exps, b.payload + c.sign_mantissa_at);
}

// The content checksum of the shard: one thread per 16 KiB chunk, then one combining them.
CIERA_HD inline void digest_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t chunk) {
  const uint64_t bytes = c.num_values * c.value_bytes;
  if (!c.checksum || chunk * format::kChecksumChunkBytes >= bytes) return;
  const uint64_t first = chunk * format::kChecksumChunkBytes;
  const uint64_t length = bytes - first < format::kChecksumChunkBytes ? bytes - first : format::kChecksumChunkBytes;
  b.digests[chunk] = format::xxh3::hash64(b.values + first, length, b.secret);
}
CIERA_HD inline void combine_step(const EncodeBuffers& b, const EncodeConfig& c) {
  const uint64_t bytes = c.num_values * c.value_bytes;
  const uint64_t chunks = (bytes + format::kChecksumChunkBytes - 1) / format::kChecksumChunkBytes;
  *b.plan = EncodePlan{};
  b.plan->content_checksum =
      c.checksum ? format::xxh3::combine_digests(b.digests, chunks, b.digest_bytes, b.secret) : 0;
}

// A block's XXH3-128, keeping `bits` of it (common/checksum.hpp, block_hash).
CIERA_HD inline format::xxh3::Hash128 block_hash_of(const uint8_t* exps, uint64_t length, uint32_t bits,
                                                     const uint8_t* secret) {
  format::xxh3::Hash128 h = format::xxh3::hash128(exps, length, secret);
  keep_hash_bits(h.low, h.high, bits);
  return h;
}

// The changed values of each block (exact), or whether its hash changed (hash; then also every
// block of a key frame, whose hashes the next frames compare with). One thread per block.
CIERA_HD inline void count_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t block) {
  if (block >= c.blocks || (c.key && !c.hash) || c.value_delta) return;
  const uint64_t first = block * c.block_values;
  const uint64_t length = block_length(c, block);
  if (c.hash) {
    const format::xxh3::Hash128 h = block_hash_of(b.exps + first, length, c.hash_bits, b.secret);
    b.changes_in_block[block] = h.low != b.sent_hashes[2 * block] || h.high != b.sent_hashes[2 * block + 1];
    b.sent_hashes[2 * block] = h.low;
    b.sent_hashes[2 * block + 1] = h.high;
    return;
  }
  uint32_t m = 0;
  for (uint64_t j = 0; j < length; ++j) m += b.exps[first + j] != b.sent[first + j];
  b.changes_in_block[block] = m;
}

// Delta frames, 1 thread: the bitmap, each changed block's rank and places, the totals.
CIERA_HD inline void scan_step(const EncodeBuffers& b, const EncodeConfig& c) {
  if (c.key) return;
  EncodePlan* plan = b.plan;
  uint64_t rank = 0, changes = 0, symbols = 0;
  for (uint64_t block = 0; block < c.blocks; ++block) {
    const uint32_t m = b.changes_in_block[block];
    if (m == 0) continue;
    b.payload[wire::kHeaderBytes + block / 8] =
        static_cast<uint8_t>(b.payload[wire::kHeaderBytes + block / 8] | (1u << (block % 8)));
    b.block_rank[block] = rank++;
    b.change_base[block] = changes;
    b.block_at[block] = symbols;
    changes += m;
    symbols += block_length(c, block);
  }
  plan->changed_blocks = rank;
  plan->changes = changes;
  plan->block_symbols = symbols;
}

// Delta frames: the changed blocks' exponents in block order (one thread per value).
CIERA_HD inline void gather_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t i) {
  if (c.key || i >= c.num_values) return;
  const uint64_t block = i / c.block_values;
  if (b.changes_in_block[block] == 0) return;
  b.block_symbols[b.block_at[block] + (i - block * c.block_values)] = b.exps[i];
}

// Fine coding: each changed block's changes, positions and steps (one thread per block).
CIERA_HD inline void emit_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t block) {
  if (c.key || c.coding == 1 || block >= c.blocks || b.changes_in_block[block] == 0) return;
  const uint64_t first = block * c.block_values;
  const uint64_t length = block_length(c, block);
  const uint8_t mask = static_cast<uint8_t>((1u << c.exponent_bits) - 1);
  uint64_t at = b.change_base[block];
  for (uint64_t j = 0; j < length; ++j) {
    if (b.exps[first + j] == b.sent[first + j]) continue;
    b.positions[at] = static_cast<uint16_t>(j);
    b.steps[at] = static_cast<uint8_t>((b.exps[first + j] - b.sent[first + j]) & mask);
    ++at;
  }
}

// Fine coding, 1 thread: count, change and escape symbols and the extra bits (count extras in
// block order, then gap extras in change order, LSB first), as the CPU's write_fine makes them;
// whether the fine section's bound fits the payload.
CIERA_HD inline void fine_symbols_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  if (c.key || c.coding == 1 || plan->changed_blocks == 0) return;
  const uint8_t mask = static_cast<uint8_t>((1u << c.exponent_bits) - 1);
  uint64_t bit = 0;
  const auto put = [&](uint32_t value, unsigned bits) {
    for (unsigned k = 0; k < bits; ++k, ++bit) {
      if ((bit & 7) == 0) b.extra[bit >> 3] = 0;
      b.extra[bit >> 3] = static_cast<uint8_t>(b.extra[bit >> 3] | (((value >> k) & 1u) << (bit & 7)));
    }
  };
  for (uint64_t block = 0; block < c.blocks; ++block) {
    const uint32_t m = b.changes_in_block[block];
    if (m == 0) continue;
    const unsigned bucket = bucket_of(m - 1);
    b.count_symbols[b.block_rank[block]] = static_cast<uint8_t>(bucket);
    put(m - 1 - wire::bucket_base(bucket), wire::bucket_extra_bits(bucket));
  }
  uint64_t escapes = 0;
  for (uint64_t block = 0; block < c.blocks; ++block) {
    const uint32_t m = b.changes_in_block[block];
    if (m == 0) continue;
    int64_t previous = -1;
    for (uint64_t k = b.change_base[block], end = k + m; k < end; ++k) {
      const uint32_t gap = static_cast<uint32_t>(b.positions[k] - previous - 1);
      previous = b.positions[k];
      const unsigned bucket = bucket_of(gap);
      const uint8_t step = b.steps[k];
      const unsigned step_class = step == 1 ? 0u : step == mask ? 1u : 2u;
      b.change_symbols[k] = static_cast<uint8_t>(wire::kStepClasses * bucket + step_class);
      if (step_class == 2) b.escape_symbols[escapes++] = step;
      put(gap - wire::bucket_base(bucket), wire::bucket_extra_bits(bucket));
    }
  }
  plan->escapes = escapes;
  plan->extra_bits = bit;
  plan->extra_bytes = (bit + 7) / 8;
  const uint64_t section_at = c.sign_mantissa_at + c.sign_mantissa_bytes;
  const uint64_t bound = stream_bound(plan->changed_blocks, 4) + stream_bound(plan->changes, 6) +
                         stream_bound(escapes, c.exponent_bits) + 8 + plan->extra_bytes;
  plan->fine_fits = bound <= c.capacity - section_at;
}

// --- writing one symbol stream (entropy/stream_writer_hd.hpp) -------------------------------------

// Which stream a writer pass writes.
enum StreamKind : uint32_t {
  kFullStream, kBlockStream, kCountStream, kChangeStream, kEscapeStream,
  kGroupStream, kDifferenceEscapeStream,  // value-delta frames
};

// A value-delta frame's difference section is written (some value changed, and it fits).
CIERA_HD inline bool differences_written(const EncodePlan& plan, const EncodeConfig& c) {
  return c.value_delta && !c.key && plan.changes != 0 && !plan.use_key;
}

// Whether this frame writes stream `kind`; its symbols and count, and where it goes.
CIERA_HD inline bool stream_wanted(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind,
                                   const uint8_t** symbols, uint64_t* count) {
  const EncodePlan& plan = *b.plan;
  switch (kind) {
    case kFullStream:
      *symbols = b.exps;
      *count = c.num_values;
      return c.key && (!c.fallback || plan.use_key);
    case kGroupStream:
      *symbols = b.groups;
      *count = (c.num_values + kGroupValues - 1) / kGroupValues;
      return differences_written(plan, c);
    case kDifferenceEscapeStream:
      *symbols = b.escape_symbols;
      *count = plan.escapes;
      return differences_written(plan, c);
    case kBlockStream:
      *symbols = b.block_symbols;
      *count = plan.block_symbols;
      return !c.key && plan.changed_blocks != 0 && !plan.use_fine;
    case kCountStream:
      *symbols = b.count_symbols;
      *count = plan.changed_blocks;
      return !c.key && c.coding != 1 && plan.changed_blocks != 0 && plan.fine_fits;
    case kChangeStream:
      *symbols = b.change_symbols;
      *count = plan.changes;
      return !c.key && c.coding != 1 && plan.changed_blocks != 0 && plan.fine_fits;
    default:
      *symbols = b.escape_symbols;
      *count = plan.escapes;
      return !c.key && c.coding != 1 && plan.changed_blocks != 0 && plan.fine_fits;
  }
}

// 1 thread: a fresh histogram, and where the stream goes (after the one before it).
CIERA_HD inline void stream_begin_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind) {
  EncodePlan* plan = b.plan;
  const uint64_t section_at = c.sign_mantissa_at + c.sign_mantissa_bytes;
  const uint64_t at = (kind == kFullStream || kind == kBlockStream || kind == kCountStream ||
                       kind == kGroupStream)
                          ? section_at
                          : plan->stream_at + plan->stream.bytes;
  writer::WriterPlan& w = plan->stream;
  for (unsigned s = 0; s < 256; ++s) w.count[s] = 0;
  const uint8_t* symbols;
  uint64_t count;
  w.total = stream_wanted(b, c, kind, &symbols, &count) ? count : 0;
  plan->stream_at = at;
}

CIERA_HD inline void stream_histogram_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind, uint64_t i) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count) || i >= count) return;
  atomic_add64(&b.plan->stream.count[symbols[i]], 1);
}

CIERA_HD inline void stream_plan_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  writer::plan_writer(&b.plan->stream);
}

CIERA_HD inline void stream_segment_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind, uint64_t j) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  writer::encode_segment(&b.plan->stream, symbols, b.scratch, b.seg_bytes, j);
}

CIERA_HD inline void stream_finish_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  writer::finish_writer(&b.plan->stream, b.seg_bytes, b.seg_offsets, b.payload + b.plan->stream_at);
}

CIERA_HD inline void stream_copy_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind, uint64_t j) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  writer::copy_segment(&b.plan->stream, b.scratch, b.seg_bytes, b.seg_offsets, b.payload + b.plan->stream_at, j);
}

CIERA_HD inline void stream_packed_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind, uint64_t k) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  writer::packed_byte(&b.plan->stream, symbols, b.payload + b.plan->stream_at, k);
}

// 1 thread, after a stream: its length into the section's.
CIERA_HD inline void stream_end_step(const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind) {
  const uint8_t* symbols;
  uint64_t count;
  if (!stream_wanted(b, c, kind, &symbols, &count)) return;
  EncodePlan* plan = b.plan;
  const uint64_t section_at = c.sign_mantissa_at + c.sign_mantissa_bytes;
  const uint64_t end = plan->stream_at + plan->stream.bytes;
  if (kind == kFullStream || kind == kBlockStream) {
    plan->exponent_bytes = end - section_at;
  } else if (kind == kEscapeStream) {
    // The extra bits follow: their length, then the bytes (fine_extra_step).
    for (unsigned k = 0; k < 8; ++k) b.payload[end + k] = static_cast<uint8_t>(plan->extra_bytes >> (8 * k));
    plan->fine_bytes = end + 8 + plan->extra_bytes - section_at;
  } else if (kind == kDifferenceEscapeStream) {
    // The extra bits follow here too (difference_extra_step).
    for (unsigned k = 0; k < 8; ++k) b.payload[end + k] = static_cast<uint8_t>(plan->extra_bytes >> (8 * k));
    plan->exponent_bytes = end + 8 + plan->extra_bytes - section_at;
    // The CPU's rule: coded past the key frame's own bound, the key frame goes instead.
    const uint64_t frame_bytes = wire::kHeaderBytes + plan->exponent_bytes;
    plan->use_key = frame_bytes > value_delta_frame_bound(c.key_sign_mantissa_at, c.plane_bytes,
                                                          c.num_values, c.exponent_bits);
  }
}

// Fine coding: the extra bytes into place (one thread per byte).
CIERA_HD inline void fine_extra_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t k) {
  const EncodePlan& plan = *b.plan;
  if (c.key || c.coding == 1 || plan.changed_blocks == 0 || !plan.fine_fits || k >= plan.extra_bytes) return;
  const uint64_t section_at = c.sign_mantissa_at + c.sign_mantissa_bytes;
  b.payload[section_at + plan.fine_bytes - plan.extra_bytes + k] = b.extra[k];
}

// 1 thread: fine or block coding, by the CPU encoder's rules (encoder.cpp: fine when it fits; in
// auto mode, unless it is above 80% of a sampled block estimate and no smaller than block
// coding's estimated stream).
CIERA_HD inline void choose_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  if (c.key) {
    plan->section = kFullSection;
    return;
  }
  if (plan->changed_blocks == 0) {
    plan->section = kUnchangedSection;
    plan->exponent_bytes = 0;
    return;
  }
  if (c.coding == 1) {
    plan->use_fine = 0;
    plan->section = kBlockSection;
    return;
  }
  bool use_fine = plan->fine_fits != 0;
  if (use_fine && c.coding == 0) {
    // The sampled estimate of block coding's bits (encoder.cpp, estimate_block_bits_q16).
    const uint64_t n = c.num_values;
    uint64_t stride = n / 4096 < 1 ? 1 : n / 4096;
    stride |= 1;
    uint64_t* sample = plan->stream.count;  // scratch: the stream writer is idle now
    for (unsigned s = 0; s < 256; ++s) sample[s] = 0;
    uint64_t sampled = 0;
    for (uint64_t v = 0; v < n; v += stride) {
      if (b.changes_in_block[v / c.block_values] == 0) continue;
      ++sample[b.exps[v]];
      ++sampled;
    }
    uint64_t estimate_q16 = 0;
    if (sampled > 0) {
      uint16_t freq[256];
      uint8_t first = 0, last = 0;
      entropy::normalise_frequencies(sample, sampled, freq, &first, &last);
      uint64_t cost = 0;
      for (unsigned s = 0; s < 256; ++s) {
        if (sample[s] != 0) cost += entropy::rans_cost_q16(sample[s], freq[s]);
      }
      estimate_q16 = cost / sampled * plan->block_symbols;
    }
    const auto fine_bits_q16 = static_cast<unsigned __int128>(plan->fine_bytes) * (8 << 16);
    const bool close = 5 * fine_bits_q16 > 4 * static_cast<unsigned __int128>(estimate_q16);
    plan->use_fine = close ? 2 : 1;  // 2: compare with block coding's estimated stream first
    return;
  }
  plan->use_fine = use_fine ? 1 : 0;
  plan->section = use_fine ? kFineSection : kBlockSection;
}

// 1 thread, when choose_step left it open: block coding's estimated stream (estimate_stream_bytes:
// the smaller of packed and the rANS estimate) from the block histogram in plan->stream.count.
CIERA_HD inline void choose_exact_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  if (c.key || plan->use_fine != 2) return;
  writer::WriterPlan& w = plan->stream;
  w.total = plan->block_symbols;
  writer::plan_writer(&w);
  uint64_t estimate = w.packed_bytes;
  if (w.method == kConstantStream) {
    estimate = writer::kStreamHeader;
  } else if (w.total > 0) {
    uint64_t cost = 0;
    for (unsigned s = 0; s < 256; ++s) {
      if (w.count[s] != 0) cost += entropy::rans_cost_q16(w.count[s], w.freq[s]);
    }
    constexpr uint64_t kByteQ16 = uint64_t{8} << 16;
    const uint64_t rans = writer::kStreamHeader + w.table_bytes + entropy::rans_framing_bytes(w.total) +
                          (cost + kByteQ16 - 1) / kByteQ16;
    if (rans < estimate) estimate = rans;
  }
  plan->use_fine = plan->fine_bytes <= estimate ? 1 : 0;
}

// 1 thread: the section kind once decided.
CIERA_HD inline void section_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  if (c.key || plan->changed_blocks == 0) return;
  plan->section = plan->use_fine ? kFineSection : kBlockSection;
  if (plan->use_fine) plan->exponent_bytes = plan->fine_bytes;
}

// The receivers' exponents after this frame (exact detection): one thread per value.
CIERA_HD inline void remember_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t i) {
  if (!c.hash && !c.value_delta && i < c.num_values) b.sent[i] = b.exps[i];
}


// --- value-delta frames (docs/format.md, "Value-delta frames") ------------------------------------
//
// differences   per value   z = zigzag(ord(new) - ord(old)); the sent copy moves on to the values
// groups        per group   c0 | c1 << 2 | c2 << 4, c = min(z, 3)
// count         per chunk   changed values (atomic), escapes and their extra bits
// plan          1 thread    each chunk's first escape and extra bit (a prefix sum over the
//                           chunks); 'unchanged', 'differences', or a key frame when the section's
//                           packed bound does not fit (the CPU's rule, encoder.cpp)
// escapes       per chunk   escape symbols in value order, extra bits into place (atomic OR)
// then the groups and escapes streams, the extra length and bytes, and the header; or, when the
// differences do not fit, the key frame's steps (c.fallback), which did nothing otherwise.

// Values per chunk of the escape compaction (a multiple of the group size).
inline constexpr uint64_t kDifferenceChunkValues = 3 * 256;

CIERA_HD inline uint64_t difference_chunks(uint64_t n) {
  return (n + kDifferenceChunkValues - 1) / kDifferenceChunkValues;
}
// 32-bit words that hold the most extra bits a section of `n` values can have (every value
// escaped, 8 * value_bytes - 1 bits each), and one more.
CIERA_HD inline uint64_t difference_extra_words(uint64_t n, uint64_t value_bytes) {
  return (n * (8 * value_bytes - 1) + 31) / 32 + 1;
}

CIERA_HD inline uint32_t value_at(const uint8_t* values, uint8_t value_bytes, uint64_t i) {
  if (value_bytes == 2) return static_cast<uint32_t>(values[2 * i] | values[2 * i + 1] << 8);
  return format::xxh3::read32(values + 4 * i);
}

CIERA_HD inline void put_value_at(uint8_t* values, uint8_t value_bytes, uint64_t i, uint32_t v) {
  for (unsigned k = 0; k < value_bytes; ++k) values[value_bytes * i + k] = static_cast<uint8_t>(v >> (8 * k));
}

// The zigzagged difference of two bit patterns of `value_bytes` bytes.
CIERA_HD inline uint32_t difference_of(uint32_t now, uint32_t before, uint8_t value_bytes) {
  if (value_bytes == 2) {
    return zigzag<uint16_t>(static_cast<uint16_t>(to_ordered<uint16_t>(static_cast<uint16_t>(now)) -
                                                  to_ordered<uint16_t>(static_cast<uint16_t>(before))));
  }
  return zigzag<uint32_t>(to_ordered<uint32_t>(now) - to_ordered<uint32_t>(before));
}

// The bit width of `v` (an escape's bucket; 32 for the largest FP32 differences).
CIERA_HD inline unsigned width_of(uint32_t v) {
  unsigned w = 0;
  while (w < 32 && (v >> w) != 0) ++w;
  return w;
}

CIERA_HD inline void atomic_or32(uint32_t* at, uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicOr(at, v);
#else
  *at |= v;
#endif
}

// `bits` (< 32) bits of `value` at bit `pos` of `words` (LSB first), which hold zeros there.
CIERA_HD inline void put_bits(uint32_t* words, uint64_t pos, uint32_t value, unsigned bits) {
  if (bits == 0) return;
  const uint64_t v = uint64_t{value} << (pos & 31);
  atomic_or32(words + (pos >> 5), static_cast<uint32_t>(v));
  if ((pos & 31) + bits > 32) atomic_or32(words + (pos >> 5) + 1, static_cast<uint32_t>(v >> 32));
}

// One thread per value.
CIERA_HD inline void difference_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t i) {
  if (i >= c.num_values) return;
  const uint32_t now = value_at(b.values, c.value_bytes, i);
  b.z[i] = difference_of(now, value_at(b.sent_values, c.value_bytes, i), c.value_bytes);
  put_value_at(b.sent_values, c.value_bytes, i, now);
}

// One thread per group; values past N have class 0.
CIERA_HD inline void group_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t g) {
  uint32_t symbol = 0;
  for (unsigned j = 0; j < kGroupValues; ++j) {
    const uint64_t i = kGroupValues * g + j;
    if (i >= c.num_values) break;
    const uint32_t z = b.z[i];
    symbol |= (z < kEscapeClass ? z : kEscapeClass) << (2 * j);
  }
  b.groups[g] = static_cast<uint8_t>(symbol);
}

// One thread per chunk: its changed values (into the plan), escapes and extra bits.
CIERA_HD inline void difference_count_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t k) {
  const uint64_t first = k * kDifferenceChunkValues;
  if (first >= c.num_values) return;
  const uint64_t end = c.num_values - first < kDifferenceChunkValues ? c.num_values : first + kDifferenceChunkValues;
  uint64_t changed = 0, escapes = 0, bits = 0;
  for (uint64_t i = first; i < end; ++i) {
    const uint32_t z = b.z[i];
    changed += z != 0;
    if (z < kEscapeClass) continue;
    ++escapes;
    bits += escape_extra_bits(width_of(z - kEscapeClass));
  }
  b.chunk_escapes[k] = escapes;
  b.chunk_bits[k] = bits;
  if (changed != 0) atomic_add64(&b.plan->changes, changed);
}

// 1 thread: the chunks' first escapes and extra bits, the totals, and the section (or a key frame).
CIERA_HD inline void difference_plan_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  uint64_t escapes = 0, bits = 0;
  for (uint64_t k = 0, chunks = difference_chunks(c.num_values); k < chunks; ++k) {
    const uint64_t e = b.chunk_escapes[k], x = b.chunk_bits[k];
    b.chunk_escapes[k] = escapes;
    b.chunk_bits[k] = bits;
    escapes += e;
    bits += x;
  }
  plan->escapes = escapes;
  plan->extra_bits = bits;
  plan->extra_bytes = (bits + 7) / 8;
  plan->exponent_bytes = 0;
  plan->use_key = 0;
  if (plan->changes == 0) {
    plan->section = kUnchangedSection;  // unchanged: an empty section
    return;
  }
  plan->section = kDifferencesSection;
  const uint64_t groups = (c.num_values + kGroupValues - 1) / kGroupValues;
  const uint64_t bound = stream_bound(groups, kGroupSymbolBits) + stream_bound(escapes, kEscapeSymbolBits) +
                         8 + plan->extra_bytes;
  // The CPU's rule: written only where its packed bound fits max_payload_bytes (c.capacity);
  // stream_end_step checks the coded size against the key frame's own bound.
  plan->use_key = bound > c.capacity - wire::kHeaderBytes;
}

// Clears the extra bits' words the section uses (one thread per word).
CIERA_HD inline void difference_clear_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t w) {
  const EncodePlan& plan = *b.plan;
  if (!differences_written(plan, c) || 4 * w >= plan.extra_bytes + 4) return;
  b.extra_words[w] = 0;
}

// One thread per chunk: its escapes' symbols and extra bits, in value order.
CIERA_HD inline void difference_escape_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t k) {
  const EncodePlan& plan = *b.plan;
  const uint64_t first = k * kDifferenceChunkValues;
  if (!differences_written(plan, c) || first >= c.num_values) return;
  const uint64_t end = c.num_values - first < kDifferenceChunkValues ? c.num_values : first + kDifferenceChunkValues;
  uint64_t e = b.chunk_escapes[k], bit = b.chunk_bits[k];
  for (uint64_t i = first; i < end; ++i) {
    const uint32_t z = b.z[i];
    if (z < kEscapeClass) continue;
    const uint32_t v = z - kEscapeClass;
    const unsigned bucket = width_of(v);
    const unsigned bits = escape_extra_bits(bucket);
    b.escape_symbols[e++] = static_cast<uint8_t>(bucket);
    put_bits(b.extra_words, bit, static_cast<uint32_t>(v - escape_base(bucket)), bits);
    bit += bits;
  }
}

// The extra bytes into place after their length (one thread per byte).
CIERA_HD inline void difference_extra_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t k) {
  const EncodePlan& plan = *b.plan;
  if (!differences_written(plan, c) || k >= plan.extra_bytes) return;
  const auto* extra = reinterpret_cast<const uint8_t*>(b.extra_words);
  b.payload[wire::kHeaderBytes + plan.exponent_bytes - plan.extra_bytes + k] = extra[k];
}

// A value-delta stream's key frame: the receivers now hold these values (one thread per value).
CIERA_HD inline void remember_values_step(const EncodeBuffers& b, const EncodeConfig& c, uint64_t i) {
  if (i < c.num_values) put_value_at(b.sent_values, c.value_bytes, i, value_at(b.values, c.value_bytes, i));
}

// 1 thread: the header (docs/format.md, "Header"), with its checksum; the payload's length.
CIERA_HD inline void header_step(const EncodeBuffers& b, const EncodeConfig& c) {
  EncodePlan* plan = b.plan;
  // A value-delta frame's header, or that of the key frame sent instead (fallback): one of them.
  if (fallback_unused(b, c) || (c.value_delta && !c.key && plan->use_key)) return;
  uint8_t* p = b.payload;
  const auto put = [p](uint64_t at, uint64_t v, unsigned bytes) {
    for (unsigned k = 0; k < bytes; ++k) p[at + k] = static_cast<uint8_t>(v >> (8 * k));
  };
  namespace field = wire::field;
  put(field::kMagic, wire::kMagic, 4);
  p[field::kVersion] = wire::kVersion;
  p[field::kDtype] = c.dtype;
  p[field::kKind] = static_cast<uint8_t>(c.key           ? kKeyFrame
                                         : c.value_delta ? kValueDeltaFrame
                                                         : kExponentDeltaFrame);
  p[field::kSection] = static_cast<uint8_t>(c.key ? kFullSection : plan->section);
  put(field::kFlags, c.checksum ? wire::kFlagContentChecksum : 0, 2);
  put(field::kReserved16, 0, 2);
  put(field::kBlockValues, c.block_values, 4);
  put(field::kNumValues, c.num_values, 8);
  put(field::kEpoch, c.epoch, 4);
  put(field::kStream, c.stream, 4);
  put(field::kSequence, c.sequence, 8);
  put(field::kBitmapBytes, c.bitmap_bytes, 8);
  put(field::kSignMantissaBytes, c.sign_mantissa_bytes, 8);
  put(field::kExponentBytes, plan->exponent_bytes, 8);
  put(field::kContentChecksum, plan->content_checksum, 8);
  put(field::kHeaderChecksum,
      static_cast<uint32_t>(format::xxh3::hash64(p, field::kHeaderChecksum, b.secret)), 4);
  put(field::kReserved32, 0, 4);
  plan->payload_bytes = c.sign_mantissa_at + c.sign_mantissa_bytes + plan->exponent_bytes;
}

// Runs one stream's writer passes (kind) with `launch`.
template <typename Launch>
void write_stream(Launch& launch, const EncodeBuffers& b, const EncodeConfig& c, uint32_t kind,
                  uint64_t max_symbols) {
  launch(1, [=] CIERA_HD(uint64_t) { stream_begin_step(b, c, kind); });
  launch(max_symbols, [=] CIERA_HD(uint64_t i) { stream_histogram_step(b, c, kind, i); });
  launch(1, [=] CIERA_HD(uint64_t) { stream_plan_step(b, c, kind); });
  const uint64_t segments = entropy::rans_segment_count(max_symbols);
  launch(segments, [=] CIERA_HD(uint64_t j) { stream_segment_step(b, c, kind, j); });
  launch(1, [=] CIERA_HD(uint64_t) { stream_finish_step(b, c, kind); });
  launch(segments, [=] CIERA_HD(uint64_t j) { stream_copy_step(b, c, kind, j); });
  launch(max_symbols, [=] CIERA_HD(uint64_t k) { stream_packed_step(b, c, kind, k); });
  launch(1, [=] CIERA_HD(uint64_t) { stream_end_step(b, c, kind); });
}

// The steps of one frame, in order. `launch(n, f)` runs f(i) for every i in [0, n).
template <typename Launch>
void encode_frame(Launch&& launch, const EncodeBuffers& b, const EncodeConfig& c) {
  const uint64_t n = c.num_values;
  const uint64_t value_bytes = n * c.value_bytes;
  const uint64_t chunks = (value_bytes + format::kChecksumChunkBytes - 1) / format::kChecksumChunkBytes;
  if (c.value_delta && !c.key) {
    // A value-delta frame, or the key frame that replaces it when the differences do not fit.
    launch(chunks, [=] CIERA_HD(uint64_t k) { digest_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { combine_step(b, c); });
    const uint64_t groups = (n + kGroupValues - 1) / kGroupValues;
    const uint64_t difference_chunk_count = difference_chunks(n);
    launch(n, [=] CIERA_HD(uint64_t i) { difference_step(b, c, i); });
    launch(groups, [=] CIERA_HD(uint64_t g) { group_step(b, c, g); });
    launch(difference_chunk_count, [=] CIERA_HD(uint64_t k) { difference_count_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { difference_plan_step(b, c); });
    launch(difference_extra_words(n, c.value_bytes), [=] CIERA_HD(uint64_t w) { difference_clear_step(b, c, w); });
    launch(difference_chunk_count, [=] CIERA_HD(uint64_t k) { difference_escape_step(b, c, k); });
    write_stream(launch, b, c, kGroupStream, groups);
    write_stream(launch, b, c, kDifferenceEscapeStream, n);
    launch(4 * difference_extra_words(n, c.value_bytes),
           [=] CIERA_HD(uint64_t k) { difference_extra_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { header_step(b, c); });
    EncodeConfig key = c;  // the key frame's steps, each a no-op unless the plan chose it
    key.key = 1;
    key.fallback = 1;
    key.bitmap_bytes = 0;
    key.sign_mantissa_bytes = c.plane_bytes;
    key.sign_mantissa_at = c.key_sign_mantissa_at;
    launch(key.sign_mantissa_at - wire::kHeaderBytes,
           [=] CIERA_HD(uint64_t k) { clear_step(b, key, k); });
    launch(format::bits::group_count(c.dtype, n), [=] CIERA_HD(uint64_t g) { split_step(b, key, g); });
    write_stream(launch, b, key, kFullStream, n);
    launch(1, [=] CIERA_HD(uint64_t) { header_step(b, key); });
    return;
  }
  launch(c.sign_mantissa_at - wire::kHeaderBytes,
         [=] CIERA_HD(uint64_t k) { clear_step(b, c, k); });
  launch(format::bits::group_count(c.dtype, n), [=] CIERA_HD(uint64_t g) { split_step(b, c, g); });
  launch(chunks, [=] CIERA_HD(uint64_t k) { digest_step(b, c, k); });
  launch(1, [=] CIERA_HD(uint64_t) { combine_step(b, c); });
  if (c.key) {
    launch(c.blocks, [=] CIERA_HD(uint64_t k) { count_step(b, c, k); });  // hash detection only
    write_stream(launch, b, c, kFullStream, n);
  } else {
    launch(c.blocks, [=] CIERA_HD(uint64_t k) { count_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { scan_step(b, c); });
    launch(n, [=] CIERA_HD(uint64_t i) { gather_step(b, c, i); });
    if (c.coding != 1) {
      launch(c.blocks, [=] CIERA_HD(uint64_t k) { emit_step(b, c, k); });
      launch(1, [=] CIERA_HD(uint64_t) { fine_symbols_step(b, c); });
      write_stream(launch, b, c, kCountStream, c.blocks);
      write_stream(launch, b, c, kChangeStream, n);
      write_stream(launch, b, c, kEscapeStream, n);
      launch((11 * (c.blocks + n) + 7) / 8 + 8, [=] CIERA_HD(uint64_t k) { fine_extra_step(b, c, k); });
    }
    launch(1, [=] CIERA_HD(uint64_t) { choose_step(b, c); });
    // Block coding's histogram, for choose_exact_step (only when it is undecided).
    launch(1, [=] CIERA_HD(uint64_t) {
      if (b.plan->use_fine == 2) {
        for (unsigned s = 0; s < 256; ++s) b.plan->stream.count[s] = 0;
      }
    });
    launch(n, [=] CIERA_HD(uint64_t i) {
      if (b.plan->use_fine == 2 && i < b.plan->block_symbols) atomic_add64(&b.plan->stream.count[b.block_symbols[i]], 1);
    });
    launch(1, [=] CIERA_HD(uint64_t) { choose_exact_step(b, c); });
    launch(1, [=] CIERA_HD(uint64_t) { section_step(b, c); });
    write_stream(launch, b, c, kBlockStream, n);
  }
  if (c.value_delta) {
    launch(n, [=] CIERA_HD(uint64_t i) { remember_values_step(b, c, i); });
  } else {
    launch(n, [=] CIERA_HD(uint64_t i) { remember_step(b, c, i); });
  }
  launch(1, [=] CIERA_HD(uint64_t) { header_step(b, c); });
}

// The configuration as the steps see it.
EncodeConfig make_encode_config(const CodecConfig& config, uint64_t num_values);
// This frame's fields of `c`: kind, stream position and the plane's offset.
void set_frame(EncodeConfig& c, bool key, uint32_t stream, uint32_t epoch, uint64_t sequence);

}  // namespace ciera::codec::device
