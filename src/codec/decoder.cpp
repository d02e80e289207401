// Receiver side of the exponent-reuse codec: paper Algorithm 1 (receiver half).
//
// Order of work, so that a bad payload can never reach the cache (docs/format.md, "Integrity"):
//   1. validate the header against this decoder's configuration and sequence;
//   2. merge cached or decoded exponents with the sign-mantissa plane into the caller's buffer,
//      checksumming the values as they are produced;
//   3. compare with the content checksum;
//   4. only then update the exponent cache from the verified output.
#include <array>
#include <optional>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/chunking.hpp"
#include "codec/wire.hpp"
#include "common/bits.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/planes.hpp"

namespace ciera {
namespace {

std::string mismatch(const char* what, const std::string& payload, const std::string& decoder) {
  return std::string("payload ") + what + " is " + payload + " but this decoder expects " + decoder;
}

// Walks a fine-coded exponent section block by block (docs/format.md, "Exponent section", fine).
class FineChangeReader {
 public:
  // `changes_per_block` has room for one entry per changed block.
  FineChangeReader(const uint8_t* section, uint64_t size, uint64_t changed_blocks,
                   const BlockGrid& grid, const std::vector<uint32_t>& changed,
                   unsigned exponent_bits, uint16_t* changes_per_block)
      : changes_per_block_(changes_per_block) {
    ByteReader section_reader(section, size, "fine exponent section");
    counts_.open(section_reader, changed_blocks, wire::kMaxBucket, "fine counts stream");
    // The gap and step streams hold one symbol per changed value, which only the counts reveal;
    // remember where they are and read the counts first.
    const uint64_t gaps_at = section_reader.position();
    skip_stream(section_reader);
    const uint64_t steps_at = section_reader.position();
    skip_stream(section_reader);
    const uint64_t extra_bytes = section_reader.u64();
    const uint8_t* extra = section_reader.take(extra_bytes);
    if (section_reader.remaining() != 0) {
      throw FormatError("fine exponent section has " + std::to_string(section_reader.remaining()) +
                        " trailing bytes");
    }
    extra_bits_ = BitReader(extra, extra_bytes, "fine extra bits");

    uint64_t total = 0;
    for (uint64_t i = 0; i < changed_blocks; ++i) {
      uint8_t bucket;
      counts_.get(&bucket, 1);
      const uint32_t m = read_bucketed(bucket) + 1;
      if (m > grid.block_length(changed[i])) {
        throw FormatError("fine exponent section claims " + std::to_string(m) +
                          " changed values in block " + std::to_string(changed[i]) + " of " +
                          std::to_string(grid.block_length(changed[i])) + " values");
      }
      changes_per_block_[i] = static_cast<uint16_t>(m);
      total += m;
    }
    counts_.finish();
    total_changes_ = total;
    ByteReader gaps_reader(section + gaps_at, steps_at - gaps_at, "fine gaps stream");
    gaps_.open(gaps_reader, total, wire::kMaxBucket, "fine gaps stream");
    ByteReader steps_reader(section + steps_at, size - steps_at, "fine steps stream");
    steps_.open(steps_reader, total, (1u << exponent_bits) - 1, "fine steps stream");
  }

  uint64_t total_changes() const { return total_changes_; }

  // Changed positions (block-local, increasing) and exponent steps of the next changed block.
  size_t next_block(size_t block_length, uint16_t* positions, uint8_t* steps) {
    const size_t m = changes_per_block_[block_index_++];
    std::array<uint8_t, CodecConfig::kMaxBlockValues> gap_buckets;
    gaps_.get(gap_buckets.data(), m);
    steps_.get(steps, m);
    int64_t previous = -1;
    for (size_t j = 0; j < m; ++j) {
      const int64_t position = previous + 1 + read_bucketed(gap_buckets[j]);
      if (position >= static_cast<int64_t>(block_length)) {
        throw FormatError("fine exponent section places a change past the end of its block");
      }
      if (steps[j] == 0) throw FormatError("fine exponent section has a zero exponent step");
      positions[j] = static_cast<uint16_t>(position);
      previous = position;
    }
    return m;
  }

  void finish() {
    gaps_.finish();
    steps_.finish();
    if (!extra_bits_.exhausted_canonically()) {
      throw FormatError("fine extra bits are not fully used or have non-zero padding");
    }
  }

 private:
  static void skip_stream(ByteReader& reader) {
    reader.need(entropy::kStreamHeaderBytes);
    const uint64_t body = load_le64(reader.cursor() + 2);
    reader.take(entropy::kStreamHeaderBytes);
    reader.take(body);
  }

  uint32_t read_bucketed(unsigned bucket) {
    return wire::bucket_base(bucket) + extra_bits_.get(wire::bucket_extra_bits(bucket));
  }

  entropy::SymbolStreamReader counts_;
  entropy::SymbolStreamReader gaps_;
  entropy::SymbolStreamReader steps_;
  BitReader extra_bits_;
  uint16_t* changes_per_block_;
  uint64_t block_index_ = 0;
  uint64_t total_changes_ = 0;
};

}  // namespace

struct ShardDecoder::Impl {
  Impl(const CodecConfig& c, uint64_t n)
      : config(c), grid(n, c.block_values), layout(c.dtype, n), kernels(format::kernels()),
        info(dtype_info(c.dtype)) {
    config.validate();
    cache.resize(n);
    chunk_exponents.resize(grid.chunk_values);
    changed_blocks.reserve(grid.blocks);
    changes_per_block.resize(grid.blocks);
  }

  FrameStats decode(const uint8_t* payload, size_t size, uint8_t* out);
  wire::Header check_header(const uint8_t* payload, size_t size) const;
  void read_bitmap(const uint8_t* bitmap, const wire::Header& header);
  void apply_fine_to_output(FineChangeReader& fine, uint64_t chunk_first, size_t count,
                            size_t& next_changed, uint8_t* out);
  void apply_fine_to_cache(FineChangeReader& fine);

  CodecConfig config;
  BlockGrid grid;
  format::SignMantissaLayout layout;
  const format::PlaneKernels& kernels;
  DTypeInfo info;

  std::vector<uint8_t> cache;  // ExpCache of Algorithm 1
  bool has_cache = false;
  uint32_t epoch = 0;
  uint64_t last_sequence = 0;

  // Scratch sized at construction from this decoder's own configuration, never from a payload.
  std::vector<uint8_t> chunk_exponents;
  std::vector<uint32_t> changed_blocks;
  std::vector<uint16_t> changes_per_block;
  std::array<uint16_t, CodecConfig::kMaxBlockValues> positions{};
  std::array<uint8_t, CodecConfig::kMaxBlockValues> steps{};
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
  if (h.sign_mantissa_bytes != layout.total_bytes()) {
    throw FormatError(mismatch("sign-mantissa length", std::to_string(h.sign_mantissa_bytes),
                               std::to_string(layout.total_bytes())));
  }
  const uint64_t bitmap_bytes =
      h.kind == FrameKind::kKey ? 0 : wire::bitmap_bytes_for(grid.num_values, grid.block_values);
  if (h.bitmap_bytes != bitmap_bytes) {
    throw FormatError(mismatch("bitmap length", std::to_string(h.bitmap_bytes),
                               std::to_string(bitmap_bytes)));
  }
  if (config.content_checksum && !h.has_content_checksum()) {
    throw FormatError("payload carries no content checksum but this decoder requires one");
  }
  if (h.kind == FrameKind::kDelta) {
    if (!has_cache) {
      throw FormatError("delta frame (epoch " + std::to_string(h.epoch) + ", sequence " +
                        std::to_string(h.sequence) +
                        ") cannot be decoded: this decoder holds no exponent cache and needs a "
                        "key frame");
    }
    if (h.epoch != epoch) {
      throw FormatError("delta frame from epoch " + std::to_string(h.epoch) +
                        " but the exponent cache belongs to epoch " + std::to_string(epoch) +
                        " (sender was reset; a key frame is needed)");
    }
    if (h.sequence != last_sequence + 1) {
      throw FormatError("out-of-sequence delta frame: sequence " + std::to_string(h.sequence) +
                        " after " + std::to_string(last_sequence) + " (expected " +
                        std::to_string(last_sequence + 1) + ")");
    }
  }
  return h;
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

void ShardDecoder::Impl::apply_fine_to_output(FineChangeReader& fine, uint64_t chunk_first,
                                              size_t count, size_t& next_changed, uint8_t* out) {
  const uint8_t mask = static_cast<uint8_t>((1u << info.exponent_bits) - 1);
  const uint64_t chunk_end = chunk_first + count;
  for (; next_changed < changed_blocks.size() &&
         grid.block_first(changed_blocks[next_changed]) < chunk_end;
       ++next_changed) {
    const uint64_t block = changed_blocks[next_changed];
    const uint64_t first = grid.block_first(block);
    const size_t m = fine.next_block(grid.block_length(block), positions.data(), steps.data());
    for (size_t j = 0; j < m; ++j) {
      const uint64_t v = first + positions[j];
      const uint8_t exponent = static_cast<uint8_t>((cache[v] + steps[j]) & mask);
      format::set_exponent(config.dtype, out + (v - chunk_first) * info.value_bytes, exponent);
    }
  }
}

void ShardDecoder::Impl::apply_fine_to_cache(FineChangeReader& fine) {
  const uint8_t mask = static_cast<uint8_t>((1u << info.exponent_bits) - 1);
  for (uint32_t block : changed_blocks) {
    const uint64_t first = grid.block_first(block);
    const size_t m = fine.next_block(grid.block_length(block), positions.data(), steps.data());
    for (size_t j = 0; j < m; ++j) {
      uint8_t& e = cache[first + positions[j]];
      e = static_cast<uint8_t>((e + steps[j]) & mask);
    }
  }
}

FrameStats ShardDecoder::Impl::decode(const uint8_t* payload, size_t size, uint8_t* out) {
  const wire::Header h = check_header(payload, size);
  const uint8_t* bitmap = payload + wire::kHeaderBytes;
  const uint8_t* sm_plane = bitmap + h.bitmap_bytes;
  const uint8_t* section = sm_plane + h.sign_mantissa_bytes;
  if (config.dtype == DType::kFP16 && (3 * grid.num_values) % 8 != 0) {
    const uint8_t padding = static_cast<uint8_t>(0xFFu << ((3 * grid.num_values) % 8));
    if ((sm_plane[layout.total_bytes() - 1] & padding) != 0) {
      throw FormatError("sign-mantissa plane has non-zero padding bits");
    }
  }
  read_bitmap(bitmap, h);

  FrameStats stats;
  stats.kind = h.kind;
  stats.section = h.section;
  stats.epoch = h.epoch;
  stats.sequence = h.sequence;
  stats.payload_bytes = size;
  stats.bitmap_bytes = h.bitmap_bytes;
  stats.sign_mantissa_bytes = h.sign_mantissa_bytes;
  stats.exponent_bytes = h.exponent_bytes;
  stats.blocks = grid.blocks;
  stats.changed_blocks = changed_blocks.size();

  const unsigned max_exponent = (1u << info.exponent_bits) - 1;
  ContentChecksum checksum;
  const uint32_t value_bytes = info.value_bytes;
  ByteReader section_reader(section, h.exponent_bytes, "exponent section");
  entropy::SymbolStreamReader stream;
  std::optional<FineChangeReader> fine;
  uint64_t block_symbols = 0;
  if (h.section == ExponentSection::kFull) {
    stream.open(section_reader, grid.num_values, max_exponent, "full exponent stream");
  } else if (h.section == ExponentSection::kBlock) {
    for (uint32_t block : changed_blocks) block_symbols += grid.block_length(block);
    stream.open(section_reader, block_symbols, max_exponent, "block exponent stream");
  } else if (h.section == ExponentSection::kFine) {
    fine.emplace(section, h.exponent_bytes, changed_blocks.size(), grid, changed_blocks,
                 info.exponent_bits, changes_per_block.data());
    stats.changed_values = fine->total_changes();
    stats.changed_values_known = true;
  } else if (h.exponent_bytes != 0) {
    throw FormatError("'unchanged' exponent section is not empty");
  }
  if ((h.section == ExponentSection::kFull || h.section == ExponentSection::kBlock) &&
      section_reader.remaining() != 0) {
    throw FormatError("exponent section has " + std::to_string(section_reader.remaining()) +
                      " trailing bytes");
  }

  size_t next_changed = 0;
  for (uint64_t chunk_first = 0; chunk_first < grid.num_values; chunk_first += grid.chunk_values) {
    const size_t count =
        static_cast<size_t>(std::min<uint64_t>(grid.chunk_values, grid.num_values - chunk_first));
    uint8_t* chunk_out = out + chunk_first * value_bytes;
    const uint8_t* exps = cache.data() + chunk_first;
    if (h.section == ExponentSection::kFull) {
      stream.get(chunk_exponents.data(), count);
      exps = chunk_exponents.data();
    } else if (h.section == ExponentSection::kBlock) {
      // Exponents of this chunk: decoded for changed blocks, cached for the rest.
      const uint64_t chunk_end = chunk_first + count;
      std::memcpy(chunk_exponents.data(), cache.data() + chunk_first, count);
      for (; next_changed < changed_blocks.size() &&
             grid.block_first(changed_blocks[next_changed]) < chunk_end;
           ++next_changed) {
        const uint64_t block = changed_blocks[next_changed];
        stream.get(chunk_exponents.data() + (grid.block_first(block) - chunk_first),
                   grid.block_length(block));
      }
      exps = chunk_exponents.data();
    }
    format::merge_values(layout, kernels, exps, sm_plane, chunk_first, count, chunk_out);
    if (fine) apply_fine_to_output(*fine, chunk_first, count, next_changed, chunk_out);
    if (h.has_content_checksum()) checksum.update(chunk_out, count * value_bytes);
  }
  if (fine) {
    fine->finish();
  } else if (h.section != ExponentSection::kUnchanged) {
    stream.finish();
  }
  if (h.has_content_checksum() && checksum.digest() != h.content_checksum) {
    throw FormatError(
        "content checksum mismatch: the reconstructed shard differs from what was sent (payload "
        "corrupted, or sender and receiver disagree about the cached exponents)");
  }

  // Verified: commit to the cache.
  switch (h.section) {
    case ExponentSection::kFull:
      format::extract_exponents(config.dtype, kernels, out, grid.num_values, cache.data());
      break;
    case ExponentSection::kBlock:
      for (uint32_t block : changed_blocks) {
        const uint64_t first = grid.block_first(block);
        format::extract_exponents(config.dtype, kernels, out + first * value_bytes,
                                  grid.block_length(block), cache.data() + first);
      }
      break;
    case ExponentSection::kFine: {
      FineChangeReader again(section, h.exponent_bytes, changed_blocks.size(), grid,
                             changed_blocks, info.exponent_bits, changes_per_block.data());
      apply_fine_to_cache(again);
      break;
    }
    case ExponentSection::kUnchanged:
      break;
  }
  has_cache = true;
  epoch = h.epoch;
  last_sequence = h.sequence;
  return stats;
}

ShardDecoder::ShardDecoder(const CodecConfig& config, uint64_t num_values)
    : impl_(std::make_unique<Impl>(config, num_values)) {}
ShardDecoder::~ShardDecoder() = default;
ShardDecoder::ShardDecoder(ShardDecoder&&) noexcept = default;
ShardDecoder& ShardDecoder::operator=(ShardDecoder&&) noexcept = default;

FrameStats ShardDecoder::decode(std::span<const std::byte> payload, std::span<std::byte> shard) {
  const uint64_t expected = impl_->grid.num_values * impl_->info.value_bytes;
  if (shard.size() != expected) {
    throw std::invalid_argument("ShardDecoder::decode: output is " + std::to_string(shard.size()) +
                                " bytes, expected " + std::to_string(expected));
  }
  return impl_->decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(),
                       reinterpret_cast<uint8_t*>(shard.data()));
}

void ShardDecoder::reset() {
  impl_->has_cache = false;
  impl_->epoch = 0;
  impl_->last_sequence = 0;
}

bool ShardDecoder::has_cache() const { return impl_->has_cache; }
uint32_t ShardDecoder::epoch() const { return impl_->epoch; }
uint64_t ShardDecoder::last_sequence() const { return impl_->last_sequence; }
uint64_t ShardDecoder::num_values() const { return impl_->grid.num_values; }
const CodecConfig& ShardDecoder::config() const { return impl_->config; }
size_t ShardDecoder::cache_bytes() const { return impl_->cache.size(); }
std::span<const uint8_t> ShardDecoder::cached_exponents() const { return impl_->cache; }

}  // namespace ciera
