// Receiver side of the shard codec: exponent reuse (paper Algorithm 1, receiver half) and
// value-delta streams (docs/format.md, "Value-delta frames"), whose cache is the previous values.
//
// Order of work, so that a bad payload can never reach the cache (docs/format.md, "Integrity"):
//   1. validate the header against this decoder's configuration and sequence;
//   2. merge cached or decoded exponents with the sign-mantissa plane into the caller's buffer,
//      checksumming the values as they are produced;
//   3. compare with the content checksum;
//   4. only then update the exponent cache from the verified output. (Fine frames update the
//      cache during step 2, while its lines are hot, and revert exactly if step 3 fails.)
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/chunking.hpp"
#include "codec/differences.hpp"
#include "codec/kernels.hpp"
#include "codec/limits.hpp"
#include "codec/stream_position.hpp"
#include "codec/wire.hpp"
#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "common/huge_pages.hpp"
#include "common/moved_from.hpp"
#include "entropy/rans_core.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/content_checksum.hpp"
#include "format/planes.hpp"
#include "format/value_bits.hpp"

namespace ciera {
namespace {

std::string mismatch(const char* what, const std::string& payload, const std::string& decoder) {
  return std::string("payload ") + what + " is " + payload + " but this decoder expects " + decoder;
}

void skip_stream(ByteReader& reader) {
  reader.need(entropy::kStreamHeaderBytes);
  const uint64_t body = load_le64(reader.cursor() + entropy::kStreamBodyBytesAt);
  reader.take(entropy::kStreamHeaderBytes);
  reader.take(body);
}

}  // namespace

// The changes of a fine-coded frame, in value order: for each changed block (its count in
// changes_per_block), the positions of its changed values relative to the block's chunk
// (BlockGrid) and their exponent steps.
struct FineChanges {
  std::vector<uint16_t> positions;
  std::vector<uint8_t> steps;
  std::vector<uint8_t> symbols;  // scratch: one stream's symbols, decoded in one go
  std::vector<uint8_t> escape_steps;  // scratch
  std::vector<uint8_t> extra;         // scratch: the extra bits with slack
  std::vector<uint16_t> block_offset;  // scratch: each changed block's offset in its chunk
  uint64_t count = 0;
};

namespace {

// Decodes and validates a fine exponent section (docs/format.md, "Exponent section", fine).
// `changes` grows to the number of changed values, which the bitmap bounds by the shard size;
// `changes_per_block` holds one entry per block. Each stream is decoded whole into scratch
// first; the extra bits its symbols call for are then counted and checked against the extra
// section before any is read, so the loops that read them carry no bounds checks.
void decode_fine(const codec::CodecKernels& fine, const uint8_t* section, uint64_t size,
                 const BlockGrid& grid, const std::vector<uint32_t>& changed,
                 unsigned exponent_bits, uint16_t* changes_per_block, FineChanges& changes) {
  ByteReader in(section, size, "fine exponent section");
  entropy::SymbolStreamReader counts;
  counts.open(in, changed.size(), wire::kMaxBucket, "fine counts stream");
  const uint64_t changes_at = in.position();
  skip_stream(in);
  const uint64_t escapes_at = in.position();
  skip_stream(in);
  const uint64_t extra_bytes = in.u64();
  PaddedBitReader extra(in.take(extra_bytes), extra_bytes, changes.extra);
  if (in.remaining() != 0) {
    throw FormatError("fine exponent section has " + std::to_string(in.remaining()) +
                      " trailing bytes");
  }
  auto reserve_extra_bits = [&](uint64_t bits) {
    if (bits > extra.size_bits() - extra.position()) {
      throw FormatError("fine extra bits end early (" + std::to_string(extra_bytes) + " bytes)");
    }
  };
  auto read_bucketed = [&](unsigned bucket) {
    return wire::bucket_base(bucket) + extra.get(wire::bucket_extra_bits(bucket));
  };
  std::vector<uint8_t>& symbols = changes.symbols;

  // Counts first: the other streams' lengths depend on them. Their extra bits come first too.
  const size_t blocks = changed.size();
  if (symbols.size() < blocks) symbols.resize(blocks);
  counts.get(symbols.data(), blocks);
  counts.finish();
  uint64_t count_bits = 0;
  for (size_t i = 0; i < blocks; ++i) count_bits += wire::bucket_extra_bits(symbols[i]);
  reserve_extra_bits(count_bits);
  uint64_t total = 0;
  for (size_t i = 0; i < blocks; ++i) {
    const uint32_t m = read_bucketed(symbols[i]) + 1;
    if (m > grid.block_length(changed[i])) {
      throw FormatError("fine exponent section claims " + std::to_string(m) +
                        " changed values in block " + std::to_string(changed[i]) + " of " +
                        std::to_string(grid.block_length(changed[i])) + " values");
    }
    changes_per_block[i] = static_cast<uint16_t>(m);
    total += m;
  }
  if (changes.positions.size() < total) {
    changes.positions.resize(total);
    changes.steps.resize(total);
  }
  if (symbols.size() < total) symbols.resize(total);
  changes.count = total;

  ByteReader changes_in(section + changes_at, escapes_at - changes_at, "fine changes stream");
  entropy::SymbolStreamReader change_stream;
  change_stream.open(changes_in, total, wire::kMaxChangeSymbol, "fine changes stream");
  change_stream.get(symbols.data(), total);
  change_stream.finish();
  uint64_t gap_bits = 0;
  uint64_t escapes = 0;
  for (uint64_t c = 0; c < total; ++c) {
    gap_bits += wire::bucket_extra_bits(symbols[c] / wire::kStepClasses);
    escapes += symbols[c] % wire::kStepClasses == format::kStepEscape;
  }
  reserve_extra_bits(gap_bits);

  const uint8_t exponent_mask = static_cast<uint8_t>((1u << exponent_bits) - 1);
  std::vector<uint8_t>& escape_steps = changes.escape_steps;
  escape_steps.resize(escapes + 1);  // +1: data() stays a valid pointer when there are none
  ByteReader escapes_in(section + escapes_at, size - escapes_at, "fine escapes stream");
  entropy::SymbolStreamReader escape_stream;
  escape_stream.open(escapes_in, escapes, exponent_mask, "fine escapes stream");
  escape_stream.get(escape_steps.data(), escapes);
  escape_stream.finish();
  for (uint64_t e = 0; e < escapes; ++e) {
    const uint8_t step = escape_steps[e];
    if (step == 0 || step == 1 || step == exponent_mask) {
      throw FormatError("fine escapes stream holds step " + std::to_string(step) +
                        ", which has its own step class");
    }
  }

  // Positions and steps from the symbols and extra bits (the fine_positions kernel: 16 changes
  // per step where the target allows). The first change of each block carries a flag in its
  // symbol's top bit, which restarts the position. Positions are stored relative to the block's
  // chunk (BlockGrid), which is how the merge applies them.
  {
    std::vector<uint16_t>& block_offset = changes.block_offset;
    block_offset.resize(blocks + 3);  // [0] unused: state.block counts the flags; 2 readable past
    uint64_t c = 0;
    for (size_t i = 0; i < blocks; ++i) {
      symbols[c] = static_cast<uint8_t>(symbols[c] | 0x80);
      c += changes_per_block[i];
      block_offset[i + 1] = static_cast<uint16_t>(grid.block_first(changed[i]) % grid.chunk_values);
    }
    const PaddedBitReader gaps = extra;  // where the gap bits begin, for the error path below
    codec::FinePositionState state;
    state.bit = extra.position();
    state.escape = escape_steps.data();
    fine.fine_positions(symbols.data(), total, extra.data(), block_offset.data(),
                        grid.block_values, exponent_mask, state, changes.positions.data(),
                           changes.steps.data());
    extra.set_position(state.bit);
    // Every block but the last is whole; the last block's last position bounds its others.
    const bool last_block_overrun =
        blocks != 0 && state.local >= static_cast<int64_t>(grid.block_length(changed[blocks - 1]));
    if (state.bad || last_block_overrun) {
      // Find the block to name, block by block (this path only runs on a bad payload).
      PaddedBitReader again = gaps;
      for (size_t i = 0, k = 0; i < blocks; ++i) {
        int64_t at = -1;
        for (const uint64_t end = k + changes_per_block[i]; k < end; ++k) {
          const unsigned bucket = (symbols[k] & 0x7F) / wire::kStepClasses;
          at += 1 + wire::bucket_base(bucket) + again.get(wire::bucket_extra_bits(bucket));
          if (at >= static_cast<int64_t>(grid.block_length(changed[i]))) {
            throw FormatError("fine exponent section places a change past the end of block " +
                              std::to_string(changed[i]));
          }
        }
      }
      throw FormatError("fine exponent section places a change past the end of a block");
    }
  }
  if (!extra.exhausted_canonically()) {
    throw FormatError("fine extra bits are not fully used or have non-zero padding");
  }
}

}  // namespace

struct ShardDecoder::Impl {
  Impl(const CodecConfig& c, uint64_t n, StreamIdentity id, bool single)
      : one_shot(single),
        config(c.validated()),
        grid(n, c.block_values),
        layout(c.dtype, n),
        kernels(format::kernels()),
        fine_coding(codec::codec_kernels()),
        info(dtype_info(c.dtype)),
        stream_id(id.stream),
        epoch(id.epoch),
        value_delta(c.stream_kind == StreamKind::kValueDelta) {
    if (one_shot) {
      // Nothing is kept: the one frame is a key frame.
    } else if (value_delta) {
      values_cache.resize(n * info.value_bytes);
    } else {
      cache.resize(n);
    }
    chunk_exponents.resize(grid.chunk_values);
    chunk_output.resize(size_t{grid.chunk_values} * info.value_bytes);
    changed_blocks.reserve(grid.blocks);
    changes_per_block.resize(grid.blocks);
  }

  FrameStats decode(const uint8_t* payload, size_t size, uint8_t* out);
  FrameStats decode_differences(const wire::Header& h, const uint8_t* payload, uint8_t* out);
  // decode()'s parts. Opens the frame's exponent section `section` (the fine changes: decoded
  // whole, counted in `stats`), checking that nothing trails it.
  void open_exponent_section(const wire::Header& h, const uint8_t* section,
                             entropy::SymbolStreamReader& stream, FrameStats& stats);
  // A block frame's exponents of the chunk at `chunk_first` (`count` values) in chunk_exponents:
  // cached ones, then the changed blocks' (changed_blocks[next_changed...] that start in the
  // chunk, which it moves past) from `stream`, each of which must differ from the cache.
  const uint8_t* block_chunk_exponents(entropy::SymbolStreamReader& stream, uint64_t chunk_first,
                                       size_t count, size_t& next_changed);
  // After a frame's output `out` is verified: the exponents (or values) it changed into the cache.
  void cache_verified(const wire::Header& h, const uint8_t* out);
  void commit(const wire::Header& h);
  wire::Header check_header(const uint8_t* payload, size_t size) const;
  void check_stream(const wire::Header& h) const;
  void read_bitmap(const uint8_t* bitmap, const wire::Header& header);
  // Where apply_fine_changes has got to: changed blocks and changes applied so far.
  struct FineCursor {
    size_t block = 0;
    uint64_t change = 0;
  };
  // Applies the fine changes of the changed blocks in [chunk_first, chunk_first + count) to the
  // cache, just before the chunk is merged from it; `at` walks the changes across chunks.
  // revert_fine_changes undoes everything applied up to `at` exactly if the frame then fails
  // verification.
  void apply_fine_changes(uint64_t chunk_first, size_t count, FineCursor& at);
  void revert_fine_changes(const FineCursor& at);

  bool one_shot;  // one key frame, no cache kept (ShardDecoder::one_shot)
  CodecConfig config;
  BlockGrid grid;
  format::SignMantissaLayout layout;
  const format::PlaneKernels& kernels;
  const codec::CodecKernels& fine_coding;
  DTypeInfo info;

  std::vector<uint8_t, HugePageAllocator<uint8_t>> cache;  // ExpCache of Algorithm 1
  bool has_cache = false;
  // Where the stream stands (docs/format.md, "Streams"): its id, the epoch expected (or last
  // decoded), the last sequence number decoded in it (once `decoded_any`), and whether this
  // receiver asked for a resynchronisation that a later epoch's key frame may answer.
  uint32_t stream_id;
  uint32_t epoch;
  uint64_t last_sequence = 0;
  bool decoded_any = false;
  bool resync_requested = false;
  // A value-delta stream: the cache is the previous values (values_cache), not the exponents.
  bool value_delta;
  std::vector<uint8_t, HugePageAllocator<uint8_t>> values_cache;
  codec::DifferenceReader differences;

  // Scratch sized at construction from this decoder's own configuration, never from a payload.
  // Chunk scratch on cache lines: a chunk is merged into chunk_output and streamed out of it
  // with whole-line loads. From malloc (16-byte alignment) its place depended on what the
  // process had allocated before: `ciera bench codec` decoded 16M BF16 values at 10.6 or at
  // 6.8 GB/s depending on the length of the program's path (docs/benchmarks.md).
  std::vector<uint8_t, HugePageAllocator<uint8_t>> chunk_exponents;
  // A full exponent section is read kFullPiece symbols at a time where chunks tile that.
  static constexpr uint64_t kFullPiece = 2 * entropy::kRansSegmentSymbols;
  std::vector<uint8_t> full_piece;
  std::vector<uint8_t, HugePageAllocator<uint8_t>> chunk_output;  // assembled in L1 (streaming)
  std::vector<uint32_t> changed_blocks;
  std::vector<uint16_t> changes_per_block;
  FineChanges fine_changes;  // grows to the most changes seen, at most one per value
};

wire::Header ShardDecoder::Impl::check_header(const uint8_t* payload, size_t size) const {
  const wire::Header h = wire::read_header(payload, size);
  if (h.dtype != config.dtype) {
    throw FormatError(mismatch("dtype", std::string(dtype_name(h.dtype)),
                               std::string(dtype_name(config.dtype))));
  }
  if (h.block_values != grid.block_values) {
    throw FormatError(mismatch("block size", std::to_string(h.block_values),
                               std::to_string(grid.block_values)));
  }
  if (h.num_values != grid.num_values) {
    throw FormatError(mismatch("value count", std::to_string(h.num_values),
                               std::to_string(grid.num_values)));
  }
  if (value_delta ? h.kind == FrameKind::kDelta : h.kind == FrameKind::kValueDelta) {
    throw FormatError("payload is a" + std::string(value_delta ? "n exponent-" : " value-") +
                      "delta frame but this decoder receives a" +
                      (value_delta ? " value-delta" : "n exponent-reuse") + " stream");
  }
  const bool differences_frame = h.kind == FrameKind::kValueDelta;
  const uint64_t sign_mantissa_bytes = differences_frame ? 0 : layout.total_bytes();
  if (h.sign_mantissa_bytes != sign_mantissa_bytes) {
    throw FormatError(mismatch("sign-mantissa length", std::to_string(h.sign_mantissa_bytes),
                               std::to_string(sign_mantissa_bytes)));
  }
  const uint64_t bitmap_bytes =
      h.kind != FrameKind::kDelta ? 0 : wire::bitmap_bytes_for(grid.num_values, grid.block_values);
  if (h.bitmap_bytes != bitmap_bytes) {
    throw FormatError(mismatch("bitmap length", std::to_string(h.bitmap_bytes),
                               std::to_string(bitmap_bytes)));
  }
  if (config.content_checksum && !h.has_content_checksum()) {
    throw FormatError("payload carries no content checksum but this decoder requires one");
  }
  check_stream(h);
  return h;
}

// Accepts a frame only as the next one of this decoder's stream (docs/format.md, "Streams").
void ShardDecoder::Impl::check_stream(const wire::Header& h) const {
  // Worded only on failure: a steady-state decode builds no strings.
  const auto frame = [&h] {
    return std::string(frame_kind_name(h.kind)) + " frame (stream " + std::to_string(h.stream) +
           ", epoch " + std::to_string(h.epoch) + ", sequence " + std::to_string(h.sequence) + ")";
  };
  const auto position = [this] {
    return "stream " + std::to_string(stream_id) + " is at epoch " + std::to_string(epoch) +
           (decoded_any ? ", sequence " + std::to_string(last_sequence)
                        : std::string(", nothing decoded yet"));
  };
  if (h.stream != stream_id) {
    throw FormatError("misrouted payload: " + frame() + " but this decoder receives stream " +
                      std::to_string(stream_id));
  }
  if (one_shot && (decoded_any || h.kind != FrameKind::kKey)) {
    throw FormatError(frame() + " cannot be decoded: a one-shot decoder takes one key frame" +
                      (decoded_any ? std::string(" and has decoded it") : std::string()));
  }
  const bool key = h.kind != FrameKind::kDelta && h.kind != FrameKind::kValueDelta;
  if (!key && !has_cache) {
    throw FormatError(frame() + " cannot be decoded: this decoder holds no " +
                      (value_delta ? "previous values" : "exponent cache") +
                      " and needs a key frame");
  }
  uint32_t ahead = 0;
  switch (codec::stream_position(h.epoch, h.sequence, epoch, last_sequence, decoded_any, key,
                                 resync_requested, ahead)) {
    case codec::StreamPosition::kNext:
    case codec::StreamPosition::kResync:
      return;
    case codec::StreamPosition::kStale:
      throw FormatError("stale or out-of-sequence " + frame() + ": " + position());
    case codec::StreamPosition::kUnrequested:
      throw FormatError(frame() +
                        " starts a new epoch, but this receiver asked for no "
                        "resynchronisation (" +
                        position() + ")");
    case codec::StreamPosition::kTooFarAhead:
      throw FormatError(frame() + " is " + std::to_string(ahead) +
                        " epochs ahead: not a resynchronisation of this stream (" + position() +
                        ")");
  }
}

void ShardDecoder::Impl::read_bitmap(const uint8_t* bitmap, const wire::Header& h) {
  changed_blocks.clear();
  for (uint64_t byte = 0; byte < h.bitmap_bytes; ++byte) {
    uint32_t bits = bitmap[byte];
    while (bits != 0) {
      const uint64_t block = byte * 8 + static_cast<unsigned>(__builtin_ctz(bits));
      if (block >= grid.blocks) throw FormatError("bitmap marks a block past the end of the shard");
      changed_blocks.push_back(static_cast<uint32_t>(block));
      bits &= bits - 1;
    }
  }
  const bool none = changed_blocks.empty();
  if (h.section == ExponentSection::kUnchanged && !none) {
    throw FormatError("'unchanged' exponent section with changed blocks in the bitmap");
  }
  if ((h.section == ExponentSection::kBlock || h.section == ExponentSection::kFine) && none) {
    throw FormatError("'" + std::string(exponent_section_name(h.section)) +
                      "' exponent section with an empty bitmap");
  }
}

void ShardDecoder::Impl::apply_fine_changes(uint64_t chunk_first, size_t count, FineCursor& at) {
  const uint8_t mask = static_cast<uint8_t>((1u << info.exponent_bits) - 1);
  const uint64_t chunk_end = chunk_first + count;
  uint64_t end = at.change;
  for (; at.block < changed_blocks.size() && grid.block_first(changed_blocks[at.block]) < chunk_end;
       ++at.block) {
    end += changes_per_block[at.block];
  }
  const uint16_t* positions = fine_changes.positions.data();
  const uint8_t* steps = fine_changes.steps.data();
  uint8_t* exps = cache.data() + chunk_first;
  for (uint64_t c = at.change; c < end; ++c) {
    uint8_t& e = exps[positions[c]];
    e = static_cast<uint8_t>((e + steps[c]) & mask);
  }
  at.change = end;
}

void ShardDecoder::Impl::revert_fine_changes(const FineCursor& at) {
  const uint8_t mask = static_cast<uint8_t>((1u << info.exponent_bits) - 1);
  uint64_t c = 0;
  for (size_t i = 0; i < at.block; ++i) {
    const uint64_t first = grid.block_first(changed_blocks[i]);
    uint8_t* exps = cache.data() + (first - first % grid.chunk_values);
    for (const uint64_t end = c + changes_per_block[i]; c < end; ++c) {
      uint8_t& e = exps[fine_changes.positions[c]];
      e = static_cast<uint8_t>((e - fine_changes.steps[c]) & mask);
    }
  }
}

namespace {
[[noreturn]] void throw_checksum_mismatch() {
  throw FormatError(wire::content_checksum_mismatch("the previous values"));
}

// What a frame's statistics take from its header.
FrameStats header_stats(const wire::Header& h, uint64_t payload_bytes) {
  FrameStats stats;
  stats.kind = h.kind;
  stats.section = h.section;
  stats.stream = h.stream;
  stats.epoch = h.epoch;
  stats.sequence = h.sequence;
  stats.payload_bytes = payload_bytes;
  stats.bitmap_bytes = h.bitmap_bytes;
  stats.sign_mantissa_bytes = h.sign_mantissa_bytes;
  stats.exponent_bytes = h.exponent_bytes;
  return stats;
}
}  // namespace

// A value-delta frame: the previous values plus the differences (or the previous values
// unchanged), checksummed; a frame that fails leaves the cache as it was.
FrameStats ShardDecoder::Impl::decode_differences(const wire::Header& h, const uint8_t* payload,
                                                  uint8_t* out) {
  FrameStats stats = header_stats(h, h.payload_bytes());
  stats.blocks = grid.blocks;
  stats.changed_values_known = true;
  format::ContentChecksum checksum(kernels);
  format::ContentChecksum* sum = h.has_content_checksum() ? &checksum : nullptr;
  if (h.section == ExponentSection::kUnchanged) {
    if (h.exponent_bytes != 0) throw FormatError("'unchanged' difference section is not empty");
    if (!values_cache.empty()) std::memcpy(out, values_cache.data(), values_cache.size());
    if (sum) sum->update(out, values_cache.size());
  } else {
    // The cache moves on in the same pass; it is put back if the frame then fails.
    stats.changed_values = differences.read(config.dtype, payload + wire::kHeaderBytes,
                                            h.exponent_bytes, values_cache.data(),
                                            grid.num_values, out, sum);
    const bool canonical = stats.changed_values != 0;
    if (!canonical || (sum && checksum.digest() != h.content_checksum)) {
      differences.revert(config.dtype, values_cache.data(), grid.num_values);
      if (!canonical) {
        throw FormatError("'differences' section in which no value changed (canonical form: "
                          "'unchanged')");
      }
      throw_checksum_mismatch();
    }
    commit(h);
    return stats;
  }
  if (sum && checksum.digest() != h.content_checksum) throw_checksum_mismatch();
  commit(h);
  return stats;
}

void ShardDecoder::Impl::commit(const wire::Header& h) {
  has_cache = !one_shot;  // a one-shot decoder keeps nothing to decode a delta frame against
  epoch = h.epoch;
  last_sequence = h.sequence;
  decoded_any = true;
  resync_requested = false;
}

FrameStats ShardDecoder::Impl::decode(const uint8_t* payload, size_t size, uint8_t* out) {
  const wire::Header h = check_header(payload, size);
  if (h.kind == FrameKind::kValueDelta) return decode_differences(h, payload, out);
  const uint8_t* bitmap = payload + wire::kHeaderBytes;
  const uint8_t* sm_plane = payload + h.sign_mantissa_at();
  const uint8_t* section = sm_plane + h.sign_mantissa_bytes;
  const uint8_t padding = format::bits::fp16_high3_padding_mask(grid.num_values);
  if (config.dtype == DType::kFP16 && padding != 0 &&
      (sm_plane[layout.total_bytes() - 1] & padding) != 0) {
    throw FormatError("sign-mantissa plane has non-zero padding bits");
  }
  read_bitmap(bitmap, h);

  FrameStats stats = header_stats(h, size);
  stats.blocks = grid.blocks;
  stats.changed_blocks = changed_blocks.size();

  format::ContentChecksum checksum(kernels);
  const uint32_t value_bytes = info.value_bytes;
  entropy::SymbolStreamReader stream;
  const bool fine = h.section == ExponentSection::kFine;
  open_exponent_section(h, section, stream, stats);

  const bool full_in_pieces =
      h.section == ExponentSection::kFull && kFullPiece % grid.chunk_values == 0;
  if (full_in_pieces && full_piece.size() < kFullPiece) full_piece.resize(kFullPiece);
  size_t next_changed = 0;
  FineCursor fine_at;
  // A large shard is assembled chunk by chunk in an L1 buffer (merged, patched, checksummed
  // there) and streamed out past the caches; a small one is written in place, where the caller
  // will find it in cache.
  const bool streaming = grid.num_values * value_bytes >= format::kStreamingBytes;
  for (uint64_t chunk_first = 0; chunk_first < grid.num_values; chunk_first += grid.chunk_values) {
    const size_t count =
        static_cast<size_t>(std::min<uint64_t>(grid.chunk_values, grid.num_values - chunk_first));
    uint8_t* chunk_out = streaming ? chunk_output.data() : out + chunk_first * value_bytes;
    const uint8_t* exps =
        value_delta || one_shot ? nullptr : cache.data() + chunk_first;  // kFull: decoded
    if (h.section == ExponentSection::kFull && full_in_pieces) {
      // Two rANS segments at a time, which the stream decodes together; chunks tile the piece.
      const uint64_t at = chunk_first % kFullPiece;
      if (at == 0)
        stream.get(full_piece.data(),
                   std::min<uint64_t>(kFullPiece, grid.num_values - chunk_first));
      exps = full_piece.data() + at;
    } else if (h.section == ExponentSection::kFull) {
      stream.get(chunk_exponents.data(), count);
      exps = chunk_exponents.data();
    } else if (h.section == ExponentSection::kBlock) {
      exps = block_chunk_exponents(stream, chunk_first, count, next_changed);
    }
    if (fine) {
      // Patch this chunk's cached exponents, then merge from them. The next chunk's cache lines
      // are requested now, so that its patching does not wait on memory.
      const uint64_t next = chunk_first + count;
      for (uint64_t at = next; at < std::min(next + count, grid.num_values); at += 64) {
        __builtin_prefetch(cache.data() + at, 1);
      }
      apply_fine_changes(chunk_first, count, fine_at);
    }
    format::merge_values(layout, kernels, exps, sm_plane, chunk_first, count, chunk_out);
    if (h.has_content_checksum()) checksum.update(chunk_out, count * value_bytes);
    if (streaming) kernels.stream_copy(out + chunk_first * value_bytes, chunk_out, count * value_bytes);
  }
  if (streaming) format::stream_fence();
  if (h.section == ExponentSection::kFull || h.section == ExponentSection::kBlock) stream.finish();
  if (h.has_content_checksum() && checksum.digest() != h.content_checksum) {
    if (fine) revert_fine_changes(fine_at);
    throw FormatError(wire::content_checksum_mismatch("the cached exponents"));
  }

  cache_verified(h, out);
  commit(h);
  return stats;
}

void ShardDecoder::Impl::open_exponent_section(const wire::Header& h, const uint8_t* section,
                                               entropy::SymbolStreamReader& stream,
                                               FrameStats& stats) {
  const unsigned max_exponent = (1u << info.exponent_bits) - 1;
  ByteReader section_reader(section, h.exponent_bytes, "exponent section");
  if (h.section == ExponentSection::kFull) {
    stream.open(section_reader, grid.num_values, max_exponent, "full exponent stream");
  } else if (h.section == ExponentSection::kBlock) {
    uint64_t block_symbols = 0;
    for (uint32_t block : changed_blocks) block_symbols += grid.block_length(block);
    stream.open(section_reader, block_symbols, max_exponent, "block exponent stream");
  } else if (h.section == ExponentSection::kFine) {
    decode_fine(fine_coding, section, h.exponent_bytes, grid, changed_blocks, info.exponent_bits,
                changes_per_block.data(), fine_changes);
    stats.changed_values = fine_changes.count;
    stats.changed_values_known = true;
  } else if (h.exponent_bytes != 0) {
    throw FormatError("'unchanged' exponent section is not empty");
  }
  if ((h.section == ExponentSection::kFull || h.section == ExponentSection::kBlock) &&
      section_reader.remaining() != 0) {
    throw FormatError("exponent section has " + std::to_string(section_reader.remaining()) +
                      " trailing bytes");
  }
}

const uint8_t* ShardDecoder::Impl::block_chunk_exponents(entropy::SymbolStreamReader& stream,
                                                         uint64_t chunk_first, size_t count,
                                                         size_t& next_changed) {
  const uint64_t chunk_end = chunk_first + count;
  std::memcpy(chunk_exponents.data(), cache.data() + chunk_first, count);
  for (; next_changed < changed_blocks.size() &&
         grid.block_first(changed_blocks[next_changed]) < chunk_end;
       ++next_changed) {
    const uint64_t block = changed_blocks[next_changed];
    uint8_t* decoded = chunk_exponents.data() + (grid.block_first(block) - chunk_first);
    stream.get(decoded, grid.block_length(block));
    if (std::memcmp(decoded, cache.data() + grid.block_first(block), grid.block_length(block)) ==
        0) {
      throw FormatError("bitmap marks block " + std::to_string(block) +
                        " as changed, but none of its exponents differs from the cached ones "
                        "(canonical form: its bit is 0)");
    }
  }
  return chunk_exponents.data();
}

void ShardDecoder::Impl::cache_verified(const wire::Header& h, const uint8_t* out) {
  switch (h.section) {
    case ExponentSection::kFull:
      if (value_delta) {
        if (!values_cache.empty()) std::memcpy(values_cache.data(), out, values_cache.size());
      } else if (!one_shot) {
        format::extract_exponents(config.dtype, kernels, out, grid.num_values, cache.data());
      }
      break;
    case ExponentSection::kBlock:
      for (uint32_t block : changed_blocks) {
        const uint64_t first = grid.block_first(block);
        format::extract_exponents(config.dtype, kernels, out + first * info.value_bytes,
                                  grid.block_length(block), cache.data() + first);
      }
      break;
    case ExponentSection::kFine:  // applied chunk by chunk before the merge (apply_fine_changes)
      break;
    case ExponentSection::kUnchanged:
    case ExponentSection::kDifferences:  // value-delta frames are decode_differences'
      break;
  }
}

ShardDecoder::ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected)
    : ShardDecoder(config, num_values, expected, false) {}
ShardDecoder::ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected,
                           bool one_shot)
    : impl_(
          std::make_unique<Impl>(codec::coder_config(config, num_values, one_shot, "ShardDecoder"),
                                 num_values, expected, one_shot)) {}
ShardDecoder ShardDecoder::one_shot(const CodecConfig& config, uint64_t num_values,
                                    StreamIdentity expected) {
  return ShardDecoder(config, num_values, expected, true);
}
ShardDecoder::~ShardDecoder() = default;
ShardDecoder::Impl& ShardDecoder::state() const { return live_state(impl_, "ShardDecoder"); }
ShardDecoder::ShardDecoder(ShardDecoder&&) noexcept = default;
ShardDecoder& ShardDecoder::operator=(ShardDecoder&&) noexcept = default;

FrameStats ShardDecoder::decode(std::span<const std::byte> payload, std::span<std::byte> shard) {
  const uint64_t expected = state().grid.num_values * state().info.value_bytes;
  if (shard.size() != expected) {
    throw std::invalid_argument("ShardDecoder::decode: output is " + std::to_string(shard.size()) +
                                " bytes, expected " + std::to_string(expected));
  }
  // The shard is written while the payload is read: overlapping, it would decode bytes it had
  // overwritten (into wrong values where no content checksum is sent) and advance the stream.
  if (ranges_overlap(payload.data(), payload.size(), shard.data(), shard.size())) {
    throw std::invalid_argument("ShardDecoder::decode: the payload and the output overlap");
  }
  return state().decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(),
                        reinterpret_cast<uint8_t*>(shard.data()));
}

void ShardDecoder::request_resync() { state().resync_requested = true; }

void ShardDecoder::reset() {
  state().has_cache = false;
  state().resync_requested = true;
}

bool ShardDecoder::has_cache() const { return state().has_cache; }
uint32_t ShardDecoder::stream() const { return state().stream_id; }
uint32_t ShardDecoder::epoch() const { return state().epoch; }
uint64_t ShardDecoder::last_sequence() const { return state().last_sequence; }
uint64_t ShardDecoder::num_values() const { return state().grid.num_values; }
const CodecConfig& ShardDecoder::config() const { return state().config; }
size_t ShardDecoder::cache_bytes() const {
  return state().cache.size() + state().values_cache.size();
}
std::span<const uint8_t> ShardDecoder::cached_exponents() const { return state().cache; }

}  // namespace ciera
