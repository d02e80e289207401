// Three-way selection (raw, ciera, delta) under a cache budget, and the statistics behind the
// delta policy's estimate: the change monitor's value tracking, checked against real value-delta
// frames of the codec.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/selection.hpp"

namespace ciera {
namespace {

// Comm(bytes) = latency + bytes / (100 MB/s), exactly; both codecs at 10 GB/s.
CostModel linear_model(int world, double latency_s = 1e-7) {
  CostModel model;
  model.world_size = world;
  model.allgather = CommCurve::fit({{0, latency_s}, {1e8, latency_s + 1.0}});
  for (CodecThroughput& t : model.codec) t = {1e10, 1e10, 1e10};
  for (CodecThroughput& t : model.delta_codec) t = {1e10, 1e10, 1e10};
  return model;
}

// A BF16 shard whose exponents change at 1% per step and whose value-delta section costs
// `delta_bits` bits per value.
ShardCandidate candidate(size_t bucket, size_t param, uint64_t values_per_rank, int world,
                         double delta_bits) {
  ShardCandidate c;
  c.bucket = bucket;
  c.param = param;
  c.name = "b" + std::to_string(bucket) + ".p" + std::to_string(param);
  c.shard_values.assign(size_t(world), values_per_rank);
  c.block_change_rate = 0.01;
  c.value_change_rate = 0.01;
  c.delta_bits_per_value = delta_bits;
  return c;
}

SelectorOptions with_delta(uint64_t budget) {
  SelectorOptions options;
  options.allow_delta = true;
  options.cache_budget_bytes = budget;
  return options;
}

TEST(SelectorDelta, AnExactSmallCaseByHand) {
  const int world = 2;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;  // values per rank
  const std::vector<ShardCandidate> shards = {candidate(0, 0, n, world, 0.5)};
  const Selection s = select_shards(shards, model, with_delta(UINT64_MAX));
  const ShardChoice& c = s.shards[0];
  // Delta: per rank the 80-byte header and n * 0.5 / 8 bytes of section; raw 2 * 2n bytes.
  const double raw = 2.0 * 2 * n;
  const double wire = 2.0 * (80 + n * 0.5 / 8);
  EXPECT_NEAR(c.delta.expected_wire_bytes, wire, 1e-9);
  EXPECT_NEAR(c.delta.comm_saved_s, (raw - wire) / 1e8, 1e-12);
  EXPECT_NEAR(c.delta.decode_s, 2.0 * n / 1e10, 1e-15);  // one peer shard
  EXPECT_NEAR(c.delta.gain_s, (raw - wire) / 1e8 - 2.0 * n / 1e10, 1e-12);
  // Both ranks keep their own values and their peer's: two bytes per value each.
  EXPECT_EQ(c.delta.memory_bytes, 2 * 2 * n);
  EXPECT_EQ(c.memory_bytes, 2 * n);  // ciera: a byte per exponent, own and peer's
  EXPECT_EQ(c.policy, ShardPolicy::kDelta);
  EXPECT_EQ(c.reason, "chosen: delta");
  EXPECT_EQ(c.chosen_memory_bytes, 4 * n);
  EXPECT_DOUBLE_EQ(c.chosen_gain_s, c.delta.gain_s);
  EXPECT_EQ(s.cache_bytes, 4 * n);
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kDelta);
  EXPECT_EQ(s.count(ShardPolicy::kDelta), 1u);
  EXPECT_NEAR(expected_delta_payload_bytes(n, 0.5), 80 + n * 0.5 / 8, 1e-9);
  EXPECT_EQ(expected_delta_payload_bytes(0, 0.5), 0);
}

// FSDP2 gathers a layer again in backward with nothing changed since forward: a delta frame of a
// header only, but exponent reuse's sign and mantissa again. The per-step estimate adds it.
TEST(SelectorDelta, ARegatherCostsDeltaAHeaderAndExponentReuseItsMantissas) {
  const int world = 2;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;
  ShardCandidate once = candidate(0, 0, n, world, 0.5);
  ShardCandidate twice = once;
  twice.regathers = 1;
  const Selection a = select_shards(std::vector{once}, model, with_delta(UINT64_MAX));
  const Selection b = select_shards(std::vector{twice}, model, with_delta(UINT64_MAX));
  const ShardChoice& x = a.shards[0];
  const ShardChoice& y = b.shards[0];
  const double raw = 2.0 * 2 * n;
  const double header_only = 2.0 * 80;
  EXPECT_NEAR(y.delta.expected_wire_bytes, x.delta.expected_wire_bytes + header_only, 1e-9);
  EXPECT_NEAR(y.delta.comm_saved_s, x.delta.comm_saved_s + (raw - header_only) / 1e8, 1e-12);
  EXPECT_NEAR(y.delta.decode_s, 2 * x.delta.decode_s, 1e-15);
  const double er_again = 2 * expected_payload_bytes(CodecConfig{}, DType::kBF16, n, 0.0, 0.0);
  EXPECT_NEAR(y.expected_wire_bytes, x.expected_wire_bytes + er_again, 1e-9);
  EXPECT_NEAR(y.comm_saved_s, x.comm_saved_s + (raw - er_again) / 1e8, 1e-12);
  EXPECT_GT(er_again, raw / 2.1);  // the mantissas again: about half the raw bytes
  // Memory is the same; the gains are per step, and delta's grows by more.
  EXPECT_EQ(y.delta.memory_bytes, x.delta.memory_bytes);
  EXPECT_EQ(y.memory_bytes, x.memory_bytes);
  EXPECT_GT(y.delta.gain_s - x.delta.gain_s, 1.8 * (y.gain_s - x.gain_s));
}

// A costly delta section (10 bits per value) gains less per gather than exponent reuse's 8 bits
// and a few exponents: with one gather per step exponent reuse is chosen, even with room for
// delta's cache. Counting the backward re-gather (a header for delta, the mantissas again for
// exponent reuse) turns the choice to delta.
TEST(SelectorDelta, CountingTheRegatherCanTurnTheChoiceToDelta) {
  const int world = 2;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;
  ShardCandidate c = candidate(0, 0, n, world, 10.0);
  const Selection once = select_shards(std::vector{c}, model, with_delta(UINT64_MAX));
  EXPECT_EQ(once.shards[0].policy, ShardPolicy::kCiera);
  EXPECT_LT(once.shards[0].delta.gain_s, once.shards[0].gain_s);
  c.regathers = 1;
  const Selection twice = select_shards(std::vector{c}, model, with_delta(UINT64_MAX));
  EXPECT_EQ(twice.shards[0].policy, ShardPolicy::kDelta);
  EXPECT_GT(twice.shards[0].delta.gain_s, twice.shards[0].gain_s);
}

TEST(SelectorDelta, DeltaWhenTheBudgetAllowsCieraWhenItAllowsAByteRawWhenNothingPays) {
  const int world = 4;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;
  const std::vector<ShardCandidate> shards = {candidate(0, 0, n, world, 0.2)};
  const uint64_t values = world * n;  // on the rank that holds the most: own + peers'
  EXPECT_EQ(select_shards(shards, model, with_delta(2 * values)).policy(0, 0), ShardPolicy::kDelta);
  EXPECT_EQ(select_shards(shards, model, with_delta(2 * values - 1)).policy(0, 0), ShardPolicy::kCiera);
  EXPECT_EQ(select_shards(shards, model, with_delta(values)).policy(0, 0), ShardPolicy::kCiera);
  const Selection none = select_shards(shards, model, with_delta(values - 1));
  EXPECT_EQ(none.policy(0, 0), ShardPolicy::kRaw);
  EXPECT_EQ(none.shards[0].reason, "over budget");
  // Nothing pays where the codec is slower than the link saves: every policy raw, and why.
  CostModel slow = linear_model(world);
  for (CodecThroughput& t : slow.codec) t = {1e6, 1e6, 1e6};
  for (CodecThroughput& t : slow.delta_codec) t = {1e6, 1e6, 1e6};
  const Selection raw = select_shards(shards, slow, with_delta(UINT64_MAX));
  EXPECT_EQ(raw.policy(0, 0), ShardPolicy::kRaw);
  EXPECT_NE(raw.shards[0].reason.find("no gain"), std::string::npos) << raw.shards[0].reason;
  EXPECT_NE(raw.shards[0].delta.unavailable.find("no gain"), std::string::npos);
}

TEST(SelectorDelta, OffByDefaultAndUnmeasuredShardsKeepTheTwoWayChoice) {
  const int world = 2;
  const CostModel model = linear_model(world);
  std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 16, world, 0.1),
                                        candidate(0, 1, 1 << 16, world, -1)};
  SelectorOptions options;  // allow_delta off
  const Selection two_way = select_shards(shards, model, options);
  EXPECT_EQ(two_way.policy(0, 0), ShardPolicy::kCiera);
  EXPECT_EQ(two_way.shards[0].delta.unavailable, "delta not allowed");
  const Selection three_way = select_shards(shards, model, with_delta(UINT64_MAX));
  EXPECT_EQ(three_way.policy(0, 0), ShardPolicy::kDelta);
  EXPECT_EQ(three_way.policy(0, 1), ShardPolicy::kCiera);  // its value changes were not measured
  EXPECT_EQ(three_way.shards[1].delta.unavailable, "value changes not measured");
  // Without value-delta throughput the delta policy is not an option either.
  CostModel no_delta = model;
  for (CodecThroughput& t : no_delta.delta_codec) t = {};
  EXPECT_EQ(select_shards(shards, no_delta, with_delta(UINT64_MAX)).policy(0, 0), ShardPolicy::kCiera);
}

TEST(SelectorDelta, UpgradesGoWhereTheyGainMostPerByte) {
  // Two equal shards, a budget for one delta and one ciera: the upgrade of either is worth the
  // same, and ties go to the first parameter. A cheap ciera shard is never starved for an
  // expensive delta one: with room for two ciera shards, both go ciera.
  const int world = 2;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;
  const std::vector<ShardCandidate> shards = {candidate(0, 0, n, world, 0.3),
                                              candidate(0, 1, n, world, 0.3)};
  const uint64_t ciera = world * n, delta = 2 * world * n;
  Selection s = select_shards(shards, model, with_delta(delta + ciera));
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kDelta);
  EXPECT_EQ(s.policy(0, 1), ShardPolicy::kCiera);
  EXPECT_EQ(s.cache_bytes, delta + ciera);
  s = select_shards(shards, model, with_delta(2 * ciera));
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kCiera);
  EXPECT_EQ(s.policy(0, 1), ShardPolicy::kCiera);
}

TEST(SelectorDelta, DeltaOffTheHullStillTakesLeftoverBudget) {
  // A shard whose delta gain per byte is below ciera's, and another whose ciera option is worse
  // per byte than its delta: each goes as far as the budget allows.
  const int world = 2;
  const CostModel model = linear_model(world);
  const uint64_t n = 1 << 16;
  ShardCandidate a = candidate(0, 0, n, world, 7.9);  // delta barely beats ciera
  ShardCandidate b = candidate(0, 1, n, world, 0.01);
  b.value_change_rate = b.block_change_rate = 0.4;    // exponents churn: ciera gains little
  const Selection s = select_shards(std::vector{a, b}, model, with_delta(UINT64_MAX));
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kDelta);
  EXPECT_EQ(s.policy(0, 1), ShardPolicy::kDelta);
}

// Randomised: many shard sets and budgets; the budget is never exceeded, the cache is the sum of
// the chosen policies' memory, and no single upgrade left over would still fit (the leftover
// pass makes the result maximal).
TEST(SelectorDelta, RandomShardSetsNeverExceedTheBudget) {
  std::mt19937_64 rng(2024);
  std::map<ShardPolicy, int> seen;
  int over_budget = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int world = 1 + int(rng() % 5);
    CostModel model = linear_model(world, 1e-7 * double(rng() % 1000));
    std::vector<ShardCandidate> shards;
    const size_t count = 1 + rng() % 12;
    for (size_t k = 0; k < count; ++k) {
      ShardCandidate c;
      c.bucket = rng() % 3;
      c.param = k;
      c.name = "p" + std::to_string(k);
      c.dtype = std::array{DType::kBF16, DType::kFP16, DType::kFP32}[rng() % 3];
      for (int r = 0; r < world; ++r) c.shard_values.push_back(rng() % 4 == 0 ? 0 : rng() % 200000);
      c.block_change_rate = std::uniform_real_distribution<double>(0, 1)(rng);
      c.value_change_rate = c.block_change_rate * std::uniform_real_distribution<double>(0, 1)(rng);
      c.delta_bits_per_value = rng() % 5 == 0 ? -1 : std::uniform_real_distribution<double>(0, 20)(rng);
      shards.push_back(c);
    }
    const uint64_t budget = rng() % 4 == 0 ? UINT64_MAX : rng() % 3000000;
    const Selection s = select_shards(shards, model, with_delta(budget));
    uint64_t used = 0;
    for (const ShardChoice& c : s.shards) {
      const uint64_t expected = c.policy == ShardPolicy::kRaw     ? 0
                                : c.policy == ShardPolicy::kCiera ? c.memory_bytes
                                                                  : c.delta.memory_bytes;
      EXPECT_EQ(c.chosen_memory_bytes, expected);
      EXPECT_EQ(c.chosen, c.policy != ShardPolicy::kRaw);
      if (c.policy == ShardPolicy::kCiera) {
        EXPECT_GT(c.gain_s, 0);
      }
      if (c.policy == ShardPolicy::kDelta) {
        EXPECT_GT(c.delta.gain_s, 0);
      }
      EXPECT_EQ(s.policy(c.shard.bucket, c.shard.param), c.policy);
      used += c.chosen_memory_bytes;
      ++seen[c.policy];
      over_budget += c.reason == "over budget";
    }
    ASSERT_EQ(used, s.cache_bytes) << "trial " << trial;
    ASSERT_LE(s.cache_bytes, budget) << "trial " << trial;
    for (const ShardChoice& c : s.shards) {
      if (c.reason.find("bucket gain") != std::string::npos) continue;  // its bucket was dropped
      const bool ciera_option = c.raw_bytes > 0 && c.gain_s > 0;
      const bool delta_option = c.delta.unavailable.empty();
      for (const auto& [option, memory, gain] : {std::tuple{ciera_option, c.memory_bytes, c.gain_s},
                                                 std::tuple{delta_option, c.delta.memory_bytes, c.delta.gain_s}}) {
        if (!option || gain <= c.chosen_gain_s) continue;
        ASSERT_GE(memory, c.chosen_memory_bytes) << "trial " << trial << ": a better and smaller option left";
        EXPECT_GT(memory - c.chosen_memory_bytes, budget - s.cache_bytes)
            << "trial " << trial << ": an upgrade of " << c.shard.name << " would still fit";
      }
    }
  }
  // The sets exercise every outcome, the budget binding included.
  EXPECT_GT(seen[ShardPolicy::kDelta], 50);
  EXPECT_GT(seen[ShardPolicy::kCiera], 50);
  EXPECT_GT(seen[ShardPolicy::kRaw], 50);
  EXPECT_GT(over_budget, 20);
}

TEST(SelectorDelta, TwoWayResultsAreUnchangedWhenDeltaIsOff) {
  // The same shards with delta measured but not allowed select exactly what they did before the
  // third choice existed: ciera by gain per byte while the budget lasts.
  const int world = 2;
  const CostModel model = linear_model(world);
  std::vector<ShardCandidate> shards;
  for (size_t p = 0; p < 6; ++p) {
    ShardCandidate c = candidate(p % 2, p, 1000 * (p + 1), world, 0.1);
    c.block_change_rate = c.value_change_rate = 0.01 * double(p);
    shards.push_back(c);
  }
  SelectorOptions options;
  options.cache_budget_bytes = 12345;
  const Selection s = select_shards(shards, model, options);
  EXPECT_LE(s.cache_bytes, 12345u);
  for (const ShardChoice& c : s.shards) {
    EXPECT_NE(c.policy, ShardPolicy::kDelta);
    EXPECT_EQ(c.chosen_memory_bytes, c.chosen ? c.memory_bytes : 0);
  }
}

// ---- The monitor's value tracking and its estimate, against the codec -------------------------

std::vector<std::byte> weights(DType dtype, uint64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> w(0, 0.02f);
  const uint32_t vb = dtype_info(dtype).value_bytes;
  std::vector<std::byte> v(n * vb);
  for (uint64_t i = 0; i < n; ++i) {
    const float f = w(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (vb == 2) {
      const uint16_t h = uint16_t(bits >> 16);
      std::memcpy(v.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(v.data() + 4 * i, &bits, 4);
    }
  }
  return v;
}

// Moves `rate` of the values by a random number of units (1 + geometric with mean `spread` - 1).
void move_values(DType dtype, std::vector<std::byte>& v, double rate, int spread, std::mt19937_64& rng) {
  const uint32_t vb = dtype_info(dtype).value_bytes;
  std::uniform_real_distribution<double> u(0, 1);
  std::geometric_distribution<int> extra(1.0 / spread);
  for (size_t i = 0; i < v.size() / vb; ++i) {
    if (u(rng) >= rate) continue;
    int d = 1 + (spread > 1 ? extra(rng) : 0);
    if (rng() & 1) d = -d;
    if (vb == 2) {
      uint16_t h;
      std::memcpy(&h, v.data() + 2 * i, 2);
      h = uint16_t(h + d);
      std::memcpy(v.data() + 2 * i, &h, 2);
    } else {
      uint32_t w;
      std::memcpy(&w, v.data() + 4 * i, 4);
      w += uint32_t(d);
      std::memcpy(v.data() + 4 * i, &w, 4);
    }
  }
}

TEST(ChangeMonitorDelta, CountsChangedBitPatternsOnlyWhenTrackingValues) {
  std::mt19937_64 rng(5);
  const std::vector<uint64_t> shards = {3000, 0, 1001};
  std::vector<std::byte> v = weights(DType::kBF16, 4001, rng);
  ChangeMonitor plain(DType::kBF16, shards, 512), tracking(DType::kBF16, shards, 512, true);
  EXPECT_EQ(plain.memory_bytes(), 4001u);
  EXPECT_EQ(tracking.memory_bytes(), 3 * 4001u);  // exponents and BF16 values
  plain.observe(v);
  tracking.observe(v);
  // Unchanged: nothing counted, no section (the frame would be header-only).
  plain.observe(v);
  tracking.observe(v);
  EXPECT_EQ(tracking.counts()[0].changed_patterns, 0u);
  EXPECT_EQ(tracking.counts()[0].value_delta_bits, 0u);
  // Values 10 and 3500 move by one unit (3500 is the second shard's... the third's 500th).
  for (const size_t i : {size_t{10}, size_t{3500}}) v[2 * i] ^= std::byte{1};
  tracking.observe(v);
  plain.observe(v);
  EXPECT_EQ(tracking.counts()[0].changed_patterns, 1u);
  EXPECT_EQ(tracking.counts()[1].changed_patterns, 0u);
  EXPECT_EQ(tracking.counts()[2].changed_patterns, 1u);
  EXPECT_GT(tracking.counts()[0].value_delta_bits, 0u);
  EXPECT_EQ(tracking.counts()[1].value_delta_bits, 0u);
  EXPECT_EQ(plain.counts()[0].changed_patterns, 0u);
  EXPECT_EQ(plain.counts()[0].value_delta_bits, 0u);
  EXPECT_EQ(tracking.counts()[0].observations, 2u);
  EXPECT_NEAR(tracking.counts()[0].pattern_change_rate(), 1.0 / 6000, 1e-12);
  // Merging sums the new counts too.
  ShardChangeCounts sum = tracking.counts()[0];
  sum.merge(tracking.counts()[2]);
  EXPECT_EQ(sum.changed_patterns, 2u);
  EXPECT_EQ(sum.value_delta_bits, tracking.counts()[0].value_delta_bits + tracking.counts()[2].value_delta_bits);
}

struct EstimateCase {
  DType dtype;
  uint64_t values;
  double rate;
  int spread;
};

class DeltaEstimate : public ::testing::TestWithParam<EstimateCase> {};

// The estimate from the monitor is close to the real value-delta frame the codec writes for the
// same step: within 10% (plus 64 bytes), so the selector's delta gains are honest.
TEST_P(DeltaEstimate, IsCloseToTheRealFrame) {
  const EstimateCase e = GetParam();
  std::mt19937_64 rng(11);
  std::vector<std::byte> v = weights(e.dtype, e.values, rng);
  CodecConfig config;
  config.dtype = e.dtype;
  config.stream_kind = StreamKind::kValueDelta;
  ShardEncoder encoder(config, e.values);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  ChangeMonitor monitor(e.dtype, {e.values}, config.block_values, true);
  monitor.observe(v);
  encoder.encode(v, payload);
  move_values(e.dtype, v, e.rate, e.spread, rng);
  monitor.observe(v);
  const double real = double(encoder.encode(v, payload).payload_bytes);
  const ShardChangeCounts& c = monitor.counts()[0];
  const double estimate = expected_delta_payload_bytes(e.values, c.delta_bits_per_value());
  EXPECT_NEAR(estimate, real, 0.10 * real + 64)
      << "values " << e.values << " rate " << e.rate << " spread " << e.spread;
}

INSTANTIATE_TEST_SUITE_P(
    Shards, DeltaEstimate,
    ::testing::Values(EstimateCase{DType::kBF16, 1 << 20, 0.0, 1}, EstimateCase{DType::kBF16, 1 << 20, 0.001, 1},
                      EstimateCase{DType::kBF16, 1 << 20, 0.03, 1}, EstimateCase{DType::kBF16, 1 << 20, 0.3, 1},
                      EstimateCase{DType::kBF16, 1 << 20, 1.0, 1}, EstimateCase{DType::kBF16, 100000, 0.05, 4},
                      EstimateCase{DType::kBF16, 1 << 20, 0.3, 64}, EstimateCase{DType::kFP16, 200000, 0.1, 2},
                      EstimateCase{DType::kFP32, 300000, 0.5, 1000}, EstimateCase{DType::kBF16, 30000, 0.01, 1}));

TEST(ChangeMonitorDelta, CountsTravelThroughMergeAcrossRanks) {
  ShardChangeCounts a{2, 100, 4, 1, 1, 7, 900};
  const ShardChangeCounts b{2, 50, 2, 0, 0, 3, 100};
  a.merge(b);
  EXPECT_EQ(a.changed_patterns, 10u);
  EXPECT_EQ(a.value_delta_bits, 1000u);
  EXPECT_DOUBLE_EQ(a.delta_bits_per_value(), 1000.0 / 150);
}

}  // namespace
}  // namespace ciera
