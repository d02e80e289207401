// Warmup statistics for selection: q_i, the fraction of a shard's blocks whose exponents change
// from one step to the next (paper §3.2, "offline-measured block change rate"), measured online
// on the shards as they are about to be gathered; and, for the delta policy, how many values
// change and what their value-delta section would cost.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "ciera/error.hpp"
#include "ciera/selection.hpp"
#include "codec/differences.hpp"
#include "codec/wire.hpp"
#include "common/checked.hpp"
#include "format/planes.hpp"
#include "selection/agreement.hpp"

namespace ciera {
namespace {

// ---- Value-delta estimate -----------------------------------------------------------------------
// A value-delta section (docs/format.md, "Value-delta frames") codes every value's zigzagged
// difference as a class (0, 1, 2, or 3 = escape) three to a group symbol, each escape's bucket as
// a symbol and its extra bits raw. The estimate is the order-0 entropy of the two symbol streams
// of the real groups and escapes (what rANS approaches) plus the extra bits, plus what rANS and
// the streams cost beyond entropy, measured with the codec on BF16/FP32 shards of 3*10^4 to
// 3*10^6 values at 10^-4 to 100% changes (the estimate is within a few percent there, and is
// checked against real frames in tests/test_selection_delta.cpp):
//  * kFloorBitsPerValue: the cost of the nearly certain "no change" group symbol, whose 12-bit
//    frequency can never reach 1 (0.0013 bytes per value measured);
//  * kStreamBits: per coded stream, its header, table and final rANS states (about 64 bytes).
// A step in which no value changed costs nothing: its frame is header-only ('unchanged').
constexpr double kFloorBitsPerValue = 0.0105;
constexpr double kStreamBits = 64 * 8;

template <size_t N>
double entropy_bits(const std::array<uint64_t, N>& counts) {
  uint64_t total = 0;
  for (const uint64_t c : counts) total += c;
  double bits = 0;
  for (const uint64_t c : counts) {
    if (c) bits -= double(c) * std::log2(double(c) / double(total));
  }
  return bits;
}

// The section estimate of one shard, fed its values against their previous ones in pieces of a
// multiple of kGroupValues values (so groups fall as the codec cuts them).
class SectionEstimate {
 public:
  template <typename U>
  void add(const U* now, const U* before, uint64_t n) {
    using codec::kEscapeClass;
    for (uint64_t first = 0; first < n; first += codec::kGroupValues) {
      unsigned symbol = 0;
      for (unsigned j = 0; j < codec::kGroupValues && first + j < n; ++j) {
        const U z = codec::zigzag(U(codec::to_ordered(now[first + j]) - codec::to_ordered(before[first + j])));
        changed_ += z != 0;
        const uint32_t cls = std::min<uint32_t>(z, kEscapeClass);
        symbol |= cls << (2 * j);
        if (cls == kEscapeClass) {
          const unsigned bucket = codec::escape_bucket(uint32_t(z) - kEscapeClass);
          ++buckets_[bucket];
          extra_bits_ += codec::escape_extra_bits(bucket);
        }
      }
      ++groups_[symbol];
    }
    values_ += n;
  }
  uint64_t changed() const { return changed_; }
  uint64_t bits() const {
    if (changed_ == 0) return 0;
    const bool escapes = std::any_of(buckets_.begin(), buckets_.end(), [](uint64_t c) { return c != 0; });
    const double bits = entropy_bits(groups_) + entropy_bits(buckets_) + double(extra_bits_) +
                        kFloorBitsPerValue * double(values_) + kStreamBits * (escapes ? 2 : 1);
    return uint64_t(std::ceil(bits));
  }

 private:
  std::array<uint64_t, uint64_t{1} << codec::kGroupSymbolBits> groups_{};
  std::array<uint64_t, codec::kMaxEscapeBucket + 1> buckets_{};
  uint64_t extra_bits_ = 0, changed_ = 0, values_ = 0;
};

// Copies (the input may be unaligned) through fixed buffers: no allocation per observation.
template <typename U>
void estimate_shard(const std::byte* now, const std::byte* before, uint64_t n, ShardChangeCounts& c) {
  constexpr uint64_t kPiece = codec::kGroupValues * 1024;
  std::array<U, kPiece> a, b;
  SectionEstimate estimate;
  for (uint64_t first = 0; first < n; first += kPiece) {
    const uint64_t count = std::min(kPiece, n - first);
    std::memcpy(a.data(), now + first * sizeof(U), count * sizeof(U));
    std::memcpy(b.data(), before + first * sizeof(U), count * sizeof(U));
    estimate.add(a.data(), b.data(), count);
  }
  c.changed_patterns += estimate.changed();
  c.value_delta_bits += estimate.bits();
}

}  // namespace

double expected_delta_payload_bytes(uint64_t values, double section_bits_per_value) {
  if (!std::isfinite(section_bits_per_value)) {
    throw ConfigError("expected_delta_payload_bytes: section_bits_per_value must be finite, got " +
                      std::to_string(section_bits_per_value));
  }
  if (values == 0) return 0;
  return double(wire::kHeaderBytes) + double(values) * std::max(0.0, section_bits_per_value) / 8;
}

void ShardChangeCounts::merge(const ShardChangeCounts& other) {
  // Every rank observes the same steps: the observation count is shared, not summed.
  observations = std::max(observations, other.observations);
  values += other.values;
  blocks += other.blocks;
  changed_values += other.changed_values;
  changed_blocks += other.changed_blocks;
  changed_patterns += other.changed_patterns;
  value_delta_bits += other.value_delta_bits;
}

ChangeMonitor::ChangeMonitor(DType dtype, std::vector<uint64_t> shard_values, uint32_t block_values,
                             bool track_values)
    : dtype_(dtype),
      shard_values_(std::move(shard_values)),
      block_values_(block_values),
      track_values_(track_values) {
  if (block_values_ == 0) throw ConfigError("ChangeMonitor: block_values must be positive");
  // Checked: a wrapped total would pass observe()'s size check and walk past its buffer.
  const std::optional<uint64_t> total =
      checked_scaled_sum(shard_values_, dtype_info(dtype_).value_bytes);
  if (!total) throw ConfigError("ChangeMonitor: the shards are more than 2^64 - 1 bytes");
  const uint64_t values = *total / dtype_info(dtype_).value_bytes;
  previous_.resize(values);
  current_.resize(values);
  if (track_values_) previous_values_.resize(*total);
  counts_.resize(shard_values_.size());
}

// Per shard: values whose bit pattern changed, and the estimated value-delta section.
void ChangeMonitor::count_value_changes(std::span<const std::byte> shards) {
  const uint32_t value_bytes = dtype_info(dtype_).value_bytes;
  uint64_t offset = 0;
  for (size_t p = 0; p < shard_values_.size(); ++p) {
    const uint64_t n = shard_values_[p];
    const std::byte* now = shards.data() + offset * value_bytes;
    const std::byte* before = previous_values_.data() + offset * value_bytes;
    if (value_bytes == 2) {
      estimate_shard<uint16_t>(now, before, n, counts_[p]);
    } else {
      estimate_shard<uint32_t>(now, before, n, counts_[p]);
    }
    offset += n;
  }
}

void ChangeMonitor::observe(std::span<const std::byte> shards) {
  const size_t value_bytes = dtype_info(dtype_).value_bytes;
  if (shards.size() != previous_.size() * value_bytes) {
    throw ConfigError("ChangeMonitor: got " + std::to_string(shards.size()) + " bytes, expected " +
                      std::to_string(previous_.size() * value_bytes));
  }
  const format::PlaneKernels& k = format::kernels();
  const auto* values = reinterpret_cast<const uint8_t*>(shards.data());
  for (size_t first = 0; first < current_.size(); first += format::kMaxChunkValues) {
    const size_t count = std::min(format::kMaxChunkValues, current_.size() - first);
    format::extract_exponents(dtype_, k, values + first * value_bytes, count, current_.data() + first);
  }
  if (primed_ && track_values_) count_value_changes(shards);
  if (track_values_ && !shards.empty()) std::memcpy(previous_values_.data(), shards.data(), shards.size());
  if (primed_) {
    uint64_t offset = 0;
    for (size_t p = 0; p < shard_values_.size(); ++p) {
      const uint64_t n = shard_values_[p];
      ShardChangeCounts& c = counts_[p];
      c.observations += 1;
      c.values += n;
      for (uint64_t b = 0; b < n; b += block_values_) {
        const uint64_t len = std::min<uint64_t>(block_values_, n - b);
        const uint8_t* now = current_.data() + offset + b;
        const uint8_t* before = previous_.data() + offset + b;
        c.blocks += 1;
        if (std::memcmp(now, before, len) == 0) continue;  // the common case after warmup
        c.changed_blocks += 1;
        for (uint64_t i = 0; i < len; ++i) c.changed_values += now[i] != before[i];
      }
      offset += n;
    }
  }
  previous_.swap(current_);
  primed_ = true;
}

void ChangeMonitor::clear_counts() { std::fill(counts_.begin(), counts_.end(), ShardChangeCounts{}); }

void merge_counts_across_ranks(Transport& transport, std::vector<ShardChangeCounts>& counts) {
  const uint64_t shards = counts.size();
  selection::agree_on_arguments(transport, "merge_counts_across_ranks", {&shards, 1});
  constexpr size_t kFields = 7;
  const size_t world = static_cast<size_t>(transport.size());
  std::vector<uint64_t> mine;
  mine.reserve(counts.size() * kFields);
  for (const ShardChangeCounts& c : counts) {
    mine.insert(mine.end(), {c.observations, c.values, c.blocks, c.changed_values, c.changed_blocks,
                             c.changed_patterns, c.value_delta_bits});
  }
  std::vector<uint64_t> all(mine.size() * world);
  transport.allgather(mine.data(), mine.size() * sizeof(uint64_t), all.data());
  for (ShardChangeCounts& c : counts) c = {};
  for (size_t r = 0; r < world; ++r) {
    for (size_t p = 0; p < counts.size(); ++p) {
      const uint64_t* f = all.data() + (r * counts.size() + p) * kFields;
      counts[p].merge({f[0], f[1], f[2], f[3], f[4], f[5], f[6]});
    }
  }
}

}  // namespace ciera
