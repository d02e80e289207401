// The engine's delta policy (value-delta streams) on the host backend, over the loopback transport:
// bitwise exact over many steps, alone and mixed with raw and ciera parameters; tiny frames for
// unchanged and slightly moved values; corruption repaired by the key-frame round; policy
// switches; exact cache accounting; mismatches and backends that cannot code it fail on every
// rank. (tests/test_engine_backend.cpp runs the same suite on memory the engine cannot touch.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "engine_backend_suite.hpp"

namespace ciera {
namespace {

using testing::Pattern;
using testing::PayloadBytes;
using testing::Trajectory;

std::shared_ptr<const CodecBackend> host(int) { return host_codec_backend(); }

struct Case {
  int world;
  DType dtype;
  WarmupMode warmup;
  bool in_place;
};

class EngineDelta : public ::testing::TestWithParam<Case> {};

TEST_P(EngineDelta, ManyStepsAreBitwiseExactAloneAndMixedWithRawAndCiera) {
  const Case c = GetParam();
  testing::expect_exact_delta_gathers(c.world, host, c.dtype, c.warmup, c.in_place, 60);
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngineDelta,
                         ::testing::Values(Case{2, DType::kBF16, WarmupMode::kRaw, false},
                                           Case{3, DType::kFP16, WarmupMode::kRaw, true},
                                           Case{4, DType::kFP32, WarmupMode::kKeyFrames, false},
                                           Case{3, DType::kBF16, WarmupMode::kKeyFrames, true},
                                           Case{1, DType::kBF16, WarmupMode::kRaw, false}));

TEST(EngineDeltaPolicy, RepeatedGathersAreHeaderOnlyAndNudgedValuesCostLittle) {
  testing::expect_delta_frames_are_small(3, host);
}

TEST(EngineDeltaPolicy, CorruptionIsCaughtAndRepairedByTheKeyFrameRound) {
  testing::expect_corruption_caught_and_resent(3, host, ShardPolicy::kDelta);
}

TEST(EngineDeltaPolicy, SwitchingBetweenCieraDeltaAndRawStaysExact) {
  testing::expect_exact_through_delta_policy_switches(3, host);
}

// Delta parameters skip raw warmup: from the second gather on their frames are value-delta
// frames, far below raw bytes, while a ciera-only bucket still goes raw.
TEST(EngineDeltaPolicy, DeltaParametersSkipRawWarmup) {
  const int world = 2;
  std::vector<BucketLayout> layouts = {
      BucketLayout::fsdp_split("delta", DType::kBF16, {40000}, world, ShardPolicy::kDelta),
      BucketLayout::fsdp_split("ciera", DType::kBF16, {40000}, world, ShardPolicy::kCiera)};
  EngineConfig config;
  config.warmup_steps = 10;
  config.warmup = WarmupMode::kRaw;
  testing::expect_no_errors(testing::run_backend_ranks(world, host, [&](int rank, Transport& t, auto) {
    Trajectory data(DType::kBF16, layouts[0].total_bytes() / 2, Pattern::kSparse, 4);
    CompressedAllgather engine(t, config, layouts);
    std::vector<std::byte> out(layouts[0].total_bytes());
    const auto mine = [&] {
      return data.span().subspan(layouts[0].rank_offset(rank), layouts[0].rank_bytes(rank));
    };
    for (int step = 0; step < 5; ++step) {
      data.step();
      const GatherStats delta = engine.run(0, mine(), out);
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.values().begin())) << step;
      const GatherStats ciera = engine.run(1, mine(), out);
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.values().begin())) << step;
      EXPECT_TRUE(delta.warmup && delta.compressed) << step;
      EXPECT_TRUE(ciera.warmup && !ciera.compressed) << step;
      if (step > 0) {
        EXPECT_LT(delta.wire_bytes * 3, delta.raw_bytes) << step;
      }
    }
  }));
}

TEST(EngineDeltaPolicy, MismatchedPoliciesFailOnEveryRank) {
  const int world = 3;
  // At construction: the agreement names the bucket's policy fact.
  auto errors = testing::run_backend_ranks(world, host, [&](int rank, Transport& t, auto) {
    auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, world);
    if (rank == 2) layout.policy[1] = ShardPolicy::kDelta;
    CompressedAllgather engine(t, EngineConfig{}, {layout});
  });
  for (const std::string& e : errors) {
    EXPECT_NE(
        e.find(
            "bucket[0].policy (bucket 'b') is 'ciera,ciera' on ranks 0,1; 'ciera,delta' on rank 2"),
        std::string::npos)
        << e;
    EXPECT_EQ(e, errors[0]);
  }
  // Through set_policy on one rank only: the next gather fails on every rank.
  errors = testing::run_backend_ranks(world, host, [&](int rank, Transport& t, auto) {
    const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, world);
    Trajectory data(DType::kBF16, layout.total_bytes() / 2, Pattern::kSparse, 8);
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    const auto mine = data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank));
    engine.run(0, mine, out);
    if (rank == 0) engine.set_policy(0, 0, ShardPolicy::kDelta);
    engine.run(0, mine, out);
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("shard policies of bucket 'b' differ"), std::string::npos) << e;
    EXPECT_EQ(e, errors[0]);
  }
}

// A backend whose coders cannot take value-delta streams (CodecBackend::codes): the host's coders
// under a device backend's name.
class NoValueDeltaBackend final : public CodecBackend {
 public:
  std::string_view name() const override { return "cuda:7"; }  // a name, nothing more
  const MemoryOps& memory() const override { return host_memory_ops(); }
  bool host_memory() const override { return true; }
  bool codes(StreamKind kind) const override { return kind == StreamKind::kExponentReuse; }
  std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    EXPECT_EQ(c.stream_kind, StreamKind::kExponentReuse) << "asked for a stream it cannot code";
    return host_codec_backend()->make_encoder(c, n, id);
  }
  std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    EXPECT_EQ(c.stream_kind, StreamKind::kExponentReuse) << "asked for a stream it cannot code";
    return host_codec_backend()->make_decoder(c, n, id);
  }
};

constexpr const char* kUnsupported =
    "parameter 1: delta policy is not supported on the cuda:7 codec backend";

TEST(EngineDeltaPolicy, ABackendThatCannotCodeDeltaFailsEveryRankAtConstruction) {
  const int world = 3;
  auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, world);
  layout.policy[1] = ShardPolicy::kDelta;
  // Every rank on it, and only rank 1 on it: the same error everywhere, naming rank and parameter.
  for (const bool all : {true, false}) {
    const auto errors = testing::run_backend_ranks(
        world,
        [all](int rank) -> std::shared_ptr<const CodecBackend> {
          if (all || rank == 1) return std::make_shared<NoValueDeltaBackend>();
          return host_codec_backend();
        },
        [&](int, Transport& t, auto backend) { CompressedAllgather engine(t, EngineConfig{}, {layout}, backend); });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find(std::string(all ? "rank 0: " : "rank 1: ") + "bucket 'b' " + kUnsupported),
                std::string::npos)
          << e;
      EXPECT_EQ(e, errors[0]);
    }
  }
}

TEST(EngineDeltaPolicy, ABackendThatCannotCodeDeltaFailsEveryRankAfterSetPolicy) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, world);
  const auto errors = testing::run_backend_ranks(
      world,
      [](int rank) -> std::shared_ptr<const CodecBackend> {
        if (rank == 1) return std::make_shared<NoValueDeltaBackend>();
        return host_codec_backend();
      },
      [&](int rank, Transport& t, auto backend) {
        Trajectory data(DType::kBF16, layout.total_bytes() / 2, Pattern::kSparse, 8);
        CompressedAllgather engine(t, EngineConfig{}, {layout}, backend);
        std::vector<std::byte> out(layout.total_bytes());
        const auto mine = data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank));
        engine.set_policy(0, 1, ShardPolicy::kDelta);
        try {
          engine.run(0, mine, out);
          ADD_FAILURE() << "rank " << rank << ": the gather should have failed";
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find(std::string("rank 1 rejected its gather of bucket 'b': ") +
                                               kUnsupported),
                    std::string::npos)
              << e.what();
        }
        // Changed back on every rank: gathers work again, exactly.
        engine.set_policy(0, 1, ShardPolicy::kCiera);
        engine.run(0, mine, out);
        EXPECT_TRUE(std::equal(out.begin(), out.end(), data.values().begin()));
      });
  testing::expect_no_errors(errors);
}

TEST(EngineDeltaPolicy, SetPolicyAcceptsDelta) {
  auto world = make_loopback_world(1);
  auto transport = make_loopback_transport(world, 0);
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {1000}, 1);
  CompressedAllgather engine(*transport, EngineConfig{}, {layout});
  engine.set_policy(0, 0, ShardPolicy::kDelta);
  EXPECT_EQ(engine.bucket(0).policy[0], ShardPolicy::kDelta);
  EXPECT_EQ(engine.cache_bytes(), 2000u);  // the sender's copy of its values
}

}  // namespace
}  // namespace ciera
