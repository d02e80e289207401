// Benefit-driven selection (paper §3.2) with synthetic costs, the Comm() curve, the change monitor
// and the measured cost model on the loopback transport.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/loopback.hpp"
#include "ciera/selection.hpp"
#include "rank_threads.hpp"

namespace ciera {
namespace {

// Comm(bytes) = latency + bytes / (100 MB/s), exactly, for hand-computed gains.
CostModel linear_model(int world, double latency_s = 1e-3) {
  CostModel model;
  model.world_size = world;
  model.allgather = CommCurve::fit({{0, latency_s}, {1e8, latency_s + 1.0}});
  for (CodecThroughput& t : model.codec) t = {1e10, 1e10, 1e10};  // 10 GB/s
  return model;
}

ShardCandidate candidate(size_t bucket, size_t param, uint64_t values_per_rank, int world, double q) {
  ShardCandidate c;
  c.bucket = bucket;
  c.param = param;
  c.name = "b" + std::to_string(bucket) + ".p" + std::to_string(param);
  c.type = "expert_ffn";
  c.shard_values.assign(size_t(world), values_per_rank);
  c.block_change_rate = q;
  c.value_change_rate = q;  // one change per changed block: block mode is the smaller here
  return c;
}

TEST(CommCurve, InterpolatesAndExtrapolates) {
  const CommCurve curve = CommCurve::fit({{1000, 2e-3}, {3000, 4e-3}, {2000, 3e-3}});
  EXPECT_NEAR(curve.alpha_s(), 1e-3, 1e-12);
  EXPECT_NEAR(curve.bytes_per_s(), 1e6, 1e-3);
  EXPECT_NEAR(curve.seconds(1500), 2.5e-3, 1e-12);
  EXPECT_NEAR(curve.seconds(5000), 6e-3, 1e-12);  // beyond the samples: the fitted slope
  EXPECT_NEAR(curve.seconds(0), 1e-3, 1e-12);     // below: never under the latency
}

// A curve needs two distinct sizes: a model whose buckets are all 4 KiB or less (a small MLP) used
// to be probed at 4 KiB alone, and the start-up measurement failed in CommCurve::fit.
TEST(CommCurve, DefaultProbeSizesAreAtLeastTwoAndReachTheLargest) {
  EXPECT_EQ(default_probe_sizes(100), (std::vector<uint64_t>{4096, 16384}));
  EXPECT_EQ(default_probe_sizes(16384), (std::vector<uint64_t>{4096, 16384}));
  EXPECT_EQ(default_probe_sizes(100000), (std::vector<uint64_t>{4096, 16384, 65536, 100000}));
  for (const uint64_t largest : {uint64_t{0}, uint64_t{4096}, uint64_t{1} << 20, uint64_t{3} << 30}) {
    const std::vector<uint64_t> sizes = default_probe_sizes(largest);
    ASSERT_GE(sizes.size(), 2u) << largest;
    EXPECT_TRUE(std::is_sorted(sizes.begin(), sizes.end()) &&
                std::adjacent_find(sizes.begin(), sizes.end()) == sizes.end())
        << largest;
    EXPECT_GE(sizes.back(), largest);
  }
  const std::unique_ptr<Transport> alone = make_loopback_transport(make_loopback_world(1), 0);
  const DType bf16[] = {DType::kBF16};
  EXPECT_NO_THROW(measure_cost_model(*alone, 2000, bf16, CodecConfig{}, 1));
}

TEST(CommCurve, NoisySamplesGiveAMonotoneCurve) {
  const CommCurve curve = CommCurve::fit({{1000, 5e-3}, {2000, 3e-3}, {4000, 8e-3}});
  EXPECT_GE(curve.seconds(2000), curve.seconds(1000));
  EXPECT_GE(curve.seconds(3000), curve.seconds(2000));
}

// A fast first sample under latency-bound noisy ones: the fitted latency lies above the first
// sample, and sizes below it must still not be modelled slower than it.
TEST(CommCurve, IsMonotoneBelowAFastFirstSample) {
  const CommCurve curve =
      CommCurve::fit({{4096, 1e-4}, {16384, 5e-3}, {65536, 5.2e-3}, {262144, 5.5e-3}});
  ASSERT_GT(curve.alpha_s(), 1e-4);
  double previous = 0;
  for (double bytes = 0; bytes <= 400000; bytes += 256) {
    const double t = curve.seconds(bytes);
    EXPECT_GE(t, previous) << bytes << " bytes";
    previous = t;
  }
  EXPECT_EQ(curve.seconds(1000), 1e-4);
}

TEST(CommCurve, RejectsBadSamples) {
  EXPECT_THROW(CommCurve::fit({{1000, 1e-3}}), ConfigError);
  EXPECT_THROW(CommCurve::fit({{1000, 1e-3}, {1000, 2e-3}}), ConfigError);
  try {
    CommCurve::fit({{1000, -1}, {2000, 1e-3}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("negative"), std::string::npos);
  }
}

TEST(Selector, GainMatchesTheFormulaByHand) {
  const int world = 4;
  const CostModel model = linear_model(world);
  SelectorOptions options;
  const uint64_t n = 1 << 20;  // values per rank
  const std::vector<ShardCandidate> shards = {candidate(0, 0, n, world, 0.01)};
  const Selection s = select_shards(shards, model, options);
  ASSERT_EQ(s.shards.size(), 1u);
  const ShardChoice& c = s.shards[0];
  // BF16: S_i = 4 * 2n; per rank S_sm = n, q S_e = 0.01 n, and the 80-byte header with the
  // n / 512 / 8 = 256-byte bitmap, padded to a multiple of 64 (docs/format.md): 384 bytes.
  const double raw = 4.0 * 2 * n;
  const double wire = 4.0 * (384 + n + 0.01 * n);
  EXPECT_DOUBLE_EQ(c.raw_bytes, raw);
  EXPECT_NEAR(c.expected_wire_bytes, wire, 1e-6);
  EXPECT_NEAR(c.comm_saved_s, (raw - wire) / 1e8, 1e-9);
  EXPECT_NEAR(c.decode_s, 3.0 * 2 * n / 1e10, 1e-12);  // three peer shards
  EXPECT_NEAR(c.gain_s, (raw - wire) / 1e8 - 3.0 * 2 * n / 1e10, 1e-9);
  EXPECT_EQ(c.memory_bytes, 4 * n);  // own copy + three peer caches, one byte per value
  EXPECT_TRUE(c.chosen);
  EXPECT_EQ(s.cache_bytes, 4 * n);
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kCiera);
}

TEST(Selector, FineModeEstimateWhenAlmostEveryBlockHoldsAChange) {
  const int world = 4;
  const CostModel model = linear_model(world);
  ShardCandidate c = candidate(0, 0, 1 << 20, world, 0.99);
  c.value_change_rate = 0.01;  // 1% of values: ~99% of blocks of 512 hold one
  const Selection exact = select_shards(std::vector{c}, model, SelectorOptions{});
  const double n = 1 << 20;
  const double fine = 0.01 * n * kFineBytesPerChange + 0.99 * (n / 512) * kFineBytesPerBlock;
  const double head = 384;  // 80-byte header, 256-byte bitmap, padded to a multiple of 64
  EXPECT_NEAR(exact.shards[0].expected_wire_bytes, world * (head + n + fine), 1e-3);
  EXPECT_TRUE(exact.shards[0].chosen);
  SelectorOptions hash;  // hash detection codes blocks only: nearly the raw size, no gain
  hash.codec.detection = ChangeDetection::kHash;
  const Selection blocks = select_shards(std::vector{c}, model, hash);
  EXPECT_NEAR(blocks.shards[0].expected_wire_bytes, world * (head + n + 0.99 * n), 1e-3);
}

TEST(Selector, HighChangeShardsAreSkipped) {
  const int world = 4;
  CostModel model = linear_model(world);
  for (CodecThroughput& t : model.codec) t = {1e9, 1e9, 1e9};
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 16, world, 0.005),
                                              candidate(0, 1, 1 << 16, world, 1.0)};
  const Selection s = select_shards(shards, model, SelectorOptions{});
  EXPECT_TRUE(s.shards[0].chosen);
  EXPECT_FALSE(s.shards[1].chosen);  // every block changes: the payload is as big as the raw shard
  EXPECT_LE(s.shards[1].gain_s, 0);
  EXPECT_NE(s.shards[1].reason.find("no gain"), std::string::npos);
}

TEST(Selector, BudgetIsRespectedToTheByte) {
  const int world = 2;
  const CostModel model = linear_model(world, 1e-7);  // so small shards pay their round overhead
  std::vector<ShardCandidate> shards;
  for (size_t p = 0; p < 6; ++p) shards.push_back(candidate(p % 2, p, 1000 * (p + 1), world, 0.01 * double(p)));
  for (uint64_t budget : {0ull, 1999ull, 2000ull, 5000ull, 12345ull, 100000ull}) {
    SelectorOptions options;
    options.cache_budget_bytes = budget;
    const Selection s = select_shards(shards, model, options);
    uint64_t used = 0;
    for (const ShardChoice& c : s.shards) used += c.chosen ? c.memory_bytes : 0;
    EXPECT_EQ(used, s.cache_bytes);
    EXPECT_LE(s.cache_bytes, budget) << "budget " << budget;
    if (budget == 0) {
      EXPECT_EQ(s.chosen_count(), 0u);
    }
    if (budget == 2000) {
      EXPECT_EQ(s.cache_bytes, 2000u);  // exactly the shard of 1000 values, cached on both ranks
      EXPECT_TRUE(s.shards[0].chosen);
    }
  }
}

TEST(Selector, ZeroBudgetSelectsNothingAndEveryPolicyIsRaw) {
  const CostModel model = linear_model(4);
  SelectorOptions options;
  options.cache_budget_bytes = 0;
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 20, 4, 0.0), candidate(1, 0, 1 << 20, 4, 0.0)};
  const Selection s = select_shards(shards, model, options);
  EXPECT_EQ(s.chosen_count(), 0u);
  EXPECT_EQ(s.cache_bytes, 0u);
  EXPECT_EQ(s.policy(0, 0), ShardPolicy::kRaw);
  EXPECT_EQ(s.policy(1, 0), ShardPolicy::kRaw);
}

TEST(Selector, TiesAreBrokenByBucketThenParam) {
  const CostModel model = linear_model(2);
  std::vector<ShardCandidate> shards;
  for (size_t b : {2u, 0u, 1u}) shards.push_back(candidate(b, 0, 1 << 18, 2, 0.0));
  SelectorOptions options;
  options.cache_budget_bytes = 2 * (1 << 18);  // room for exactly one
  for (int repeat = 0; repeat < 3; ++repeat) {
    const Selection s = select_shards(shards, model, options);
    EXPECT_EQ(s.chosen_count(), 1u);
    EXPECT_TRUE(s.shards[1].chosen);  // bucket 0
  }
}

TEST(Selector, RankingPrefersGainPerByte) {
  const CostModel model = linear_model(2);
  // Same size; the lower change rate saves more bytes per byte of cache.
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 18, 2, 0.5), candidate(0, 1, 1 << 18, 2, 0.01)};
  SelectorOptions options;
  options.cache_budget_bytes = 2 * (1 << 18);
  const Selection s = select_shards(shards, model, options);
  EXPECT_FALSE(s.shards[0].chosen);
  EXPECT_TRUE(s.shards[1].chosen);
  EXPECT_EQ(s.shards[0].reason, "over budget");
}

TEST(Selector, OverlapOffChargesEncoding) {
  CostModel model = linear_model(4);
  for (CodecThroughput& t : model.codec) t = {1e8, 1e8, 1e12};  // encoding as slow as the link
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 20, 4, 0.0)};
  SelectorOptions on, off;
  off.overlap = false;
  const Selection hidden = select_shards(shards, model, on);
  const Selection exposed = select_shards(shards, model, off);
  EXPECT_NEAR(hidden.shards[0].gain_s - exposed.shards[0].gain_s, exposed.shards[0].encode_s, 1e-12);
  EXPECT_NEAR(exposed.shards[0].encode_s, 2.0 * (1 << 20) / 1e8, 1e-12);
}

TEST(Selector, BucketThatCannotPayItsRoundOverheadIsDropped) {
  CostModel model;
  model.world_size = 2;
  // A slow-latency, fast-bandwidth link: compressed rounds cost 2 x 50 ms; a tiny shard saves little.
  model.allgather = CommCurve::fit({{0, 0.05}, {1e9, 0.05 + 1.0}});
  for (CodecThroughput& t : model.codec) t = {1e12, 1e12, 1e12};
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1000, 2, 0.0), candidate(1, 0, 1 << 26, 2, 0.0)};
  const Selection s = select_shards(shards, model, SelectorOptions{});
  EXPECT_GT(s.shards[0].gain_s, 0);
  EXPECT_FALSE(s.shards[0].chosen);
  EXPECT_NE(s.shards[0].reason.find("round overhead"), std::string::npos);
  EXPECT_TRUE(s.shards[1].chosen);
}

TEST(Selector, UnevenShardsCountTheLargestRanksMemory) {
  const CostModel model = linear_model(3);
  ShardCandidate c = candidate(0, 0, 0, 3, 0.0);
  c.shard_values = {4000, 4000, 1000};
  const Selection s = select_shards(std::vector{c}, model, SelectorOptions{});
  EXPECT_EQ(s.shards[0].memory_bytes, 9000u);  // every rank caches all three shards
  SelectorOptions hash;
  hash.codec.detection = ChangeDetection::kHash;
  const Selection h = select_shards(std::vector{c}, model, hash);
  // Rank 2 holds the most: 2 block hashes (16 bytes) for its own 1000 values + 2 x 4000 peer
  // exponents (ranks 0 and 1: 8 hashes + 5000).
  EXPECT_EQ(h.shards[0].memory_bytes, 2 * 16 + 8000u);
}

TEST(Selector, EachDTypeUsesItsOwnThroughput) {
  CostModel model = linear_model(2);
  for (CodecThroughput& t : model.codec) t = {};
  model.throughput(DType::kFP32) = {1e10, 1e10, 1e10};
  ShardCandidate single = candidate(0, 0, 1 << 20, 2, 0.0), brain = candidate(1, 0, 1 << 20, 2, 0.0);
  single.dtype = DType::kFP32;
  const Selection s = select_shards(std::vector{single, brain}, model, SelectorOptions{});
  EXPECT_TRUE(s.shards[0].chosen);
  EXPECT_FALSE(s.shards[1].chosen);
  EXPECT_NE(s.shards[1].reason.find("not measured for bf16"), std::string::npos) << s.shards[1].reason;
  EXPECT_THROW(model.throughput(static_cast<DType>(0)), ConfigError);
}

TEST(Selector, RejectsInconsistentCandidates) {
  const CostModel model = linear_model(4);
  EXPECT_THROW(select_shards(std::vector{candidate(0, 0, 10, 3, 0.0)}, model, SelectorOptions{}), ConfigError);
  EXPECT_THROW(select_shards(std::vector{candidate(0, 0, 10, 4, 1.5)}, model, SelectorOptions{}), ConfigError);
  ShardCandidate negative = candidate(0, 0, 10, 4, 0.5);
  negative.value_change_rate = -0.1;
  EXPECT_THROW(select_shards(std::vector{negative}, model, SelectorOptions{}), ConfigError);
}

// FSDP2 with reshard_after_forward=N gathers a layer on two groups: the world (forward) and N
// ranks of a node (backward). Each group's shards are priced on its own link; one budget covers
// the codec state of both engines.
TEST(SelectorGroups, EachGroupIsPricedOnItsOwnLinkUnderOneBudget) {
  std::vector<CostModel> models = {linear_model(4), linear_model(2)};
  models[1].allgather = CommCurve::fit({{0, 1e-5}, {1e8, 1e-5 + 0.001}});  // 100 GB/s inside a node
  std::vector<ShardCandidate> shards;
  for (size_t b = 0; b < 2; ++b) {
    shards.push_back(candidate(b, 0, 1 << 18, 4, 0.0));  // group 0: a quarter of the layer per rank
    ShardCandidate node = candidate(b, 0, 1 << 19, 2, 0.0);  // group 1: half of it per rank
    node.group = 1;
    shards.push_back(node);
  }
  SelectorOptions unlimited;
  const Selection all = select_shards(shards, models, unlimited);
  // Compressing saves ~1.3 ms per gather on the slow link, but ~1 us inside the node, less
  // than decoding costs: only group 0's shards are worth it, whatever the budget.
  EXPECT_EQ(all.chosen_count(), 2u);
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_EQ(all.policy(0, b, 0), ShardPolicy::kCiera);
    EXPECT_EQ(all.policy(1, b, 0), ShardPolicy::kRaw);
  }
  // The same shards once more, every group on the slow link: all four are worth it, and the budget
  // (this rank's state in both engines) takes as many as fit.
  models[1] = linear_model(2);
  SelectorOptions budget;
  budget.cache_budget_bytes = all.cache_bytes + 2 * (1 << 19);  // and one group-1 shard
  const Selection some = select_shards(shards, models, budget);
  EXPECT_LE(some.cache_bytes, budget.cache_budget_bytes);
  EXPECT_EQ(some.chosen_count(), 3u);
  uint64_t used = 0;
  for (const ShardChoice& c : some.shards) used += c.chosen_memory_bytes;
  EXPECT_EQ(used, some.cache_bytes);
  // Same memory per shard (2^20 bytes) and the same bytes saved, but a group-1 rank decodes one
  // peer's half where a group-0 rank decodes three quarters: group 1's shards rank first, then
  // group 0's by bucket. Buckets are per group: group 0's bucket 1 is the one left out.
  EXPECT_EQ(some.policy(1, 0, 0), ShardPolicy::kCiera);
  EXPECT_EQ(some.policy(1, 1, 0), ShardPolicy::kCiera);
  EXPECT_EQ(some.policy(0, 0, 0), ShardPolicy::kCiera);
  EXPECT_EQ(some.policy(0, 1, 0), ShardPolicy::kRaw);
}

TEST(SelectorGroups, OneModelIsGroupZeroAndBadGroupsAreRejected) {
  const CostModel model = linear_model(2);
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 18, 2, 0.0),
                                              candidate(1, 0, 1 << 18, 2, 0.3)};
  const Selection one = select_shards(shards, model, SelectorOptions{});
  const Selection listed = select_shards(shards, std::vector{model}, SelectorOptions{});
  ASSERT_EQ(one.shards.size(), listed.shards.size());
  for (size_t i = 0; i < one.shards.size(); ++i) {
    EXPECT_EQ(one.shards[i].policy, listed.shards[i].policy);
    EXPECT_EQ(one.shards[i].gain_s, listed.shards[i].gain_s);
  }
  ShardCandidate stray = candidate(0, 0, 10, 2, 0.0);
  stray.group = 1;
  EXPECT_THROW(select_shards(std::vector{stray}, std::vector{model}, SelectorOptions{}),
               ConfigError);
  ShardCandidate wrong_world = candidate(0, 0, 10, 4, 0.0);
  wrong_world.group = 1;
  EXPECT_THROW(
      select_shards(std::vector{wrong_world}, std::vector{model, model}, SelectorOptions{}),
      ConfigError);
}

TEST(Selector, CacheBytesPredictionMatchesTheCodec) {
  for (ChangeDetection detection : {ChangeDetection::kExact, ChangeDetection::kHash}) {
    CodecConfig config;
    config.detection = detection;
    config.warmup_steps = 0;
    const uint64_t n = 5000;
    ShardEncoder encoder(config, n);
    ShardDecoder decoder(config, n);
    std::vector<std::byte> shard(2 * n, std::byte{0x3c}), payload(encoder.max_payload_bytes()), out(2 * n);
    const FrameStats sent = encoder.encode(shard, payload);
    decoder.decode({payload.data(), sent.payload_bytes}, out);
    EXPECT_EQ(codec_cache_bytes(config, n, true), encoder.cache_bytes());
    EXPECT_EQ(codec_cache_bytes(config, n, false), decoder.cache_bytes());
  }
}

TEST(ChangeMonitor, CountsChangedValuesAndBlocksPerShard) {
  // Two shards of 10 and 5 BF16 values, blocks of 4: blocks [4,4,2] and [4,1].
  ChangeMonitor monitor(DType::kBF16, {10, 5}, 4);
  std::vector<uint16_t> v(15, 0x3f80);  // 1.0
  monitor.observe(std::as_bytes(std::span(v)));
  EXPECT_EQ(monitor.counts()[0].observations, 0u);
  v[1] = 0x3f81;   // mantissa only: no exponent change
  v[5] = 0x4000;   // 2.0: exponent change in shard 0, block 1
  v[6] = 0xc000;   // -2.0: same block
  v[9] = 0x7fc1;   // NaN: shard 0, block 2
  v[14] = 0xbf80;  // -1.0: sign only
  monitor.observe(std::as_bytes(std::span(v)));
  const auto& c = monitor.counts();
  EXPECT_EQ(c[0].observations, 1u);
  EXPECT_EQ(c[0].values, 10u);
  EXPECT_EQ(c[0].blocks, 3u);
  EXPECT_EQ(c[0].changed_values, 3u);
  EXPECT_EQ(c[0].changed_blocks, 2u);
  EXPECT_EQ(c[1].blocks, 2u);
  EXPECT_EQ(c[1].changed_values, 0u);
  EXPECT_EQ(c[1].changed_blocks, 0u);
  EXPECT_DOUBLE_EQ(c[0].block_change_rate(), 2.0 / 3.0);
  monitor.observe(std::as_bytes(std::span(v)));  // nothing changed since
  EXPECT_EQ(c[0].changed_blocks, 2u);
  EXPECT_EQ(c[0].blocks, 6u);
  EXPECT_THROW(monitor.observe(std::as_bytes(std::span(v).first(3))), ConfigError);
}

TEST(ChangeMonitor, FP16AndFP32ExponentsOnly) {
  ChangeMonitor half(DType::kFP16, {4}, 64);
  std::vector<uint16_t> h = {0x3c00, 0x3c00, 0x3c00, 0x3c00};
  half.observe(std::as_bytes(std::span(h)));
  h[0] = 0x3c01, h[1] = 0x4000, h[2] = 0x8000 | 0x3c00;
  half.observe(std::as_bytes(std::span(h)));
  EXPECT_EQ(half.counts()[0].changed_values, 1u);
  ChangeMonitor single(DType::kFP32, {3}, 64);
  std::vector<uint32_t> f = {0x3f800000, 0x3f800000, 0x00000001};
  single.observe(std::as_bytes(std::span(f)));
  f[0] = 0x3f800001, f[1] = 0x40000000, f[2] = 0x00800000;  // subnormal -> normal
  single.observe(std::as_bytes(std::span(f)));
  EXPECT_EQ(single.counts()[0].changed_values, 2u);
}

TEST(CostModel, MeasuredOnLoopbackAgreesOnEveryRank) {
  const int world = 3;
  auto shared = make_loopback_world(world);
  std::vector<CommCurve> curves(world);
  std::vector<ShardChangeCounts> merged;
  std::vector<double> agreed(world);
  std::vector<CostModel> models(world);
  const auto errors = testing::on_rank_threads(world, [&](int r) {
    const std::unique_ptr<Transport> transport = make_loopback_transport(shared, r);
    Transport& t = *transport;
    const std::vector<uint64_t> sizes = {3000, 30000, 300000};
    curves[size_t(r)] = measure_allgather(t, sizes, 2);
    agreed[size_t(r)] = agree_max(t, double(r) + 0.5);
    const DType dtypes[] = {DType::kBF16, DType::kFP32};
    models[size_t(r)] = measure_cost_model(t, 30000, dtypes, CodecConfig{}, 1);
    std::vector<ShardChangeCounts> counts(2);
    counts[0] = {4, 100 * uint64_t(r + 1), 10, uint64_t(r), 1};
    counts[1] = {4, 50, 5, 0, 0};
    merge_counts_across_ranks(t, counts);
    if (r == 0) merged = counts;
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[size_t(r)], "") << "rank " << r;
  for (int r = 1; r < world; ++r) {
    ASSERT_EQ(curves[size_t(r)].samples().size(), curves[0].samples().size());
    for (size_t i = 0; i < curves[0].samples().size(); ++i) {
      EXPECT_EQ(curves[size_t(r)].samples()[i].seconds, curves[0].samples()[i].seconds);
    }
    EXPECT_EQ(agreed[size_t(r)], 2.5);
    for (DType d : {DType::kBF16, DType::kFP32}) {  // the slowest rank's codec, on every rank
      EXPECT_EQ(models[size_t(r)].throughput(d).encode_bytes_per_s, models[0].throughput(d).encode_bytes_per_s);
      EXPECT_EQ(models[size_t(r)].throughput(d).decode_bytes_per_s, models[0].throughput(d).decode_bytes_per_s);
    }
    EXPECT_EQ(models[size_t(r)].allgather.samples().size(), models[0].allgather.samples().size());
  }
  EXPECT_EQ(curves[0].samples().front().bytes, 3000);
  EXPECT_GT(models[0].throughput(DType::kBF16).encode_bytes_per_s, 0);
  EXPECT_EQ(models[0].throughput(DType::kFP16).encode_bytes_per_s, 0);  // not asked for
  EXPECT_EQ(models[0].world_size, world);
  EXPECT_EQ(merged[0].observations, 4u);
  EXPECT_EQ(merged[0].values, 600u);
  EXPECT_EQ(merged[0].changed_values, 3u);
  EXPECT_EQ(merged[0].changed_blocks, 3u);
  EXPECT_EQ(merged[1].blocks, 15u);
}

TEST(CostModel, CodecThroughputIsMeasuredForEveryDType) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    CodecConfig config;
    config.dtype = dtype;
    const CodecThroughput t = measure_codec(config, 1 << 16, 0.005, 2);
    EXPECT_GT(t.detect_bytes_per_s, 0);
    EXPECT_GT(t.encode_bytes_per_s, 0);
    EXPECT_GT(t.decode_bytes_per_s, 0);
  }
}

// Arguments the measurements and the selector used to take: no repeats (a median of nothing
// read before its vector), a change rate outside [0, 1] (some 2^64 flips a step, a hang), a NaN
// throughput (a NaN cost the gain read as free), shards past 2^64 bytes (a wrapped size).
TEST(SelectionMisuse, BadArgumentsAreConfigErrors) {
  EXPECT_THROW(measure_codec(CodecConfig{}, 1000, 0.005, 0), ConfigError);
  for (const double rate : {-0.005, 1.5, std::nan("")})
    EXPECT_THROW(measure_codec(CodecConfig{}, 1000, rate, 1), ConfigError) << rate;
  const std::unique_ptr<Transport> alone = make_loopback_transport(make_loopback_world(1), 0);
  const std::vector<uint64_t> sizes = {4096, 65536};
  EXPECT_THROW(measure_allgather(*alone, sizes, 0), ConfigError);

  CostModel model = linear_model(2);
  model.throughput(DType::kBF16).encode_bytes_per_s = std::nan("");
  const std::vector<ShardCandidate> shards = {candidate(0, 0, 1 << 16, 2, 0.01)};
  try {
    select_shards(shards, model, SelectorOptions{});
    FAIL() << "a NaN throughput was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("codec throughput of nan"), std::string::npos) << e.what();
  }

  const std::vector<ShardCandidate> twice = {candidate(0, 0, 1 << 16, 2, 0.01),
                                             candidate(0, 0, 1 << 16, 2, 0.01)};
  EXPECT_THROW(select_shards(twice, linear_model(2), SelectorOptions{}), ConfigError);

  const uint64_t half = uint64_t{1} << 63;
  EXPECT_THROW(ChangeMonitor(DType::kBF16, {half, half}, 512), ConfigError);
}

// Collectives whose arguments differ between ranks would exchange buffers of different sizes
// (undefined under MPI): every rank is told instead.
TEST(SelectionMisuse, RanksThatPassOtherArgumentsToAMeasurementOrAMergeFailTogether) {
  const int world = 2;
  auto shared = make_loopback_world(world);
  std::vector<std::string> gather_errors(world), merge_errors(world);
  const auto errors = testing::on_rank_threads(world, [&](int r) {
    const std::unique_ptr<Transport> t = make_loopback_transport(shared, r);
    const std::vector<uint64_t> sizes = {4096, r == 0 ? 65536u : 131072u};
    try {
      measure_allgather(*t, sizes, 1);
    } catch (const ConfigError& e) {
      gather_errors[size_t(r)] = e.what();
    }
    std::vector<ShardChangeCounts> counts(r == 0 ? 2 : 3);
    try {
      merge_counts_across_ranks(*t, counts);
    } catch (const ConfigError& e) {
      merge_errors[size_t(r)] = e.what();
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[size_t(r)], "") << errors[size_t(r)];
    EXPECT_NE(
        gather_errors[size_t(r)].find("measure_allgather: rank 1 called it with other arguments"),
        std::string::npos)
        << gather_errors[size_t(r)];
    EXPECT_NE(merge_errors[size_t(r)].find("merge_counts_across_ranks: rank 1"), std::string::npos)
        << merge_errors[size_t(r)];
  }
}

}  // namespace
}  // namespace ciera
