// Sender side of the shard codec: exponent reuse (paper §3.1 and Algorithm 1, sender half) with
// the fine coding and key frames described in docs/format.md, and value-delta streams
// (docs/format.md, "Value-delta frames"; the difference section is codec/differences.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/chunking.hpp"
#include "codec/differences.hpp"
#include "codec/frame_schedule.hpp"
#include "codec/kernels.hpp"
#include "codec/limits.hpp"
#include "codec/stream_stats.hpp"
#include "codec/wire.hpp"
#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "common/huge_pages.hpp"
#include "common/moved_from.hpp"
#include "entropy/rans_core.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/content_checksum.hpp"
#include "format/planes.hpp"

namespace ciera {
namespace {

using codec::add_stream_stats;
using codec::SectionStream;
using codec::streams_then_extra_bound;
using codec::write_streams_then_extra;
using entropy::Histogram;
using entropy::StreamStats;
using entropy::SymbolSource;

constexpr unsigned kBucketBits = 4;        // count symbols are at most wire::kMaxBucket = 12
constexpr unsigned kChangeSymbolBits = 6;  // change symbols are at most wire::kMaxChangeSymbol = 38

// Chunks of these sources hold whole pairs of rANS segments, which the encoder codes together.
constexpr uint64_t kSegmentPairSymbols = 2 * entropy::kRansSegmentSymbols;

// Every exponent of a shard, read from the sender's exact copy (a view, no copying).
class PlaneSource final : public SymbolSource {
 public:
  PlaneSource(const uint8_t* plane, uint64_t n) : plane_(plane), n_(n) {}
  size_t chunk_count() const override { return (n_ + kSourceChunk - 1) / kSourceChunk; }
  size_t max_chunk_symbols() const override { return 0; }
  std::span<const uint8_t> chunk(size_t i, uint8_t*) const override {
    const uint64_t first = i * kSourceChunk;
    return {plane_ + first, static_cast<size_t>(std::min<uint64_t>(kSourceChunk, n_ - first))};
  }

 private:
  static constexpr uint64_t kSourceChunk = 32 * kSegmentPairSymbols;
  const uint8_t* plane_;
  uint64_t n_;
};

// Every exponent of a shard, extracted from the values on the fly (hash detection keeps no plane).
class ValuesSource final : public SymbolSource {
 public:
  ValuesSource(DType dtype, const format::PlaneKernels& k, const uint8_t* values, uint64_t n)
      : dtype_(dtype), k_(k), values_(values), n_(n), value_bytes_(dtype_info(dtype).value_bytes) {}
  size_t chunk_count() const override { return (n_ + kSourceChunk - 1) / kSourceChunk; }
  size_t max_chunk_symbols() const override { return kSourceChunk; }
  std::span<const uint8_t> chunk(size_t i, uint8_t* scratch) const override {
    const uint64_t first = i * kSourceChunk;
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kSourceChunk, n_ - first));
    format::extract_exponents(dtype_, k_, values_ + first * value_bytes_, count, scratch);
    return {scratch, count};
  }

 private:
  static constexpr uint64_t kSourceChunk = kSegmentPairSymbols;
  DType dtype_;
  const format::PlaneKernels& k_;
  const uint8_t* values_;
  uint64_t n_;
  uint32_t value_bytes_;
};

// The exponents of the changed blocks, block by block (block coding).
class ChangedBlocksSource final : public SymbolSource {
 public:
  ChangedBlocksSource(const BlockGrid& grid, const std::vector<uint32_t>& changed,
                      const uint8_t* plane, DType dtype, const format::PlaneKernels& k,
                      const uint8_t* values)
      : grid_(grid), changed_(changed), plane_(plane), dtype_(dtype), k_(k), values_(values),
        value_bytes_(dtype_info(dtype).value_bytes) {}
  size_t chunk_count() const override { return changed_.size(); }
  size_t max_chunk_symbols() const override { return plane_ ? 0 : grid_.block_values; }
  std::span<const uint8_t> chunk(size_t i, uint8_t* scratch) const override {
    const uint64_t first = grid_.block_first(changed_[i]);
    const size_t count = grid_.block_length(changed_[i]);
    if (plane_) return {plane_ + first, count};
    format::extract_exponents(dtype_, k_, values_ + first * value_bytes_, count, scratch);
    return {scratch, count};
  }

 private:
  const BlockGrid& grid_;
  const std::vector<uint32_t>& changed_;
  const uint8_t* plane_;  // null: extract from values_
  DType dtype_;
  const format::PlaneKernels& k_;
  const uint8_t* values_;
  uint32_t value_bytes_;
};

}  // namespace

size_t max_payload_bytes(DType dtype, uint64_t num_values, uint32_t block_values) {
  if (block_values < CodecConfig::kMinBlockValues || block_values > CodecConfig::kMaxBlockValues) {
    throw ConfigError("max_payload_bytes: block_values " + std::to_string(block_values) +
                      " is out of range");
  }
  codec::check_shard_values(num_values, "max_payload_bytes");
  const DTypeInfo info = dtype_info(dtype);
  const uint64_t sign_mantissa = format::SignMantissaLayout(dtype, num_values).total_bytes();
  return wire::sign_mantissa_offset(wire::bitmap_bytes_for(num_values, block_values), sign_mantissa) +
         sign_mantissa +
         entropy::symbol_stream_bound(num_values, info.exponent_bits);
}

struct ShardEncoder::Impl {
  Impl(const CodecConfig& c, uint64_t n, StreamIdentity id, bool single)
      : one_shot(single),
        config(c.validated()),
        grid(n, c.block_values),
        layout(c.dtype, n),
        kernels(format::kernels()),
        fine_coding(codec::codec_kernels()),
        info(dtype_info(c.dtype)),
        stream_id(id.stream),
        value_delta(c.stream_kind == StreamKind::kValueDelta),
        // A value-delta stream needs no warmup of key frames: its differences are small from
        // the second frame on, however often exponents still change.
        schedule{.warmup = value_delta ? 0 : c.warmup_steps, .epoch = id.epoch} {
    if (one_shot) {
      // Nothing is kept: the one frame is a key frame, coded from the values.
    } else if (value_delta) {
      sent_values.resize(n * info.value_bytes);
    } else if (config.detection == ChangeDetection::kExact) {
      sent_exponents.resize(n);
    } else {
      sent_hashes.resize(grid.blocks);
    }
    chunk_exponents.resize(grid.chunk_values);
  }

  FrameStats encode(const uint8_t* values, uint8_t* payload, uint64_t capacity);
  // A value-delta frame; its stats' payload_bytes is 0 if the differences would not fit the
  // capacity (then a key frame is sent instead).
  FrameStats encode_differences(const uint8_t* values, uint8_t* payload, uint64_t capacity);
  void write_header(FrameStats& stats, uint64_t content_checksum, uint8_t* payload) const;
  void scan(const uint8_t* values, bool key, uint8_t* bitmap, uint8_t* sm_plane,
            format::ContentChecksum* checksum);
  void detect_block(uint64_t block, const uint8_t* exps, uint8_t* bitmap);
  void reserve_changes(size_t more);
  void record_changed_block(uint64_t block, size_t changes, uint8_t* bitmap);
  uint64_t write_fine(uint8_t* out, uint64_t capacity, FrameStats& stats);
  // Block coding's exponent bits, in Q16, estimated from a sample (integers only: the GPU
  // encoder must make the same choice, docs/architecture.md, "Deterministic encoding").
  uint64_t estimate_block_bits_q16(const uint8_t* values, const uint8_t* bitmap) const;

  bool one_shot;  // one key frame, no state kept (ShardEncoder::one_shot)
  CodecConfig config;
  BlockGrid grid;
  format::SignMantissaLayout layout;
  const format::PlaneKernels& kernels;
  const codec::CodecKernels& fine_coding;
  DTypeInfo info;
  uint32_t stream_id;
  bool value_delta;
  codec::FrameSchedule schedule;

  // Persistent state: what the receivers hold (exact), its block hashes (hash), or for a
  // value-delta stream the values last sent.
  std::vector<uint8_t, HugePageAllocator<uint8_t>> sent_exponents;
  std::vector<BlockHash> sent_hashes;
  std::vector<uint8_t, HugePageAllocator<uint8_t>> sent_values;
  codec::DifferenceWriter differences;

  // Per-frame scratch, grown on demand and kept, so steady-state frames do not allocate.
  std::vector<uint8_t> chunk_exponents;
  entropy::SymbolCounter<256> key_exponents;  // a key frame's exponents, counted by scan()
  std::vector<uint32_t> changed_blocks;
  std::vector<uint16_t> change_positions;  // tagged (format::tag_change), in block order
  std::vector<uint8_t> change_steps;       // find_changes' steps (unfused detection)
  std::vector<uint8_t> escape_symbols;     // the escaped steps, in change order
  size_t escape_count = 0;
  std::vector<uint16_t> changes_per_block;  // one per changed block
  uint64_t change_count = 0;
  bool collect_changes = false;
  std::vector<uint8_t> count_symbols;
  std::vector<uint8_t> change_symbols;
  std::vector<uint8_t> extra_scratch;
  std::vector<uint8_t> stream_scratch;
};

void ShardEncoder::Impl::detect_block(uint64_t block, const uint8_t* exps, uint8_t* bitmap) {
  const uint64_t first = grid.block_first(block);
  const size_t length = grid.block_length(block);
  bool changed = false;
  if (config.detection == ChangeDetection::kHash) {
    const BlockHash h = block_hash(exps, length, config.hash_bits);
    changed = !(h == sent_hashes[block]);
    sent_hashes[block] = h;
  } else if (collect_changes) {
    reserve_changes(length);
    uint16_t* positions = change_positions.data() + change_count;
    uint8_t* steps = change_steps.data() + change_count;
    const size_t m = kernels.find_changes(exps, sent_exponents.data() + first, length, positions, steps);
    if (m != 0) {
      uint8_t* sent = sent_exponents.data() + first;
      const uint8_t exponent_mask = static_cast<uint8_t>((1u << info.exponent_bits) - 1);
      for (size_t j = 0; j < m; ++j) {
        sent[positions[j]] = exps[positions[j]];
        positions[j] = format::tag_step(positions[j], steps[j] & exponent_mask, exponent_mask,
                                        escape_symbols.data(), escape_count);
      }
      record_changed_block(block, m, bitmap);
    }
    return;
  } else if (std::memcmp(exps, sent_exponents.data() + first, length) != 0) {
    changed = true;
    std::memcpy(sent_exponents.data() + first, exps, length);
  }
  if (changed) record_changed_block(block, 0, bitmap);
}

void ShardEncoder::Impl::reserve_changes(size_t more) {
  const size_t need = change_count + more + format::kChangeSlack;
  if (change_positions.size() < need) {
    change_positions.resize(std::max<size_t>(2 * change_positions.size(), need));
    change_steps.resize(change_positions.size());
    escape_symbols.resize(change_positions.size());
  }
}

void ShardEncoder::Impl::record_changed_block(uint64_t block, size_t changes, uint8_t* bitmap) {
  changed_blocks.push_back(static_cast<uint32_t>(block));
  bitmap[block / 8] = static_cast<uint8_t>(bitmap[block / 8] | (1u << (block % 8)));
  if (collect_changes) {
    changes_per_block.push_back(static_cast<uint16_t>(changes));
    change_count += changes;
  }
}

// One pass over the shard: split into planes, detect changed blocks, checksum the values.
void ShardEncoder::Impl::scan(const uint8_t* values, bool key, uint8_t* bitmap, uint8_t* sm_plane,
                              format::ContentChecksum* checksum) {
  const uint32_t value_bytes = info.value_bytes;
  // BF16 with exact detection has a fused split-and-compare kernel (the steady-state hot path).
  const bool fused_bf16 = !key && collect_changes && config.dtype == DType::kBF16;
  // A large plane will have left the caches before it is sent: write it past them (it is large
  // enough to start on a cache line, docs/format.md "Padding").
  static_assert(format::kStreamingBytes >= wire::kAlignedPlaneBytes);
  const bool stream = layout.total_bytes() >= format::kStreamingBytes;
  key_exponents.clear();
  for (uint64_t chunk_first = 0; chunk_first < grid.num_values; chunk_first += grid.chunk_values) {
    const size_t count =
        static_cast<size_t>(std::min<uint64_t>(grid.chunk_values, grid.num_values - chunk_first));
    const uint8_t* chunk_values = values + chunk_first * value_bytes;
    const uint64_t first_block = chunk_first / grid.block_values;
    const uint64_t end_block = grid.block_of(chunk_first + count - 1) + 1;
    // The checksum runs after the split, over values the split just brought into L1.
    if (fused_bf16) {
      for (uint64_t b = first_block; b < end_block; ++b) {
        const uint64_t first = grid.block_first(b);
        const size_t length = grid.block_length(b);
        reserve_changes(length);
        const size_t m = kernels.split_detect_bf16(
            values + 2 * first, length, sm_plane + first, sent_exponents.data() + first,
            change_positions.data() + change_count, escape_symbols.data(), &escape_count, stream);
        if (m != 0) record_changed_block(b, m, bitmap);
      }
      if (checksum) checksum->update(chunk_values, 2 * count);
      continue;
    }
    uint8_t* exps = chunk_exponents.data();
    format::split_values(layout, kernels, chunk_values, chunk_first, count, exps, sm_plane);
    if (checksum) checksum->update(chunk_values, count * value_bytes);
    if (key) {
      key_exponents.add(exps, count);  // the full section's histogram, while the chunk is in L1
      if (value_delta || one_shot) continue;  // the values themselves are kept, or nothing is
      if (config.detection == ChangeDetection::kExact) {
        std::memcpy(sent_exponents.data() + chunk_first, exps, count);
      } else {
        for (uint64_t b = first_block; b < end_block; ++b) {
          sent_hashes[b] = block_hash(exps + (grid.block_first(b) - chunk_first),
                                      grid.block_length(b), config.hash_bits);
        }
      }
      continue;
    }
    for (uint64_t b = first_block; b < end_block; ++b) {
      detect_block(b, exps + (grid.block_first(b) - chunk_first), bitmap);
    }
  }
  // Streamed stores are weakly ordered: complete them before the payload is handed on (the
  // engine sends it from another thread).
  if (fused_bf16 && stream) format::stream_fence();
}

// Fine coding (docs/format.md, "Exponent section", fine). Returns 0 if it cannot fit `capacity`.
uint64_t ShardEncoder::Impl::write_fine(uint8_t* out, uint64_t capacity, FrameStats& stats) {
  const size_t blocks_changed = changed_blocks.size();
  count_symbols.resize(blocks_changed);
  change_symbols.resize(change_count);
  // Extra bits: at most 11 per count and per gap (bucket 12), plus a word of flush slack.
  const size_t extra_capacity = (11 * (blocks_changed + change_count) + 7) / 8 + 8;
  if (extra_scratch.size() < extra_capacity) extra_scratch.resize(extra_capacity);
  // Raw pointers: byte stores through vectors would make the compiler reload every vector's
  // data pointer after each store (uint8_t aliases everything).
  const uint16_t* per_block = changes_per_block.data();
  uint8_t* counts = count_symbols.data();
  uint8_t* symbols = change_symbols.data();
  uint8_t* escapes = escape_symbols.data();
  // The count extras precede the gap extras in the stream (docs/format.md), so write them first.
  SlackBitWriter extra(extra_scratch.data());
  for (size_t i = 0; i < blocks_changed; ++i) {
    const uint32_t v = per_block[i] - 1u;
    const unsigned bucket = wire::bucket_of(v);
    counts[i] = static_cast<uint8_t>(bucket);
    extra.put(v - wire::bucket_base(bucket), wire::bucket_extra_bits(bucket));
  }
  // Each block's first change is flagged where the gap restarts: the symbols are made in one
  // flat pass over all changes (a loop per block would mispredict its exit at nearly every
  // block). The decoder flags its symbols the same way.
  static_assert(CodecConfig::kMaxBlockValues - 1 <= format::kPositionMask);
  uint16_t* flagged = change_positions.data();
  for (size_t i = 0, c = 0; i < blocks_changed; c += per_block[i], ++i) {
    flagged[c] |= format::kBlockStartFlag;
  }
  fine_coding.fine_symbols(change_positions.data(), change_count, symbols, extra);
  const uint64_t extra_bytes = extra.finish();
  const std::initializer_list<SectionStream> streams = {{{counts, blocks_changed}, kBucketBits},
                                                         {{symbols, change_count}, kChangeSymbolBits},
                                                         {{escapes, escape_count}, info.exponent_bits}};
  if (streams_then_extra_bound(streams, extra_bytes) > capacity) return 0;
  return write_streams_then_extra(streams, extra_scratch.data(), extra_bytes, out, capacity, stream_scratch, stats);
}

// Estimated bits of block coding for this frame, from an order-0 model of a sample of the
// changed blocks' exponents. Only used to skip the exact block-coding cost when fine coding is
// clearly smaller (auto mode); close calls are decided on exact sizes.
uint64_t ShardEncoder::Impl::estimate_block_bits_q16(const uint8_t* values,
                                                     const uint8_t* bitmap) const {
  // About 4096 samples: plenty for an order-0 estimate over a few dozen exponent values, and
  // few enough that their cache misses cost microseconds. An odd stride avoids aliasing with
  // power-of-two block sizes.
  const uint64_t stride = std::max<uint64_t>(1, grid.num_values / 4096) | 1;
  Histogram sample;
  for (uint64_t v = 0; v < grid.num_values; v += stride) {
    const uint64_t block = grid.block_of(v);
    if (((bitmap[block / 8] >> (block % 8)) & 1u) == 0) continue;
    const uint8_t e = sent_exponents.empty()
                          ? format::exponent_of(config.dtype, values + v * info.value_bytes)
                          : sent_exponents[v];
    ++sample.count[e];
    ++sample.total;
  }
  uint64_t symbols = 0;
  for (uint32_t block : changed_blocks) symbols += grid.block_length(block);
  if (sample.total == 0) return 0;
  // The sample's cost under its own rANS model, per symbol, times the symbols to code.
  const uint64_t per_symbol_q16 = entropy::RansModel::from_histogram(sample).cost_q16(sample) / sample.total;
  return per_symbol_q16 * symbols;
}

void ShardEncoder::Impl::write_header(FrameStats& stats, uint64_t content_checksum,
                                     uint8_t* payload) const {
  wire::Header header;
  header.dtype = config.dtype;
  header.kind = stats.kind;
  header.section = stats.section;
  header.flags = config.content_checksum ? wire::kFlagContentChecksum : 0;
  header.block_values = grid.block_values;
  header.num_values = grid.num_values;
  header.stream = stream_id;
  header.epoch = schedule.epoch;
  header.sequence = schedule.sequence;
  header.bitmap_bytes = stats.bitmap_bytes;
  header.sign_mantissa_bytes = stats.sign_mantissa_bytes;
  header.exponent_bytes = stats.exponent_bytes;
  header.content_checksum = config.content_checksum ? content_checksum : 0;
  wire::write_header(header, payload);
  stats.payload_bytes = header.payload_bytes();
}

FrameStats ShardEncoder::Impl::encode_differences(const uint8_t* values, uint8_t* payload,
                                                  uint64_t capacity) {
  FrameStats stats;
  stats.kind = FrameKind::kValueDelta;
  stats.stream = stream_id;
  stats.epoch = schedule.epoch;
  stats.sequence = schedule.sequence;
  stats.blocks = grid.blocks;
  format::ContentChecksum checksum(kernels);
  const codec::DifferenceWriter::Result r = differences.write(
      config.dtype, values, sent_values.data(), grid.num_values, payload + wire::kHeaderBytes,
      capacity - wire::kHeaderBytes, config.content_checksum ? &checksum : nullptr, stats);
  stats.changed_values = r.changed;
  stats.changed_values_known = true;
  if (!r.fits) return FrameStats{};
  stats.section = r.changed == 0 ? ExponentSection::kUnchanged : ExponentSection::kDifferences;
  stats.exponent_bytes = r.bytes;
  write_header(stats, checksum.digest(), payload);
  return stats;
}

FrameStats ShardEncoder::Impl::encode(const uint8_t* values, uint8_t* payload, uint64_t capacity) {
  if (one_shot && schedule.sequence != 0) {
    throw std::logic_error("ShardEncoder: a one-shot encoder codes one frame; this is its second");
  }
  bool key = one_shot || schedule.next_is_key();
  if (value_delta && !key) {
    // The differences, unless they would not fit where a key frame fits (values that jumped
    // far, as after a reinitialisation, or random bit patterns): then a key frame, which the
    // receiver takes too and which moves its previous values on as well. Written only where
    // their packed bound fits max_payload_bytes() (not the caller's buffer, which may be
    // larger), and kept only where their coded size fits the key frame's own bound
    // (docs/format.md, "Size bound"): the key frame sent instead is never larger.
    const uint64_t bound = ciera::max_payload_bytes(config.dtype, grid.num_values, grid.block_values);
    FrameStats stats = encode_differences(values, payload, std::min(capacity, bound));
    const uint64_t key_bound =
        codec::value_delta_frame_bound(wire::sign_mantissa_offset(0, layout.total_bytes()),
                                       layout.total_bytes(), grid.num_values, info.exponent_bits);
    if (stats.payload_bytes != 0 && stats.payload_bytes <= key_bound) {
      schedule.advance();
      return stats;
    }
    key = true;
  }
  FrameStats stats;
  stats.kind = key ? FrameKind::kKey : FrameKind::kDelta;
  stats.stream = stream_id;
  stats.epoch = schedule.epoch;
  stats.sequence = schedule.sequence;
  stats.blocks = grid.blocks;
  stats.bitmap_bytes = key ? 0 : wire::bitmap_bytes_for(grid.num_values, grid.block_values);
  stats.sign_mantissa_bytes = layout.total_bytes();

  uint8_t* bitmap = payload + wire::kHeaderBytes;
  uint8_t* sm_plane = payload + wire::sign_mantissa_offset(stats.bitmap_bytes, stats.sign_mantissa_bytes);
  uint8_t* exponent_section = sm_plane + stats.sign_mantissa_bytes;
  const uint64_t exponent_capacity = capacity - static_cast<uint64_t>(exponent_section - payload);
  std::memset(bitmap, 0, sm_plane - bitmap);  // the bitmap and the padding after it
  // The FP16 packed plane's last byte may be only partly written: its padding bits must be 0.
  if (config.dtype == DType::kFP16 && layout.total_bytes() > 0) sm_plane[layout.total_bytes() - 1] = 0;

  changed_blocks.clear();
  changes_per_block.clear();
  change_count = 0;
  escape_count = 0;
  collect_changes = !key && config.detection == ChangeDetection::kExact &&
                    config.coding != ExponentCoding::kBlock;
  format::ContentChecksum checksum(kernels);
  scan(values, key, bitmap, sm_plane, config.content_checksum ? &checksum : nullptr);

  const uint8_t* plane = !value_delta && !one_shot && config.detection == ChangeDetection::kExact
                             ? sent_exponents.data()
                             : nullptr;
  auto write_block = [&]() {
    const ChangedBlocksSource source(grid, changed_blocks, plane, config.dtype, kernels, values);
    const Histogram hist = entropy::histogram_of(source, stream_scratch);
    const StreamStats s = entropy::write_symbol_stream(source, hist, info.exponent_bits,
                                                       exponent_section, exponent_capacity,
                                                       stream_scratch);
    add_stream_stats(stats, s);
    return s.bytes;
  };

  if (key) {
    stats.section = ExponentSection::kFull;
    const PlaneSource plane_source(plane, grid.num_values);
    const ValuesSource values_source(config.dtype, kernels, values, grid.num_values);
    const SymbolSource& source = plane ? static_cast<const SymbolSource&>(plane_source) : values_source;
    const Histogram hist = key_exponents.take();
    const StreamStats s = entropy::write_symbol_stream(source, hist, info.exponent_bits,
                                                       exponent_section, exponent_capacity,
                                                       stream_scratch);
    add_stream_stats(stats, s);
    stats.exponent_bytes = s.bytes;
  } else {
    stats.changed_blocks = changed_blocks.size();
    if (collect_changes) {
      stats.changed_values = change_count;
      stats.changed_values_known = true;
    }
    if (changed_blocks.empty()) {
      stats.section = ExponentSection::kUnchanged;
      stats.exponent_bytes = 0;
    } else if (!collect_changes) {
      stats.section = ExponentSection::kBlock;
      stats.exponent_bytes = write_block();
    } else {
      FrameStats fine_stats = stats;
      const uint64_t fine_bytes = write_fine(exponent_section, exponent_capacity, fine_stats);
      bool use_fine = fine_bytes != 0;
      // Fine wins outright below 80% of the estimate: 5 * fine bits > 4 * block bits, in Q16.
      const auto fine_bits_q16 = static_cast<unsigned __int128>(fine_bytes) * (8 << 16);
      if (use_fine && config.coding == ExponentCoding::kAuto &&
          5 * fine_bits_q16 > 4 * static_cast<unsigned __int128>(estimate_block_bits_q16(values, bitmap))) {
        // Too close to call from the sample: compare with block coding's size on the full data.
        const ChangedBlocksSource source(grid, changed_blocks, plane, config.dtype, kernels, values);
        const Histogram hist = entropy::histogram_of(source, stream_scratch);
        use_fine = fine_bytes <= entropy::estimate_stream_bytes(hist, info.exponent_bits);
      }
      if (use_fine) {
        stats = fine_stats;
        stats.section = ExponentSection::kFine;
        stats.exponent_bytes = fine_bytes;
      } else {
        stats.section = ExponentSection::kBlock;
        stats.exponent_bytes = write_block();
      }
    }
  }

  write_header(stats, checksum.digest(), payload);
  // (Not for an empty shard: memcpy of null pointers is undefined even for 0 bytes.)
  if (value_delta && !sent_values.empty()) std::memcpy(sent_values.data(), values, sent_values.size());
  schedule.advance();
  return stats;
}

ShardEncoder::ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity)
    : ShardEncoder(config, num_values, identity, false) {}
ShardEncoder::ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity,
                           bool one_shot)
    : impl_(
          std::make_unique<Impl>(codec::coder_config(config, num_values, one_shot, "ShardEncoder"),
                                 num_values, identity, one_shot)) {}
ShardEncoder ShardEncoder::one_shot(const CodecConfig& config, uint64_t num_values,
                                    StreamIdentity identity) {
  return ShardEncoder(config, num_values, identity, true);
}
ShardEncoder::~ShardEncoder() = default;
ShardEncoder::Impl& ShardEncoder::state() const { return live_state(impl_, "ShardEncoder"); }
ShardEncoder::ShardEncoder(ShardEncoder&&) noexcept = default;
ShardEncoder& ShardEncoder::operator=(ShardEncoder&&) noexcept = default;

FrameStats ShardEncoder::encode(std::span<const std::byte> shard, std::span<std::byte> payload) {
  const uint64_t expected = state().grid.num_values * state().info.value_bytes;
  if (shard.size() != expected) {
    throw std::invalid_argument("ShardEncoder::encode: shard is " + std::to_string(shard.size()) +
                                " bytes, expected " + std::to_string(expected));
  }
  if (payload.size() < max_payload_bytes()) {
    throw std::invalid_argument("ShardEncoder::encode: payload buffer is " +
                                std::to_string(payload.size()) + " bytes, needs " +
                                std::to_string(max_payload_bytes()));
  }
  // The frame is written while the shard is read: overlapping, it would code bytes it had
  // already overwritten, and the receiver would reject the frame only at its checksum.
  if (ranges_overlap(shard.data(), shard.size(), payload.data(), payload.size())) {
    throw std::invalid_argument("ShardEncoder::encode: the shard and the payload buffer overlap");
  }
  return state().encode(reinterpret_cast<const uint8_t*>(shard.data()),
                        reinterpret_cast<uint8_t*>(payload.data()), payload.size());
}

void ShardEncoder::request_key_frame() { state().schedule.request_key_frame(); }

uint64_t ShardEncoder::num_values() const { return state().grid.num_values; }
size_t ShardEncoder::max_payload_bytes() const {
  return ciera::max_payload_bytes(state().config.dtype, state().grid.num_values,
                                  state().grid.block_values);
}
const CodecConfig& ShardEncoder::config() const { return state().config; }
uint32_t ShardEncoder::stream() const { return state().stream_id; }
uint32_t ShardEncoder::epoch() const { return state().schedule.epoch; }
uint64_t ShardEncoder::next_sequence() const { return state().schedule.sequence; }
size_t ShardEncoder::cache_bytes() const {
  return state().sent_exponents.size() + state().sent_hashes.size() * sizeof(BlockHash) +
         state().sent_values.size();
}

}  // namespace ciera
