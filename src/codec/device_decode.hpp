// The GPU decoder's steps (docs/gpu.md, "The device decoder"), as CIERA_HD functions: the CUDA
// decoder (src/cuda/decoder.cu) runs each step as a kernel, one thread per index, and the host
// emulation (codec/device_decode_emulation.hpp) runs the same functions in loops, so that the
// decoder's logic is tested against the CPU decoder on every machine.
//
// A frame is decoded in this order, each step a no-op once an earlier one failed (the plan's
// status), so that a bad payload never reaches the exponent cache (docs/format.md, "Integrity"):
//   plan       1 thread   header, configuration and stream position; the bitmap (each changed
//                         block's place in `decoded`); the exponent stream's framing
//   slots      4096       the rANS decoding table of a full/block stream
//   symbols    per symbol / per rANS segment: the full/block stream into `decoded`
//   expand     per value  fine frames: changed blocks' cached exponents into `decoded`
//   fine       1 thread   fine frames: the change lists, applied to `decoded`
//   finish     1 thread   the canonical-form checks that need every symbol (a packed stream's
//                         width, and its two distinct symbols at least)
//   blocks     per block  block frames: each marked block changes an exponent (canonical form)
//   merge      per value  (FP16: per 8 values) exponents and sign-mantissa plane into the output
//   digest     per 16 KiB chunk of the output, then `verify` (1 thread): the content checksum
//   commit     per value  the new exponents into the cache, then `commit_state` (1 thread)
//
// A value-delta stream's decoder (docs/format.md, "Value-delta frames") caches the previous
// values instead. Its key frames take the steps above (the cache is then the output); its
// value-delta frames: `plan` reads the groups stream's framing, `symbols` decodes it into
// `decoded`, then per chunk of groups the escapes are counted, one thread plans the escapes
// stream, which is decoded like the others (per symbol or per rANS segment), per chunk the extra
// bits are counted, one thread checks their length and padding, and per chunk the values are
// rebuilt into the output from the cache (one thread walks its chunk's escapes in order). The
// cache is written only by `commit`, from the verified output, so a refused frame leaves it as it
// was with no second copy and nothing to revert.
#pragma once

#include <cstdint>
#include <string>

#include "ciera/config.hpp"
#include "codec/device_codes.hpp"
#include "codec/differences.hpp"
#include "codec/fine_alphabet.hpp"
#include "codec/stream_position.hpp"
#include "codec/wire.hpp"
#include "common/host_device.hpp"
#include "entropy/rans_core.hpp"
#include "entropy/rans_segment.hpp"
#include "entropy/stream_header.hpp"
#include "format/content_checksum.hpp"
#include "format/value_bits.hpp"
#include "format/xxh3.hpp"

namespace ciera::codec::device {

// Why a frame was refused; the host words it (cuda::ShardDecoder), with detail[0..1].
enum Status : uint32_t {
  kOk = 0,
  kTruncated,            // payload shorter than its header or its sections
  kBadMagic,
  kBadVersion,           // detail: version
  kHeaderChecksum,
  kReservedNonZero,
  kBadCode,              // detail: byte offset, value (dtype, kind, section)
  kKindSectionMismatch,
  kBadFlags,
  kBadBlockSize,
  kChecksumWithoutFlag,
  kTrailingBytes,        // detail: bytes
  kPaddingNonZero,
  kConfigMismatch,       // detail: header offset of the field, payload value
  kChecksumRequired,
  kMisrouted,            // detail: payload stream
  kNoCache,
  kOutOfSequence,        // detail: epoch, sequence
  kUnrequestedEpoch,     // detail: epoch
  kTooFarAhead,          // detail: epochs ahead
  kSignMantissaPadding,
  kBitmapPastEnd,
  kSectionBitmapMismatch,
  kStreamMalformed,      // detail: which stream (0 exponents, 1 counts, 2 changes, 3 escapes)
  kSymbolTooLarge,       // detail: stream, symbol
  kFineCountTooLarge,    // detail: block, count
  kFineBadEscape,        // detail: step
  kFinePastBlock,        // detail: block
  kFineExtraBits,
  kContentChecksum,
  // Value-delta streams:
  kWrongStreamKind,          // detail: frame kind (an exponent-delta frame to a value-delta decoder, or the reverse)
  kDifferenceClassPastEnd,   // a class other than 0 past the last value
  kDifferenceEscapeTooLarge, // detail: the escaped difference
  kDifferenceExtraBits,      // detail: L, the length the escapes need
  kDifferenceNoChange,       // a 'differences' section in which no value changed
  kBlockUnchanged,           // detail: a marked block whose exponents all equal the cached ones
};

// The symbol streams a status names in detail[0] (kStreamMalformed, kSymbolTooLarge).
enum StreamId : uint32_t {
  kExponentStreamId = 0, kCountStreamId, kChangeStreamId, kFineEscapeStreamId,
  kGroupStreamId, kDifferenceEscapeStreamId,
};

inline constexpr uint64_t kNotChanged = ~uint64_t{0};

// What the decoder is set up for (host-side constants of its configuration).
struct DecodeConfig {
  uint8_t dtype = 1;          // wire code
  uint8_t exponent_bits = 8;
  uint8_t value_bytes = 2;
  uint8_t require_checksum = 1;
  uint32_t block_values = 512;
  uint64_t num_values = 0;
  uint64_t blocks = 0;
  uint64_t bitmap_bytes = 0;          // of a delta frame
  uint64_t sign_mantissa_bytes = 0;
  uint64_t low_plane_bytes = 0;       // the first plane (n bytes)
  uint8_t value_delta = 0;            // a value-delta stream: the cache holds the previous values
};

// Where the stream stands (docs/format.md, "Streams"); device-resident, updated by commit_state.
struct DecodeState {
  uint32_t stream = 0;
  uint32_t epoch = 0;
  uint64_t last_sequence = 0;
  uint32_t has_cache = 0;
  uint32_t decoded_any = 0;
  uint32_t resync_requested = 0;
};

// A symbol stream's framing (docs/format.md, "Symbol stream").
struct StreamPlan {
  uint32_t method = 0;  // 0 packed, 1 constant, 2 rANS
  uint32_t width = 0;   // packed
  uint32_t constant = 0;
  uint32_t max_symbol = 0;
  uint64_t symbols = 0;
  uint64_t body_at = 0;  // payload offset of the body (rANS: of the first segment)
  uint64_t body_bytes = 0;
  uint64_t segments = 0;
  uint16_t freq[256] = {};
  uint16_t start[256] = {};
};

// One frame's decoding plan; device-resident, written by plan and read by every later step.
struct DecodePlan {
  uint32_t status = kOk;
  uint64_t detail[2] = {0, 0};
  uint32_t kind = 0;
  uint32_t section = 0;
  uint32_t epoch = 0;
  uint64_t sequence = 0;
  uint32_t has_checksum = 0;
  uint64_t content_checksum = 0;
  uint64_t sign_mantissa_at = 0;
  uint64_t section_at = 0;
  uint64_t exponent_bytes = 0;
  uint64_t changed_blocks = 0;
  uint64_t block_symbols = 0;  // symbols of `decoded` (full: N; block/fine: changed blocks' values)
  uint32_t max_packed = 0;     // largest packed symbol seen (atomic max)
  uint32_t packed_varied = 0;  // some packed symbol differs from the first (atomic max)
  StreamPlan exps;             // (a value-delta frame: the groups stream)
  StreamPlan fine[3];          // the fine section's counts, changes and escapes streams
  // Value-delta frames:
  StreamPlan escapes;          // the escapes stream
  uint32_t max_packed_escape = 0;
  uint32_t packed_escape_varied = 0;
  uint32_t changed = 0;        // some value changed
  uint64_t groups_end = 0;     // payload offset past the groups stream
  uint64_t escape_count = 0;
  uint64_t extra_at = 0;       // payload offset of the extra bits
  uint64_t extra_bytes = 0;    // L
};

// The buffers every step sees (device pointers on the GPU, host pointers in the emulation).
struct Buffers {
  const uint8_t* payload = nullptr;
  uint64_t payload_bytes = 0;
  uint8_t* out = nullptr;            // the shard (N values)
  uint8_t* cache = nullptr;          // N exponents
  uint8_t* decoded = nullptr;        // N exponents: the frame's new exponents of changed blocks
  uint64_t* block_offset = nullptr;  // per block: its first value's index in `decoded`, or kNotChanged
  uint64_t* segment_offsets = nullptr;  // rANS segments + 1 (of the full/block stream)
  uint32_t* slots = nullptr;         // kRansTotal
  uint32_t* fine_slots = nullptr;    // 3 * kRansTotal: the fine streams' tables
  uint64_t* digests = nullptr;       // checksum chunks
  uint8_t* digest_bytes = nullptr;   // 8 * checksum chunks
  DecodePlan* plan = nullptr;
  DecodeState* state = nullptr;
  const uint8_t* secret = nullptr;   // XXH3's default secret
  // Value-delta streams (`fine_slots` then holds the escapes stream's table):
  uint8_t* values = nullptr;          // N values: the cache (the previous values)
  uint8_t* escape_symbols = nullptr;  // N
  uint64_t* escape_offsets = nullptr; // rANS segments + 1 (of the escapes stream)
  uint64_t* chunk_escapes = nullptr;  // per difference chunk: its escapes, then its first one's index
  uint64_t* chunk_bits = nullptr;     // per difference chunk: its extra bits, then its first one's bit
};

// --- small helpers ---------------------------------------------------------------------------

CIERA_HD inline void fail(DecodePlan* plan, uint32_t status, uint64_t a = 0, uint64_t b = 0) {
#if defined(__CUDA_ARCH__)
  if (atomicCAS(&plan->status, 0u, status) == 0u) {
    plan->detail[0] = a;
    plan->detail[1] = b;
  }
#else
  if (plan->status == kOk) {
    plan->status = status;
    plan->detail[0] = a;
    plan->detail[1] = b;
  }
#endif
}

CIERA_HD inline void atomic_max(uint32_t* at, uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicMax(at, v);
#else
  if (v > *at) *at = v;
#endif
}

CIERA_HD inline uint64_t rd64(const uint8_t* p) { return format::xxh3::read64(p); }
CIERA_HD inline uint32_t rd32(const uint8_t* p) { return format::xxh3::read32(p); }
CIERA_HD inline uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
CIERA_HD inline unsigned bit_width(uint32_t v) {
  unsigned w = 0;
  while (v >> w) ++w;
  return w;
}
// `bits` (<= 32) bits at bit `pos` of `data` (LSB first), reading only bytes below `size`.
CIERA_HD inline uint32_t read_bits(const uint8_t* data, uint64_t size, uint64_t pos, unsigned bits) {
  uint64_t word = 0;
  const uint64_t first = pos >> 3;
  for (unsigned b = 0; b < 5 && first + b < size; ++b) word |= uint64_t{data[first + b]} << (8 * b);
  return static_cast<uint32_t>((word >> (pos & 7)) & ((uint64_t{1} << bits) - 1));
}

// --- symbol streams --------------------------------------------------------------------------

// Parses the framing of the stream at payload offset `at` (at most `end`), of `symbols` symbols
// each at most `max_symbol`, into `sp`; returns the offset past it, or 0 after fail().
CIERA_HD inline uint64_t plan_stream(const uint8_t* p, uint64_t at, uint64_t end, uint64_t symbols,
                                     uint32_t max_symbol, uint32_t which, StreamPlan* sp,
                                     DecodePlan* plan) {
  constexpr uint64_t kHeader = entropy::kStreamHeaderBytes;
  if (end - at < kHeader) return fail(plan, kStreamMalformed, which), 0;
  const uint32_t method = p[at];
  const uint32_t arg = p[at + entropy::kStreamArgumentAt];
  const uint64_t body = rd64(p + at + entropy::kStreamBodyBytesAt);
  if (body > end - at - kHeader) return fail(plan, kStreamMalformed, which), 0;
  sp->method = method;
  sp->symbols = symbols;
  sp->max_symbol = max_symbol;
  sp->body_at = at + kHeader;
  sp->body_bytes = body;
  if (symbols == 0 && !(method == kPackedStream && arg == 1))
    return fail(plan, kStreamMalformed, which), 0;
  if (method == kPackedStream) {
    if (arg < 1 || arg > 8 || body != (symbols * arg + 7) / 8) return fail(plan, kStreamMalformed, which), 0;
    sp->width = arg;
    const uint64_t used = symbols * arg;
    if (used % 8 != 0 && (p[sp->body_at + body - 1] >> (used % 8)) != 0) {
      return fail(plan, kStreamMalformed, which), 0;  // non-zero padding bits
    }
  } else if (method == kConstantStream) {
    if (body != 0 || arg > max_symbol) return fail(plan, kStreamMalformed, which), 0;
    sp->constant = arg;
  } else if (method == kRansStream) {
    if (arg != 0) return fail(plan, kStreamMalformed, which), 0;
    // Table: first, last, then LEB128 frequencies summing to kRansTotal.
    uint64_t q = sp->body_at;
    const uint64_t body_end = sp->body_at + body;
    if (body_end - q < 2) return fail(plan, kStreamMalformed, which), 0;
    const uint32_t first = p[q], last = p[q + 1];
    q += 2;
    if (first > last || last > max_symbol) return fail(plan, kStreamMalformed, which), 0;
    for (unsigned s = 0; s < 256; ++s) sp->freq[s] = 0;
    uint32_t sum = 0;
    for (uint32_t s = first; s <= last; ++s) {
      uint64_t f = 0;
      for (unsigned shift = 0;; shift += 7) {
        if (q >= body_end || shift > 7) return fail(plan, kStreamMalformed, which), 0;
        const uint8_t byte = p[q++];
        f |= uint64_t{byte & 0x7Fu} << shift;
        if (byte == 0 && shift > 0) return fail(plan, kStreamMalformed, which), 0;  // not shortest
        if ((byte & 0x80) == 0) break;
      }
      if (f > entropy::kRansTotal || sum + f > entropy::kRansTotal) return fail(plan, kStreamMalformed, which), 0;
      sp->freq[s] = static_cast<uint16_t>(f);
      sum += static_cast<uint32_t>(f);
    }
    if (sum != entropy::kRansTotal) return fail(plan, kStreamMalformed, which), 0;
    // Canonical: the table spans exactly the symbols that occur, at least two (else constant).
    if (first == last || sp->freq[first] == 0 || sp->freq[last] == 0) {
      return fail(plan, kStreamMalformed, which), 0;
    }
    uint32_t cumulative = 0;
    for (unsigned s = 0; s < 256; ++s) {
      sp->start[s] = static_cast<uint16_t>(cumulative);
      cumulative += sp->freq[s];
    }
    sp->segments = entropy::rans_segment_count(symbols);
    const uint64_t lengths = 4 * (sp->segments - 1);
    if (body_end - q < lengths) return fail(plan, kStreamMalformed, which), 0;
    sp->body_at = q + lengths;
    sp->body_bytes = body_end - sp->body_at;
  } else {
    return fail(plan, kStreamMalformed, which), 0;
  }
  return at + kHeader + body;
}

// The end of the symbol stream at `at`, its header read for the body's length alone; 0 (the plan
// failed, naming stream `which`) where it does not fit before `end`.
CIERA_HD inline uint64_t skip_stream(const uint8_t* p, uint64_t at, uint64_t end, uint32_t which,
                                     DecodePlan* plan) {
  constexpr uint64_t kHeader = entropy::kStreamHeaderBytes;
  if (end - at < kHeader) return fail(plan, kStreamMalformed, which), 0;
  const uint64_t body = rd64(p + at + entropy::kStreamBodyBytesAt);
  if (body > end - at - kHeader) return fail(plan, kStreamMalformed, which), 0;
  return at + kHeader + body;
}

// Validates a rANS stream's segment lengths and writes each segment's offset from the first
// (and the end) to `offsets`; `lengths_at` is where the lengths begin.
CIERA_HD inline bool plan_segments(const uint8_t* p, const StreamPlan& sp, uint64_t* offsets,
                                   uint32_t which, DecodePlan* plan) {
  const uint8_t* lengths = p + sp.body_at - 4 * (sp.segments - 1);
  uint64_t at = 0;
  offsets[0] = 0;
  for (uint64_t j = 0; j + 1 < sp.segments; ++j) {
    const uint32_t length = rd32(lengths + 4 * j);
    if (length < entropy::kRansStateBytes || length > sp.body_bytes - at) {
      fail(plan, kStreamMalformed, which);
      return false;
    }
    at += length;
    offsets[j + 1] = at;
  }
  if (sp.body_bytes - at < entropy::kRansStateBytes) {
    fail(plan, kStreamMalformed, which);
    return false;
  }
  offsets[sp.segments] = sp.body_bytes;
  return true;
}

CIERA_HD inline void fill_slot(const StreamPlan& sp, uint32_t* slots, uint32_t slot) {
  // The symbol whose range holds `slot` (linear: at most 256 symbols, once per frame).
  for (unsigned s = 0; s < 256; ++s) {
    if (sp.freq[s] != 0 && slot >= sp.start[s] && slot < uint32_t{sp.start[s]} + sp.freq[s]) {
      slots[slot] = entropy::rans_slot_entry(s, sp.freq[s], sp.start[s]);
      return;
    }
  }
}

// One stream read symbol by symbol in one thread (the small fine-mode streams).
struct SequentialStream {
  const StreamPlan* plan = nullptr;  // in device (global) memory: kept off the thread's stack
  const uint8_t* body = nullptr;
  const uint32_t* slots = nullptr;
  uint64_t read = 0;
  uint32_t max_read = 0;
  uint32_t min_read = 0xFF;  // a packed stream of one distinct symbol is not canonical
  // rANS
  uint64_t segment = 0;
  uint64_t local = 0;
  const uint8_t* in = nullptr;
  const uint8_t* end = nullptr;
  uint32_t x[entropy::kRansStates] = {};
};

CIERA_HD inline bool rans_open_segment(SequentialStream& s) {
  const StreamPlan& sp = *s.plan;
  const uint8_t* lengths = s.body - 4 * (sp.segments - 1);
  uint64_t begin = 0;
  for (uint64_t j = 0; j < s.segment; ++j) begin += rd32(lengths + 4 * j);
  const uint64_t length = s.segment + 1 < sp.segments ? rd32(lengths + 4 * s.segment)
                                                       : sp.body_bytes - begin;
  if (length < entropy::kRansStateBytes) return false;
  s.in = s.body + begin;
  s.end = s.in + length;
  for (unsigned j = 0; j < entropy::kRansStates; ++j) {
    s.x[j] = rd32(s.in + 4 * j);
    if (s.x[j] < entropy::kRansLowerBound || s.x[j] >= (uint32_t{1} << 31)) return false;
  }
  s.in += entropy::kRansStateBytes;
  s.local = 0;
  return true;
}

CIERA_HD inline bool rans_close_segment(const SequentialStream& s) {
  if (s.in != s.end) return false;
  for (unsigned j = 0; j < entropy::kRansStates; ++j) {
    if (s.x[j] != entropy::kRansLowerBound) return false;
  }
  return true;
}

// Opens `sp` (planned) for sequential reading; `slots` holds kRansTotal entries of scratch.
CIERA_HD inline bool open_sequential(SequentialStream& s, const uint8_t* payload,
                                     const StreamPlan& sp, uint32_t* slots) {
  s.plan = &sp;
  s.body = payload + sp.body_at;
  s.slots = slots;
  s.read = 0;
  s.max_read = 0;
  s.min_read = 0xFF;
  if (sp.method == kRansStream) {
    for (unsigned sym = 0; sym < 256; ++sym) {
      for (uint32_t slot = sp.start[sym]; slot < uint32_t{sp.start[sym]} + sp.freq[sym]; ++slot) {
        slots[slot] = entropy::rans_slot_entry(sym, sp.freq[sym], sp.start[sym]);
      }
    }
    // Lengths are checked as segments open: each within the body, each at least its states.
    const uint8_t* lengths = s.body - 4 * (sp.segments - 1);
    uint64_t total = 0;
    for (uint64_t j = 0; j + 1 < sp.segments; ++j) {
      const uint32_t length = rd32(lengths + 4 * j);
      if (length < entropy::kRansStateBytes || length > sp.body_bytes - total) return false;
      total += length;
    }
    if (sp.body_bytes - total < entropy::kRansStateBytes) return false;
    s.segment = 0;
    return rans_open_segment(s);
  }
  return true;
}

// The next symbol into *symbol; false when the stream is malformed.
CIERA_HD inline bool next_symbol(SequentialStream& s, uint32_t* symbol) {
  const StreamPlan& sp = *s.plan;
  if (s.read >= sp.symbols) return false;
  uint32_t v = 0;
  if (sp.method == kPackedStream) {
    v = read_bits(s.body, sp.body_bytes, s.read * sp.width, sp.width);
  } else if (sp.method == kConstantStream) {
    v = sp.constant;
  } else {
    if (s.local == entropy::kRansSegmentSymbols) {
      if (!rans_close_segment(s)) return false;
      ++s.segment;
      if (!rans_open_segment(s)) return false;
    }
    uint32_t& x = s.x[s.local % entropy::kRansStates];
    const uint32_t slot = x & (entropy::kRansTotal - 1);
    const uint32_t entry = s.slots[slot];
    x = (((entry >> 8) & 0xFFF) + 1) * (x >> entropy::kRansScaleBits) + slot - (entry >> 20);
    v = entry & 0xFF;
    if (x < entropy::kRansLowerBound) {
      if (s.end - s.in < 2) return false;
      x = (x << 16) | rd16(s.in);
      s.in += 2;
    }
    ++s.local;
  }
  if (v > sp.max_symbol) return false;
  if (v > s.max_read) s.max_read = v;
  if (v < s.min_read) s.min_read = v;
  ++s.read;
  *symbol = v;
  return true;
}

CIERA_HD inline bool finish_sequential(const SequentialStream& s) {
  const StreamPlan& sp = *s.plan;
  if (s.read != sp.symbols) return false;
  if (sp.method == kPackedStream && sp.symbols > 0) {
    const unsigned w = bit_width(s.max_read);
    if (sp.width != (w < 1 ? 1 : w) || s.min_read == s.max_read) return false;
  }
  if (sp.method == kRansStream) return rans_close_segment(s);
  return true;
}

// --- the steps -------------------------------------------------------------------------------

// plan: 1 thread.
CIERA_HD inline void plan_frame(const Buffers& b, const DecodeConfig& c) {
  DecodePlan* plan = b.plan;
  *plan = DecodePlan{};
  const uint8_t* p = b.payload;
  const uint64_t size = b.payload_bytes;
  namespace field = wire::field;
  if (size < wire::kHeaderBytes) return fail(plan, kTruncated);
  if (rd32(p + field::kMagic) != wire::kMagic) return fail(plan, kBadMagic);
  if (p[field::kVersion] != wire::kVersion) return fail(plan, kBadVersion, p[field::kVersion]);
  if (rd32(p + field::kHeaderChecksum) !=
      static_cast<uint32_t>(format::xxh3::hash64(p, field::kHeaderChecksum, b.secret))) {
    return fail(plan, kHeaderChecksum);
  }
  if (rd16(p + field::kReserved16) != 0 || rd32(p + field::kReserved32) != 0) {
    return fail(plan, kReservedNonZero);
  }
  const uint32_t dtype = p[field::kDtype], kind = p[field::kKind], section = p[field::kSection];
  if (dtype < kBf16Code || dtype > kFp32Code) return fail(plan, kBadCode, field::kDtype, dtype);
  if (kind < kKeyFrame || kind > kValueDeltaFrame) return fail(plan, kBadCode, field::kKind, kind);
  if (section > kDifferencesSection) return fail(plan, kBadCode, field::kSection, section);
  const bool key = kind == kKeyFrame;
  const bool differences = kind == kValueDeltaFrame;
  // Key frames: full; exponent-delta frames: unchanged, block or fine; value-delta frames:
  // unchanged or differences.
  const bool paired = key ? section == kFullSection
                      : differences
                          ? (section == kUnchangedSection || section == kDifferencesSection)
                          : (section >= kUnchangedSection && section <= kFineSection);
  if (!paired) return fail(plan, kKindSectionMismatch);
  const uint16_t flags = rd16(p + field::kFlags);
  if ((flags & ~uint32_t{wire::kFlagContentChecksum}) != 0) return fail(plan, kBadFlags, flags);
  const uint32_t block_values = rd32(p + field::kBlockValues);
  if (block_values < CodecConfig::kMinBlockValues || block_values > CodecConfig::kMaxBlockValues) {
    return fail(plan, kBadBlockSize, block_values);
  }
  const uint64_t n = rd64(p + field::kNumValues);
  plan->kind = kind;
  plan->section = section;
  plan->epoch = rd32(p + field::kEpoch);
  const uint32_t stream = rd32(p + field::kStream);
  plan->sequence = rd64(p + field::kSequence);
  const uint64_t bitmap_bytes = rd64(p + field::kBitmapBytes);
  const uint64_t sm_bytes = rd64(p + field::kSignMantissaBytes);
  plan->exponent_bytes = rd64(p + field::kExponentBytes);
  plan->content_checksum = rd64(p + field::kContentChecksum);
  plan->has_checksum = (flags & wire::kFlagContentChecksum) != 0;
  if (!plan->has_checksum && plan->content_checksum != 0) return fail(plan, kChecksumWithoutFlag);
  // Section lengths, one at a time against what is there (format "Header").
  uint64_t left = size - wire::kHeaderBytes;
  if (bitmap_bytes > left) return fail(plan, kTruncated);
  left -= bitmap_bytes;
  const uint64_t bitmap_end = wire::kHeaderBytes + bitmap_bytes;
  const uint64_t sm_at = wire::sign_mantissa_offset(bitmap_bytes, sm_bytes);
  if (sm_at - bitmap_end > left) return fail(plan, kTruncated);
  left -= sm_at - bitmap_end;
  if (sm_bytes > left) return fail(plan, kTruncated);
  left -= sm_bytes;
  if (plan->exponent_bytes > left) return fail(plan, kTruncated);
  left -= plan->exponent_bytes;
  if (left != 0) return fail(plan, kTrailingBytes, left);
  for (uint64_t at = bitmap_end; at < sm_at; ++at) {
    if (p[at] != 0) return fail(plan, kPaddingNonZero, at);
  }
  // Against this decoder's configuration.
  if (dtype != c.dtype) return fail(plan, kConfigMismatch, field::kDtype, dtype);
  if (block_values != c.block_values)
    return fail(plan, kConfigMismatch, field::kBlockValues, block_values);
  if (n != c.num_values) return fail(plan, kConfigMismatch, field::kNumValues, n);
  if (c.value_delta ? kind == kExponentDeltaFrame : differences)
    return fail(plan, kWrongStreamKind, kind);
  if (sm_bytes != (differences ? 0 : c.sign_mantissa_bytes)) {
    return fail(plan, kConfigMismatch, field::kSignMantissaBytes, sm_bytes);
  }
  if (bitmap_bytes != (kind == kExponentDeltaFrame ? c.bitmap_bytes : 0)) {
    return fail(plan, kConfigMismatch, field::kBitmapBytes, bitmap_bytes);
  }
  if (c.require_checksum && !plan->has_checksum) return fail(plan, kChecksumRequired);
  // The stream position (docs/format.md, "Streams").
  const DecodeState& st = *b.state;
  if (stream != st.stream) return fail(plan, kMisrouted, stream);
  if (!key && !st.has_cache) return fail(plan, kNoCache);
  uint32_t ahead = 0;
  switch (stream_position(plan->epoch, plan->sequence, st.epoch, st.last_sequence,
                          st.decoded_any != 0, key, st.resync_requested != 0, ahead)) {
    case StreamPosition::kNext:
    case StreamPosition::kResync:
      break;
    case StreamPosition::kStale:
      return fail(plan, kOutOfSequence, plan->epoch, plan->sequence);
    case StreamPosition::kUnrequested:
      return fail(plan, kUnrequestedEpoch, plan->epoch);
    case StreamPosition::kTooFarAhead:
      return fail(plan, kTooFarAhead, ahead);
  }
  plan->sign_mantissa_at = sm_at;
  plan->section_at = sm_at + sm_bytes;
  const uint8_t padding = format::bits::fp16_high3_padding_mask(n);
  if (c.dtype == kFp16Code && !differences && padding != 0 &&
      (p[sm_at + sm_bytes - 1] & padding) != 0) {
    return fail(plan, kSignMantissaPadding);
  }
  // The bitmap: each changed block's place in `decoded`.
  uint64_t symbols = 0;
  uint64_t changed = 0;
  if (key) {
    symbols = n;
  } else if (differences) {
    symbols = (n + kGroupValues - 1) / kGroupValues;  // the groups stream
  } else {
    for (uint64_t byte = 0; byte < bitmap_bytes; ++byte) {
      const uint8_t bits = p[wire::kHeaderBytes + byte];
      for (unsigned k = 0; k < 8; ++k) {
        const uint64_t block = 8 * byte + k;
        const bool set = (bits >> k) & 1u;
        if (block >= c.blocks) {
          if (set) return fail(plan, kBitmapPastEnd);
          continue;
        }
        if (set) {
          b.block_offset[block] = symbols;
          const uint64_t first = block * c.block_values;
          symbols += (n - first < c.block_values) ? n - first : c.block_values;
          ++changed;
        } else {
          b.block_offset[block] = kNotChanged;
        }
      }
    }
  }
  plan->changed_blocks = changed;
  plan->block_symbols = symbols;
  if (section == kUnchangedSection && changed != 0) return fail(plan, kSectionBitmapMismatch);
  if ((section == kBlockSection || section == kFineSection) && changed == 0)
    return fail(plan, kSectionBitmapMismatch);
  if (section == kUnchangedSection && plan->exponent_bytes != 0)
    return fail(plan, kTrailingBytes, plan->exponent_bytes);
  if (section == kFullSection || section == kBlockSection) {
    const uint64_t end = plan->section_at + plan->exponent_bytes;
    const uint32_t max_exponent = (1u << c.exponent_bits) - 1;
    const uint64_t past = plan_stream(p, plan->section_at, end, symbols, max_exponent, 0, &plan->exps, plan);
    if (past == 0) return;
    if (past != end) return fail(plan, kTrailingBytes, end - past);
    if (plan->exps.method == kRansStream &&
        !plan_segments(p, plan->exps, b.segment_offsets, 0, plan))
      return;
  }
  if (section == kDifferencesSection) {
    // The groups stream; the escapes stream and the extra bits follow it (difference_plan_step).
    const uint64_t end = plan->section_at + plan->exponent_bytes;
    const uint64_t past = plan_stream(p, plan->section_at, end, symbols, (1u << kGroupSymbolBits) - 1,
                                      kGroupStreamId, &plan->exps, plan);
    if (past == 0) return;
    plan->groups_end = past;
    if (plan->exps.method == kRansStream &&
        !plan_segments(p, plan->exps, b.segment_offsets, kGroupStreamId, plan))
      return;
  }
}

// Whether the frame's first stream (plan->exps) is decoded by the per-symbol and per-segment
// steps: the full or block exponent stream, or a value-delta frame's groups stream.
CIERA_HD inline bool exps_stream_used(const DecodePlan& plan) {
  return plan.section == kFullSection || plan.section == kBlockSection ||
         plan.section == kDifferencesSection;
}

// slots: one thread per slot (kRansTotal), when the full/block stream is rANS.
CIERA_HD inline void slots_step(const Buffers& b, uint32_t slot) {
  const DecodePlan& plan = *b.plan;
  if (plan.status != kOk || !exps_stream_used(plan) || plan.exps.method != kRansStream) return;
  fill_slot(plan.exps, b.slots, slot);
}

// symbols: packed/constant, one thread per symbol.
CIERA_HD inline void symbol_step(const Buffers& b, uint64_t i) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || !exps_stream_used(*plan)) return;
  const StreamPlan& sp = plan->exps;
  if (sp.method == kRansStream || i >= sp.symbols) return;
  uint32_t v = sp.constant;
  if (sp.method == kPackedStream) {
    v = read_bits(b.payload + sp.body_at, sp.body_bytes, i * sp.width, sp.width);
    if (v > sp.max_symbol)
      return fail(plan, kSymbolTooLarge,
                  plan->section == kDifferencesSection ? uint32_t{kGroupStreamId} : 0u, v);
    atomic_max(&plan->max_packed, v);
    if (v != read_bits(b.payload + sp.body_at, sp.body_bytes, 0, sp.width)) {
      atomic_max(&plan->packed_varied, 1u);
    }
  }
  b.decoded[i] = static_cast<uint8_t>(v);
}

// symbols: rANS, one thread per segment.
CIERA_HD inline void segment_step(const Buffers& b, uint64_t j) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || !exps_stream_used(*plan)) return;
  const StreamPlan& sp = plan->exps;
  if (sp.method != kRansStream || j >= sp.segments) return;
  const uint64_t first = j * entropy::kRansSegmentSymbols;
  const uint64_t count = sp.symbols - first < entropy::kRansSegmentSymbols ? sp.symbols - first
                                                                          : entropy::kRansSegmentSymbols;
  const uint64_t begin = b.segment_offsets[j];
  if (!entropy::rans_decode_segment(b.slots, b.payload + sp.body_at + begin,
                                    b.segment_offsets[j + 1] - begin, count, b.decoded + first)) {
    return fail(plan, kStreamMalformed,
                plan->section == kDifferencesSection ? uint32_t{kGroupStreamId} : 0u);
  }
  // A rANS symbol above the largest allowed can only come from a table entry the table check
  // already bounded (last <= max_symbol).
}

// expand: fine frames, one thread per value: a changed block's cached exponents into `decoded`.
CIERA_HD inline void expand_step(const Buffers& b, const DecodeConfig& c, uint64_t i) {
  const DecodePlan& plan = *b.plan;
  if (plan.status != kOk || plan.section != kFineSection || i >= c.num_values) return;
  const uint64_t block = i / c.block_values;
  const uint64_t offset = b.block_offset[block];
  if (offset != kNotChanged) b.decoded[offset + (i - block * c.block_values)] = b.cache[i];
}

// fine: 1 thread: the fine section's change lists applied to `decoded` (docs/format.md,
// "Exponent section", fine). Mirrors the CPU decoder's decode_fine check for check.
CIERA_HD inline void fine_step(const Buffers& b, const DecodeConfig& c) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || plan->section != kFineSection) return;
  const uint8_t* p = b.payload;
  const uint64_t end = plan->section_at + plan->exponent_bytes;
  const uint64_t blocks = plan->changed_blocks;
  const uint8_t mask = static_cast<uint8_t>((1u << c.exponent_bits) - 1);
  // Counts stream first; its symbols' extra bits come first in the extra section.
  StreamPlan& counts_plan = plan->fine[0];
  StreamPlan& changes_plan = plan->fine[1];
  StreamPlan& escapes_plan = plan->fine[2];
  uint64_t at = plan_stream(p, plan->section_at, end, blocks, wire::kMaxBucket, 1, &counts_plan, plan);
  if (at == 0) return;
  // The changes and escapes streams' symbol counts depend on the counts: plan them after.
  const uint64_t changes_at = at;
  at = skip_stream(p, at, end, 2, plan);
  if (at == 0) return;
  const uint64_t escapes_at = at;
  at = skip_stream(p, at, end, 3, plan);
  if (at == 0) return;
  if (end - at < 8) return fail(plan, kStreamMalformed, 3);
  const uint64_t extra_bytes = rd64(p + at);
  at += 8;
  if (extra_bytes > end - at) return fail(plan, kFineExtraBits);
  const uint8_t* extra = p + at;
  if (end - at != extra_bytes) return fail(plan, kTrailingBytes, end - at - extra_bytes);
  uint64_t bit = 0;
  const uint64_t extra_bits = 8 * extra_bytes;

  SequentialStream counts;
  if (!open_sequential(counts, p, counts_plan, b.fine_slots)) return fail(plan, kStreamMalformed, 1);
  // Pass 1: the counts (validated against each changed block's length) and their total.
  uint64_t total = 0;
  {
    uint64_t k = 0;
    for (uint64_t block = 0; block < c.blocks && k < blocks; ++block) {
      if (b.block_offset[block] == kNotChanged) continue;
      uint32_t bucket;
      if (!next_symbol(counts, &bucket)) return fail(plan, kStreamMalformed, 1);
      const unsigned eb = wire::bucket_extra_bits(bucket);
      if (extra_bits - bit < eb) return fail(plan, kFineExtraBits);
      const uint32_t m = wire::bucket_base(bucket) + read_bits(extra, extra_bytes, bit, eb) + 1;
      bit += eb;
      const uint64_t first = block * c.block_values;
      const uint64_t length = c.num_values - first < c.block_values ? c.num_values - first : c.block_values;
      if (m > length) return fail(plan, kFineCountTooLarge, block, m);
      total += m;
      ++k;
    }
    if (!finish_sequential(counts)) return fail(plan, kStreamMalformed, 1);
  }
  if (plan_stream(p, changes_at, escapes_at, total, wire::kMaxChangeSymbol, 2, &changes_plan, plan) == 0) return;
  // The escapes count is the changes of class 2: count them in a first read of the changes.
  uint64_t escapes = 0;
  {
    SequentialStream changes;
    if (!open_sequential(changes, p, changes_plan, b.fine_slots + entropy::kRansTotal)) {
      return fail(plan, kStreamMalformed, 2);
    }
    for (uint64_t i = 0; i < total; ++i) {
      uint32_t s;
      if (!next_symbol(changes, &s)) return fail(plan, kStreamMalformed, 2);
      escapes += s % 3 == 2;
    }
    if (!finish_sequential(changes)) return fail(plan, kStreamMalformed, 2);
  }
  if (plan_stream(p, escapes_at, at - 8, escapes, mask, 3, &escapes_plan, plan) == 0) return;
  // Pass 2: counts again (their extra bits are known good), changes and escapes, applied.
  SequentialStream counts2, changes, escape_stream;
  open_sequential(counts2, p, counts_plan, b.fine_slots);
  open_sequential(changes, p, changes_plan, b.fine_slots + entropy::kRansTotal);
  if (!open_sequential(escape_stream, p, escapes_plan, b.fine_slots + 2 * entropy::kRansTotal)) {
    return fail(plan, kStreamMalformed, 3);
  }
  uint64_t count_bit = 0;
  uint64_t k = 0;
  for (uint64_t block = 0; block < c.blocks && k < blocks; ++block) {
    const uint64_t offset = b.block_offset[block];
    if (offset == kNotChanged) continue;
    ++k;
    uint32_t bucket;
    next_symbol(counts2, &bucket);
    const unsigned eb = wire::bucket_extra_bits(bucket);
    const uint32_t m = wire::bucket_base(bucket) + read_bits(extra, extra_bytes, count_bit, eb) + 1;
    count_bit += eb;
    const uint64_t first = block * c.block_values;
    const uint64_t length = c.num_values - first < c.block_values ? c.num_values - first : c.block_values;
    int64_t position = -1;
    for (uint32_t j = 0; j < m; ++j) {
      uint32_t symbol;
      if (!next_symbol(changes, &symbol)) return fail(plan, kStreamMalformed, 2);
      const unsigned gap_bucket = symbol / 3;
      const unsigned geb = wire::bucket_extra_bits(gap_bucket);
      if (extra_bits - bit < geb) return fail(plan, kFineExtraBits);
      const uint32_t gap = wire::bucket_base(gap_bucket) + read_bits(extra, extra_bytes, bit, geb);
      bit += geb;
      position += 1 + static_cast<int64_t>(gap);
      if (position >= static_cast<int64_t>(length)) return fail(plan, kFinePastBlock, block);
      uint8_t step = 1;
      if (symbol % 3 == 1) {
        step = mask;
      } else if (symbol % 3 == 2) {
        uint32_t escaped;
        if (!next_symbol(escape_stream, &escaped)) return fail(plan, kStreamMalformed, 3);
        if (escaped == 0 || escaped == 1 || escaped == mask) return fail(plan, kFineBadEscape, escaped);
        step = static_cast<uint8_t>(escaped);
      }
      uint8_t& e = b.decoded[offset + static_cast<uint64_t>(position)];
      e = static_cast<uint8_t>((e + step) & mask);
    }
  }
  if (!finish_sequential(escape_stream) || !finish_sequential(changes)) {
    return fail(plan, kStreamMalformed, 3);
  }
  // Every extra bit used, and the last byte's padding zero.
  if ((bit + 7) / 8 != extra_bytes) return fail(plan, kFineExtraBits);
  if ((bit & 7) != 0 && (extra[bit >> 3] >> (bit & 7)) != 0) return fail(plan, kFineExtraBits);
}

// finish: 1 thread: the packed stream's width is the narrowest that holds its symbols, and it
// holds two distinct symbols at least (one is a constant stream).
CIERA_HD inline void finish_step(const Buffers& b) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || !exps_stream_used(*plan)) return;
  if (plan->exps.method == kPackedStream && plan->exps.symbols > 0) {
    const unsigned w = bit_width(plan->max_packed);
    if (plan->exps.width != (w < 1 ? 1 : w) || plan->packed_varied == 0) {
      fail(plan, kStreamMalformed,
           plan->section == kDifferencesSection ? uint32_t{kGroupStreamId} : 0u);
    }
  }
}


// blocks: block frames, one thread per block: a block the bitmap marks changes an exponent
// (canonical form: a block whose exponents equal the cached ones has its bit 0). Mirrors the CPU
// decoder's check in its block branch.
CIERA_HD inline void block_changed_step(const Buffers& b, const DecodeConfig& c, uint64_t block) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || plan->section != kBlockSection) return;
  const uint64_t first = block * c.block_values;
  if (first >= c.num_values || b.block_offset[block] == kNotChanged) return;
  const uint64_t offset = b.block_offset[block];
  const uint64_t length =
      c.num_values - first < c.block_values ? c.num_values - first : c.block_values;
  for (uint64_t k = 0; k < length; ++k) {
    if (b.decoded[offset + k] != b.cache[first + k]) return;
  }
  fail(plan, kBlockUnchanged, block);
}

// --- value-delta frames (docs/format.md, "Value-delta frames") -----------------------------------
// Each step does nothing unless the frame is a value-delta frame with a 'differences' section
// (or, the last ones, 'unchanged') that nothing has refused yet.

// Groups per chunk of the escape and extra-bit prefix sums and of the reconstruction.
inline constexpr uint64_t kDifferenceChunkGroups = 256;

CIERA_HD inline uint64_t difference_group_chunks(uint64_t n) {
  const uint64_t groups = (n + kGroupValues - 1) / kGroupValues;
  return (groups + kDifferenceChunkGroups - 1) / kDifferenceChunkGroups;
}

CIERA_HD inline bool differences_pending(const DecodePlan& plan) {
  return plan.status == kOk && plan.kind == kValueDeltaFrame && plan.section == kDifferencesSection;
}

// Escaped values of a group symbol: the set bits of (s & s >> 1) & 0x15.
CIERA_HD inline unsigned escapes_in_group(uint32_t s) {
  const uint32_t e = (s & (s >> 1)) & 0x15u;
  return (e & 1u) + ((e >> 2) & 1u) + (e >> 4);
}

// One thread per chunk of groups: its escapes.
CIERA_HD inline void difference_count_step(const Buffers& b, const DecodeConfig& c, uint64_t k) {
  if (!differences_pending(*b.plan)) return;
  const uint64_t groups = (c.num_values + kGroupValues - 1) / kGroupValues;
  const uint64_t first = k * kDifferenceChunkGroups;
  if (first >= groups) return;
  const uint64_t end = groups - first < kDifferenceChunkGroups ? groups : first + kDifferenceChunkGroups;
  uint64_t escapes = 0;
  for (uint64_t g = first; g < end; ++g) escapes += escapes_in_group(b.decoded[g]);
  b.chunk_escapes[k] = escapes;
}

// 1 thread: no class past the last value; each chunk's first escape; the escapes stream's framing
// and the extra bits' length (it must be exactly what remains of the section).
CIERA_HD inline void difference_plan_step(const Buffers& b, const DecodeConfig& c) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan)) return;
  const uint64_t n = c.num_values;
  const uint64_t groups = (n + kGroupValues - 1) / kGroupValues;
  const uint64_t tail = groups * kGroupValues - n;
  if (tail != 0 && (b.decoded[groups - 1] >> (2 * (kGroupValues - tail))) != 0) {
    return fail(plan, kDifferenceClassPastEnd);
  }
  uint64_t escapes = 0;
  for (uint64_t k = 0, chunks = difference_group_chunks(n); k < chunks; ++k) {
    const uint64_t e = b.chunk_escapes[k];
    b.chunk_escapes[k] = escapes;
    escapes += e;
  }
  plan->escape_count = escapes;
  const uint8_t* p = b.payload;
  const uint64_t end = plan->section_at + plan->exponent_bytes;
  // A zigzagged difference is below 2^w; minus the escape class, its bucket is at most w.
  const uint64_t past = plan_stream(p, plan->groups_end, end, escapes, 8u * c.value_bytes,
                                    kDifferenceEscapeStreamId, &plan->escapes, plan);
  if (past == 0) return;
  if (plan->escapes.method == kRansStream &&
      !plan_segments(p, plan->escapes, b.escape_offsets, kDifferenceEscapeStreamId, plan)) {
    return;
  }
  if (end - past < 8) return fail(plan, kDifferenceExtraBits, 0, 0);
  plan->extra_bytes = rd64(p + past);
  plan->extra_at = past + 8;
  if (plan->extra_bytes != end - plan->extra_at) {
    return fail(plan, kDifferenceExtraBits, plan->extra_bytes, end - plan->extra_at);
  }
}

// The escapes stream as the other streams: its rANS table (one thread per slot), its symbols
// (packed or constant: one thread per symbol; rANS: one per segment), its packed width.
CIERA_HD inline void escape_slots_step(const Buffers& b, uint32_t slot) {
  const DecodePlan& plan = *b.plan;
  if (!differences_pending(plan) || plan.escapes.method != kRansStream) return;
  fill_slot(plan.escapes, b.fine_slots, slot);
}

CIERA_HD inline void escape_symbol_step(const Buffers& b, uint64_t i) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan)) return;
  const StreamPlan& sp = plan->escapes;
  if (sp.method == kRansStream || i >= sp.symbols) return;
  uint32_t v = sp.constant;
  if (sp.method == kPackedStream) {
    v = read_bits(b.payload + sp.body_at, sp.body_bytes, i * sp.width, sp.width);
    if (v > sp.max_symbol) return fail(plan, kSymbolTooLarge, kDifferenceEscapeStreamId, v);
    atomic_max(&plan->max_packed_escape, v);
    if (v != read_bits(b.payload + sp.body_at, sp.body_bytes, 0, sp.width)) {
      atomic_max(&plan->packed_escape_varied, 1u);
    }
  }
  b.escape_symbols[i] = static_cast<uint8_t>(v);
}

CIERA_HD inline void escape_segment_step(const Buffers& b, uint64_t j) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan)) return;
  const StreamPlan& sp = plan->escapes;
  if (sp.method != kRansStream || j >= sp.segments) return;
  const uint64_t first = j * entropy::kRansSegmentSymbols;
  const uint64_t count = sp.symbols - first < entropy::kRansSegmentSymbols ? sp.symbols - first
                                                                          : entropy::kRansSegmentSymbols;
  const uint64_t begin = b.escape_offsets[j];
  if (!entropy::rans_decode_segment(b.fine_slots, b.payload + sp.body_at + begin,
                                    b.escape_offsets[j + 1] - begin, count, b.escape_symbols + first)) {
    fail(plan, kStreamMalformed, kDifferenceEscapeStreamId);
  }
}

CIERA_HD inline void escape_finish_step(const Buffers& b) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan)) return;
  if (plan->escapes.method == kPackedStream && plan->escapes.symbols > 0) {
    const unsigned w = bit_width(plan->max_packed_escape);
    if (plan->escapes.width != (w < 1 ? 1 : w) || plan->packed_escape_varied == 0) {
      fail(plan, kStreamMalformed, kDifferenceEscapeStreamId);
    }
  }
}

// The escapes of chunk k: [chunk_escapes[k], its end).
CIERA_HD inline uint64_t chunk_escapes_end(const Buffers& b, const DecodeConfig& c, uint64_t k) {
  return k + 1 < difference_group_chunks(c.num_values) ? b.chunk_escapes[k + 1] : b.plan->escape_count;
}

// One thread per chunk: its escapes' extra bits.
CIERA_HD inline void difference_bits_step(const Buffers& b, const DecodeConfig& c, uint64_t k) {
  if (!differences_pending(*b.plan) || k >= difference_group_chunks(c.num_values)) return;
  uint64_t bits = 0;
  for (uint64_t e = b.chunk_escapes[k], end = chunk_escapes_end(b, c, k); e < end; ++e) {
    bits += escape_extra_bits(b.escape_symbols[e]);
  }
  b.chunk_bits[k] = bits;
}

// 1 thread: each chunk's first extra bit; L is the smallest length that holds them, and the
// padding bits are 0.
CIERA_HD inline void difference_extra_step(const Buffers& b, const DecodeConfig& c) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan)) return;
  uint64_t bits = 0;
  for (uint64_t k = 0, chunks = difference_group_chunks(c.num_values); k < chunks; ++k) {
    const uint64_t x = b.chunk_bits[k];
    b.chunk_bits[k] = bits;
    bits += x;
  }
  if (plan->extra_bytes != (bits + 7) / 8) return fail(plan, kDifferenceExtraBits, plan->extra_bytes, (bits + 7) / 8);
  if ((bits & 7) != 0 && (b.payload[plan->extra_at + bits / 8] >> (bits & 7)) != 0) {
    return fail(plan, kDifferenceExtraBits, plan->extra_bytes, (bits + 7) / 8);
  }
}

CIERA_HD inline uint32_t load_value(const uint8_t* values, uint8_t value_bytes, uint64_t i) {
  if (value_bytes == 2) return static_cast<uint32_t>(values[2 * i] | values[2 * i + 1] << 8);
  return rd32(values + 4 * i);
}

CIERA_HD inline void store_value(uint8_t* values, uint8_t value_bytes, uint64_t i, uint32_t v) {
  for (unsigned k = 0; k < value_bytes; ++k) values[value_bytes * i + k] = static_cast<uint8_t>(v >> (8 * k));
}

// One thread per chunk: its values, the cached ones moved on by their differences, into the
// output (the cache is untouched until commit).
CIERA_HD inline void difference_apply_step(const Buffers& b, const DecodeConfig& c, uint64_t k) {
  DecodePlan* plan = b.plan;
  if (!differences_pending(*plan) || k >= difference_group_chunks(c.num_values)) return;
  const uint64_t n = c.num_values;
  const uint64_t first = k * (kDifferenceChunkGroups * kGroupValues);
  constexpr uint64_t kChunkValues = kDifferenceChunkGroups * kGroupValues;
  const uint64_t end = n - first < kChunkValues ? n : first + kChunkValues;
  const uint8_t* extra = b.payload + plan->extra_at;
  const uint64_t max_z = c.value_bytes == 2 ? 0xFFFFu : 0xFFFFFFFFu;
  uint64_t e = b.chunk_escapes[k], bit = b.chunk_bits[k];
  bool changed = false;
  for (uint64_t i = first; i < end; ++i) {
    uint64_t z = (b.decoded[i / kGroupValues] >> (2 * (i % kGroupValues))) & 3u;
    if (z == kEscapeClass) {
      const unsigned bucket = b.escape_symbols[e++];
      const unsigned bits = escape_extra_bits(bucket);
      z = kEscapeClass + escape_base(bucket) + read_bits(extra, plan->extra_bytes, bit, bits);
      bit += bits;
      if (z > max_z) return fail(plan, kDifferenceEscapeTooLarge, z);
    }
    changed = changed || z != 0;
    const uint32_t before = load_value(b.values, c.value_bytes, i);
    uint32_t now;
    if (c.value_bytes == 2) {
      const auto o = to_ordered<uint16_t>(static_cast<uint16_t>(before));
      now = from_ordered<uint16_t>(static_cast<uint16_t>(o + unzigzag<uint16_t>(static_cast<uint16_t>(z))));
    } else {
      now = from_ordered<uint32_t>(to_ordered<uint32_t>(before) + unzigzag<uint32_t>(static_cast<uint32_t>(z)));
    }
    store_value(b.out, c.value_bytes, i, now);
  }
  if (changed) atomic_max(&plan->changed, 1u);
}

// An 'unchanged' value-delta frame: the cached values are the output (one thread per value).
CIERA_HD inline void difference_unchanged_step(const Buffers& b, const DecodeConfig& c, uint64_t i) {
  const DecodePlan& plan = *b.plan;
  if (plan.status != kOk || plan.kind != kValueDeltaFrame || plan.section != kUnchangedSection ||
      i >= c.num_values)
    return;
  for (unsigned k = 0; k < c.value_bytes; ++k) b.out[c.value_bytes * i + k] = b.values[c.value_bytes * i + k];
}

// 1 thread: a 'differences' section in which no value changed is not canonical ('unchanged' is).
CIERA_HD inline void difference_changed_step(const Buffers& b) {
  DecodePlan* plan = b.plan;
  if (differences_pending(*plan) && plan->changed == 0) fail(plan, kDifferenceNoChange);
}

// The exponent value i has after this frame.
CIERA_HD inline uint8_t new_exponent(const Buffers& b, const DecodeConfig& c, uint64_t i) {
  if (b.plan->section == kFullSection) return b.decoded[i];
  const uint64_t block = i / c.block_values;
  const uint64_t offset = b.block_offset[block];
  return offset == kNotChanged ? b.cache[i] : b.decoded[offset + (i - block * c.block_values)];
}

// merge: BF16/FP32 one thread per value, FP16 one per 8 values (3 bytes of the 3-bit plane).
CIERA_HD inline void merge_step(const Buffers& b, const DecodeConfig& c, uint64_t g) {
  if (b.plan->status != kOk || b.plan->kind == kValueDeltaFrame) return;
  format::bits::merge_group(c.dtype, [&](uint64_t i) { return new_exponent(b, c, i); },
                            b.payload + b.plan->sign_mantissa_at, c.num_values, g, b.out);
}

// digest: one thread per 16 KiB chunk of the output.
CIERA_HD inline void digest_step(const Buffers& b, const DecodeConfig& c, uint64_t chunk) {
  const DecodePlan& plan = *b.plan;
  const uint64_t bytes = c.num_values * c.value_bytes;
  if (plan.status != kOk || !plan.has_checksum || chunk * format::kChecksumChunkBytes >= bytes) return;
  const uint64_t first = chunk * format::kChecksumChunkBytes;
  const uint64_t length = bytes - first < format::kChecksumChunkBytes ? bytes - first : format::kChecksumChunkBytes;
  b.digests[chunk] = format::xxh3::hash64(b.out + first, length, b.secret);
}

// verify: 1 thread.
CIERA_HD inline void verify_step(const Buffers& b, const DecodeConfig& c) {
  DecodePlan* plan = b.plan;
  if (plan->status != kOk || !plan->has_checksum) return;
  const uint64_t bytes = c.num_values * c.value_bytes;
  const uint64_t chunks = (bytes + format::kChecksumChunkBytes - 1) / format::kChecksumChunkBytes;
  if (format::xxh3::combine_digests(b.digests, chunks, b.digest_bytes, b.secret) != plan->content_checksum) {
    fail(plan, kContentChecksum);
  }
}

// commit: one thread per value, only after verification.
CIERA_HD inline void commit_step(const Buffers& b, const DecodeConfig& c, uint64_t i) {
  const DecodePlan& plan = *b.plan;
  if (plan.status != kOk || i >= c.num_values || plan.section == kUnchangedSection) return;
  if (c.value_delta) {  // the previous values: the verified output (key or value-delta frame)
    for (unsigned k = 0; k < c.value_bytes; ++k) b.values[c.value_bytes * i + k] = b.out[c.value_bytes * i + k];
    return;
  }
  if (plan.section == kFullSection) {
    b.cache[i] = b.decoded[i];
    return;
  }
  const uint64_t block = i / c.block_values;
  const uint64_t offset = b.block_offset[block];
  if (offset != kNotChanged) b.cache[i] = b.decoded[offset + (i - block * c.block_values)];
}

// commit_state: 1 thread, after commit.
CIERA_HD inline void commit_state_step(const Buffers& b) {
  const DecodePlan& plan = *b.plan;
  if (plan.status != kOk) return;
  DecodeState& st = *b.state;
  st.has_cache = 1;
  st.epoch = plan.epoch;
  st.last_sequence = plan.sequence;
  st.decoded_any = 1;
  st.resync_requested = 0;
}

}  // namespace ciera::codec::device

namespace ciera::codec::device {

// Chunks of the content checksum over a shard of `bytes` bytes.
inline uint64_t checksum_chunks(uint64_t bytes) {
  return (bytes + format::kChecksumChunkBytes - 1) / format::kChecksumChunkBytes;
}

// Runs the steps in order. `launch(n, f)` runs f(i) for every i in [0, n): on the GPU one kernel
// per call (src/cuda/decoder.cu), in the host emulation a loop. `b` and `c` travel by value.
template <typename Launch>
void decode_frame(Launch&& launch, const Buffers& b, const DecodeConfig& c) {
  const uint64_t n = c.num_values;
  launch(1, [=] CIERA_HD(uint64_t) { plan_frame(b, c); });
  launch(entropy::kRansTotal, [=] CIERA_HD(uint64_t i) { slots_step(b, static_cast<uint32_t>(i)); });
  launch(n, [=] CIERA_HD(uint64_t i) { symbol_step(b, i); });
  launch(entropy::rans_segment_count(n), [=] CIERA_HD(uint64_t j) { segment_step(b, j); });
  if (!c.value_delta) {
    launch(n, [=] CIERA_HD(uint64_t i) { expand_step(b, c, i); });
    launch(1, [=] CIERA_HD(uint64_t) { fine_step(b, c); });
  }
  launch(1, [=] CIERA_HD(uint64_t) { finish_step(b); });
  if (!c.value_delta) {
    launch((n + c.block_values - 1) / c.block_values,
           [=] CIERA_HD(uint64_t k) { block_changed_step(b, c, k); });
  }
  if (c.value_delta) {
    const uint64_t chunks = difference_group_chunks(n);
    launch(chunks, [=] CIERA_HD(uint64_t k) { difference_count_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { difference_plan_step(b, c); });
    launch(entropy::kRansTotal, [=] CIERA_HD(uint64_t i) { escape_slots_step(b, static_cast<uint32_t>(i)); });
    launch(n, [=] CIERA_HD(uint64_t i) { escape_symbol_step(b, i); });
    launch(entropy::rans_segment_count(n), [=] CIERA_HD(uint64_t j) { escape_segment_step(b, j); });
    launch(1, [=] CIERA_HD(uint64_t) { escape_finish_step(b); });
    launch(chunks, [=] CIERA_HD(uint64_t k) { difference_bits_step(b, c, k); });
    launch(1, [=] CIERA_HD(uint64_t) { difference_extra_step(b, c); });
    launch(chunks, [=] CIERA_HD(uint64_t k) { difference_apply_step(b, c, k); });
    launch(n, [=] CIERA_HD(uint64_t i) { difference_unchanged_step(b, c, i); });
    launch(1, [=] CIERA_HD(uint64_t) { difference_changed_step(b); });
  }
  launch(format::bits::group_count(c.dtype, n), [=] CIERA_HD(uint64_t g) { merge_step(b, c, g); });
  launch(checksum_chunks(n * c.value_bytes), [=] CIERA_HD(uint64_t k) { digest_step(b, c, k); });
  launch(1, [=] CIERA_HD(uint64_t) { verify_step(b, c); });
  launch(n, [=] CIERA_HD(uint64_t i) { commit_step(b, c, i); });
  launch(1, [=] CIERA_HD(uint64_t) { commit_state_step(b); });
}

// The decoder's configuration as the steps see it. Throws ConfigError for an invalid one.
DecodeConfig make_decode_config(const CodecConfig& config, uint64_t num_values);

// One line naming why a frame was refused (the plan's status and details).
std::string describe_status(uint32_t status, uint64_t detail0, uint64_t detail1);

}  // namespace ciera::codec::device
