// Exponent-change statistics (paper §2.2-2.3; definitions in docs/analysis.md). One pass over
// the values finds the changed positions with the codec's exponent kernels; every (W, B) cell is
// then counted from those positions alone, which is cheap because after warmup only ~1% of
// values change.
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>

#include "ciera/analysis.hpp"
#include "ciera/error.hpp"
#include "format/planes.hpp"

namespace ciera {
namespace {

constexpr size_t kChunkValues = format::kMaxChunkValues;  // find_changes takes at most 65536

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

double ratio(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

void zero(ChangeCounts& c) {
  c.transitions = c.values = c.changed_values = 0;
  std::fill(c.blocks.begin(), c.blocks.end(), 0);
  std::fill(c.changed_blocks.begin(), c.changed_blocks.end(), 0);
  std::fill(c.shards.begin(), c.shards.end(), 0);
  std::fill(c.changed_shards.begin(), c.changed_shards.end(), 0);
}

// The denominators of one transition of an n-value tensor: its non-empty shards and their
// blocks. With s = ceil(n / W), n / s shards are full and one more holds the remaining n % s.
void add_population(uint64_t n, const ChangeGrid& grid, ChangeCounts& counts) {
  counts.transitions += 1;
  counts.values += n;
  if (n == 0) return;
  for (size_t w = 0; w < grid.worlds.size(); ++w) {
    const uint64_t shard_values = ceil_div(n, grid.worlds[w]);
    const uint64_t full_shards = n / shard_values;
    const uint64_t rest = n % shard_values;
    counts.shards[w] += full_shards + (rest > 0 ? 1 : 0);
    for (size_t b = 0; b < grid.block_values.size(); ++b) {
      const uint64_t block = grid.block_values[b];
      counts.blocks[grid.cell(w, b)] +=
          full_shards * ceil_div(shard_values, block) + ceil_div(rest, block);
    }
  }
}

}  // namespace

// Counts the distinct shards and blocks that a stream of changed positions, in increasing order,
// falls in, for every (W, B) cell. A position costs one comparison per cell: the shard or block
// containing it is only computed when it lies past the end of the last one counted. The cursors
// are all the state, so the stream may arrive in pieces cut anywhere (ChunkedChangeCounter): a
// block or shard that a cut splits is still counted once.
class ChangeTally {
 public:
  ChangeTally(uint64_t num_values, const ChangeGrid& grid)
      : num_values_(num_values), worlds_(grid.worlds.size()), block_end_(grid.cells(), 0) {
    for (size_t w = 0; w < worlds_.size(); ++w) {
      worlds_[w].shard_values = ceil_div(num_values, grid.worlds[w]);
    }
  }

  // `grid` is the one the tally was made for; `counts` receives the changed value, shards, blocks.
  void add(uint64_t position, const ChangeGrid& grid, ChangeCounts& counts) {
    ++counts.changed_values;
    for (size_t w = 0; w < worlds_.size(); ++w) {
      ShardCursor& shard = worlds_[w];
      if (position >= shard.end) {
        shard.begin = position / shard.shard_values * shard.shard_values;
        shard.end = std::min(num_values_, shard.begin + shard.shard_values);
        ++counts.changed_shards[w];
      }
      for (size_t b = 0; b < grid.block_values.size(); ++b) {
        const size_t cell = grid.cell(w, b);
        if (position >= block_end_[cell]) {
          const uint64_t block = grid.block_values[b];
          const uint64_t block_index = (position - shard.begin) / block;
          block_end_[cell] = std::min(shard.end, shard.begin + (block_index + 1) * block);
          ++counts.changed_blocks[cell];
        }
      }
    }
  }

 private:
  struct ShardCursor {
    uint64_t shard_values = 1;
    uint64_t begin = 0;
    uint64_t end = 0;  // one past the last value of the shard counted last
  };
  uint64_t num_values_;
  std::vector<ShardCursor> worlds_;
  std::vector<uint64_t> block_end_;  // per cell: one past the last value of the block counted last
};

namespace {

// Tallies the values [first, first + count) of a tensor whose exponent differs between `before`
// and `after` (both pointing at value `first`). The scratch lives on the stack (80 KiB), so that a
// caller feeding a tensor in many pieces allocates nothing per piece.
void tally_changes(DType dtype, const uint8_t* before, const uint8_t* after, uint64_t first,
                   uint64_t count, const ChangeGrid& grid, ChangeTally& tally,
                   ChangeCounts& counts) {
  const format::PlaneKernels& kernels = format::kernels();
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  std::array<uint8_t, kChunkValues> before_exps, after_exps, steps;
  std::array<uint16_t, kChunkValues> positions;
  for (uint64_t done = 0; done < count; done += kChunkValues) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kChunkValues, count - done));
    format::extract_exponents(dtype, kernels, before + done * value_bytes, chunk,
                              before_exps.data());
    format::extract_exponents(dtype, kernels, after + done * value_bytes, chunk, after_exps.data());
    const size_t found = kernels.find_changes(after_exps.data(), before_exps.data(), chunk,
                                              positions.data(), steps.data());
    for (size_t i = 0; i < found; ++i) tally.add(first + done + positions[i], grid, counts);
  }
}

uint64_t checked_values(DType dtype, size_t bytes, const char* what) {
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  if (bytes % value_bytes != 0) {
    throw ConfigError(std::string(what) + " holds " + std::to_string(bytes) +
                      " bytes, not a whole number of " + std::string(dtype_name(dtype)) +
                      " values");
  }
  return bytes / value_bytes;
}

}  // namespace

void ChangeGrid::validate() const {
  for (uint32_t w : worlds) {
    if (w == 0) throw ConfigError("change statistics: world size W must be at least 1");
  }
  for (uint32_t b : block_values) {
    if (b == 0) throw ConfigError("change statistics: block size B must be at least 1 value");
  }
}

ChangeCounts::ChangeCounts(const ChangeGrid& grid)
    : blocks(grid.cells(), 0),
      changed_blocks(grid.cells(), 0),
      shards(grid.worlds.size(), 0),
      changed_shards(grid.worlds.size(), 0) {}

double ChangeCounts::element_change_rate() const { return ratio(changed_values, values); }
double ChangeCounts::block_change_rate(size_t cell) const {
  return ratio(changed_blocks[cell], blocks[cell]);
}
double ChangeCounts::shard_change_rate(size_t world_index) const {
  return ratio(changed_shards[world_index], shards[world_index]);
}

ChangeCounts& ChangeCounts::operator+=(const ChangeCounts& other) {
  if (other.changed_blocks.size() != other.blocks.size() ||
      other.changed_shards.size() != other.shards.size()) {
    throw ConfigError("ChangeCounts: counts whose changed and total cells differ in number");
  }
  if (blocks.empty() && shards.empty()) {
    blocks.resize(other.blocks.size(), 0);
    changed_blocks.resize(other.changed_blocks.size(), 0);
    shards.resize(other.shards.size(), 0);
    changed_shards.resize(other.changed_shards.size(), 0);
  }
  // Counts of another grid (other block or world sizes) would be added past the end of these:
  // refused in every build, not only where asserts are compiled in.
  if ((!other.blocks.empty() && other.blocks.size() != blocks.size()) ||
      (!other.shards.empty() && other.shards.size() != shards.size())) {
    throw ConfigError(
        "ChangeCounts: cannot add counts of another grid (" + std::to_string(other.blocks.size()) +
        " block cells and " + std::to_string(other.shards.size()) + " shard cells to " +
        std::to_string(blocks.size()) + " and " + std::to_string(shards.size()) + ")");
  }
  transitions += other.transitions;
  values += other.values;
  changed_values += other.changed_values;
  for (size_t i = 0; i < other.blocks.size(); ++i) {
    blocks[i] += other.blocks[i];
    changed_blocks[i] += other.changed_blocks[i];
  }
  for (size_t i = 0; i < other.shards.size(); ++i) {
    shards[i] += other.shards[i];
    changed_shards[i] += other.changed_shards[i];
  }
  return *this;
}

ChangeCounts count_exponent_changes(DType dtype, std::span<const std::byte> before,
                                    std::span<const std::byte> after, const ChangeGrid& grid) {
  grid.validate();
  const uint64_t n = checked_values(dtype, before.size(), "the earlier snapshot");
  if (after.size() != before.size()) {
    throw ConfigError("snapshots differ in size: " + std::to_string(before.size()) + " and " +
                      std::to_string(after.size()) + " bytes");
  }
  ChunkedChangeCounter counter(dtype, n, grid);
  counter.add(before, after);
  return counter.counts();
}

ChunkedChangeCounter::ChunkedChangeCounter(DType dtype, uint64_t num_values, ChangeGrid grid)
    : dtype_(dtype), num_values_(num_values), grid_(std::move(grid)), counts_(grid_) {
  grid_.validate();
  add_population(num_values_, grid_, counts_);
  tally_ = std::make_unique<ChangeTally>(num_values_, grid_);
}

ChunkedChangeCounter::~ChunkedChangeCounter() = default;
ChunkedChangeCounter::ChunkedChangeCounter(ChunkedChangeCounter&& other) noexcept = default;
ChunkedChangeCounter& ChunkedChangeCounter::operator=(ChunkedChangeCounter&& other) noexcept =
    default;

void ChunkedChangeCounter::add(std::span<const std::byte> before,
                               std::span<const std::byte> after) {
  if (after.size() != before.size()) {
    throw ConfigError("chunked change counter: pieces of " + std::to_string(before.size()) +
                      " and " + std::to_string(after.size()) + " bytes differ in size");
  }
  const uint64_t count = checked_values(dtype_, before.size(), "a piece");
  if (count > num_values_ - values_added_) {
    throw ConfigError("chunked change counter: values [" + std::to_string(values_added_) + ", " +
                      std::to_string(values_added_ + count) + ") reach past the " +
                      std::to_string(num_values_) + " values of the tensor");
  }
  tally_changes(dtype_, reinterpret_cast<const uint8_t*>(before.data()),
                reinterpret_cast<const uint8_t*>(after.data()), values_added_, count, grid_,
                *tally_, counts_);
  values_added_ += count;
}

const ChangeCounts& ChunkedChangeCounter::counts() const {
  if (values_added_ != num_values_) {
    throw ConfigError("chunked change counter: " + std::to_string(values_added_) + " of " +
                      std::to_string(num_values_) + " values added, the counts are not complete");
  }
  return counts_;
}

ExponentChangeCounter::ExponentChangeCounter(DType dtype, uint64_t num_values, ChangeGrid grid,
                                             uint32_t warmup_steps)
    : dtype_(dtype),
      num_values_(num_values),
      grid_(std::move(grid)),
      warmup_steps_(warmup_steps),
      exponents_(num_values),
      last_(grid_),
      total_(grid_) {
  grid_.validate();
}

const ChangeCounts& ExponentChangeCounter::observe(std::span<const std::byte> values) {
  const uint32_t value_bytes = dtype_info(dtype_).value_bytes;
  if (values.size() != num_values_ * value_bytes) {
    throw ConfigError("exponent change counter: expected " + std::to_string(num_values_) + " " +
                      std::string(dtype_name(dtype_)) + " values (" +
                      std::to_string(num_values_ * value_bytes) + " bytes), got " +
                      std::to_string(values.size()) + " bytes");
  }
  const format::PlaneKernels& kernels = format::kernels();
  const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
  zero(last_);
  if (!have_baseline_) {
    format::extract_exponents(dtype_, kernels, bytes, num_values_, exponents_.data());
    have_baseline_ = true;
    return last_;
  }
  add_population(num_values_, grid_, last_);
  ChangeTally tally(num_values_, grid_);
  std::array<uint8_t, kChunkValues> now, steps;
  std::array<uint16_t, kChunkValues> positions;
  for (uint64_t first = 0; first < num_values_; first += kChunkValues) {
    const size_t count = static_cast<size_t>(std::min<uint64_t>(kChunkValues, num_values_ - first));
    format::extract_exponents(dtype_, kernels, bytes + first * value_bytes, count, now.data());
    uint8_t* previous = exponents_.data() + first;
    const size_t found =
        kernels.find_changes(now.data(), previous, count, positions.data(), steps.data());
    for (size_t i = 0; i < found; ++i) {
      tally.add(first + positions[i], grid_, last_);
      previous[positions[i]] = now[positions[i]];
    }
  }
  changed_values_per_step_.push_back(last_.changed_values);
  if (transitions() > warmup_steps_) total_ += last_;
  return last_;
}

ChangeStatistics::ChangeStatistics(ChangeGrid grid, uint32_t warmup_steps)
    : grid_(std::move(grid)),
      warmup_steps_(warmup_steps),
      empty_(grid_),
      total_(grid_),
      total_by_type_(kShardTypeCount, ChangeCounts(grid_)) {
  grid_.validate();
}

namespace {

// The index of `type` among the per-type counts; ConfigError naming `who` for a value outside
// the enumeration (an integer cast to ShardType).
size_t type_index(ShardType type, const char* who) {
  if (static_cast<size_t>(type) >= kShardTypeCount) {
    throw ConfigError(std::string(who) + ": unknown shard type " +
                      std::to_string(static_cast<int>(type)));
  }
  return static_cast<size_t>(type);
}

}  // namespace

void ChangeStatistics::add(uint32_t step, ShardType type, const ChangeCounts& counts) {
  if (step < 1) throw ConfigError("ChangeStatistics::add: steps count from 1, got 0");
  type_index(type, "ChangeStatistics::add");
  while (per_step_.size() < step) {
    per_step_.emplace_back(grid_);
    per_step_by_type_.emplace_back(kShardTypeCount, ChangeCounts(grid_));
  }
  per_step_[step - 1] += counts;
  per_step_by_type_[step - 1][static_cast<size_t>(type)] += counts;
  if (step > warmup_steps_) {
    total_ += counts;
    total_by_type_[static_cast<size_t>(type)] += counts;
  }
}

const ChangeCounts& ChangeStatistics::step(uint32_t step) const {
  return step >= 1 && step <= per_step_.size() ? per_step_[step - 1] : empty_;
}

const ChangeCounts& ChangeStatistics::step(uint32_t step, ShardType type) const {
  const size_t index = type_index(type, "ChangeStatistics::step");
  return step >= 1 && step <= per_step_.size() ? per_step_by_type_[step - 1][index] : empty_;
}

const ChangeCounts& ChangeStatistics::total(ShardType type) const {
  return total_by_type_[type_index(type, "ChangeStatistics::total")];
}

}  // namespace ciera
