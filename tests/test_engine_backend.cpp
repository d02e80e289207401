// The engine on a codec backend whose payload memory is not host memory, run on the host: the
// tagged backend below hands out payload pointers with bit 62 set, which no CPU can dereference
// (a non-canonical address faults), so any payload byte the engine, the envelope code or the
// transport touched directly instead of through MemoryOps and the backend's coders would crash
// these tests. This is what a GPU backend needs of the engine, checked in CI without a GPU.
// Also: input fences (a gather reads its input only once the caller's stream gets there) and
// ranks on different backends gathering together.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "ciera/backend.hpp"
#include "ciera/engine.hpp"
#include "engine_backend_suite.hpp"

namespace ciera {
namespace {

using testing::BackendOf;
using testing::PayloadBytes;

constexpr uintptr_t kTag = uintptr_t{1} << 62;

template <typename T>
T* untag(T* p) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) & ~kTag);
}

// Host memory behind tagged pointers. Untagging is idempotent, so host pointers (the engine's
// staged records, a host-backend peer's buffers in the loopback) pass through unchanged.
class TaggedMemory final : public MemoryOps {
 public:
  std::byte* allocate(size_t bytes) const override {
    std::byte* p = host_memory_ops().allocate(bytes);
    return reinterpret_cast<std::byte*>(reinterpret_cast<uintptr_t>(p) | kTag);
  }
  void free(std::byte* data, size_t bytes) const noexcept override {
    host_memory_ops().free(untag(data), bytes);
  }
  void copy(std::byte* dst, const std::byte* src, size_t bytes) const override {
    copies.fetch_add(1, std::memory_order_relaxed);
    host_memory_ops().copy(untag(dst), untag(src), bytes);
  }
  void move(std::byte* dst, const std::byte* src, size_t bytes) const override {
    host_memory_ops().move(untag(dst), untag(src), bytes);
  }
  mutable std::atomic<uint64_t> copies{0};
};

// A stand-in for a CUDA stream: work "enqueued" on it is done once release() is called.
struct FakeStream {
  std::mutex mutex;
  std::condition_variable changed;
  bool released = false;
  std::atomic<int> waits{0};
  void release() {
    std::lock_guard lock(mutex);
    released = true;
    changed.notify_all();
  }
};

class FakeFence final : public InputFence {
 public:
  explicit FakeFence(FakeStream& s) : stream_(s) {}
  void wait() override {
    stream_.waits.fetch_add(1);
    std::unique_lock lock(stream_.mutex);
    stream_.changed.wait(lock, [&] { return stream_.released; });
  }

 private:
  FakeStream& stream_;
};

// How many coders a backend has made that are still alive, and the most at once.
struct Census {
  std::atomic<int> live{0}, peak{0};
  void born() {
    const int now = live.fetch_add(1) + 1;
    for (int was = peak.load(); now > was && !peak.compare_exchange_weak(was, now);) {
    }
  }
  void died() { live.fetch_sub(1); }
};

class TaggedEncoder final : public PayloadEncoder {
 public:
  TaggedEncoder(std::unique_ptr<PayloadEncoder> host, Census& census)
      : host_(std::move(host)), census_(census) {
    census_.born();
  }
  ~TaggedEncoder() override { census_.died(); }
  uint64_t encode(const std::byte* shard, uint64_t shard_bytes, std::byte* payload) override {
    return host_->encode(untag(shard), shard_bytes, untag(payload));
  }
  void request_key_frame() override { host_->request_key_frame(); }
  uint32_t epoch() const override { return host_->epoch(); }
  size_t max_payload_bytes() const override { return host_->max_payload_bytes(); }
  size_t cache_bytes() const override { return host_->cache_bytes(); }

 private:
  std::unique_ptr<PayloadEncoder> host_;
  Census& census_;
};

class TaggedDecoder final : public PayloadDecoder {
 public:
  explicit TaggedDecoder(std::unique_ptr<PayloadDecoder> host) : host_(std::move(host)) {}
  void decode(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
              uint64_t shard_bytes) override {
    host_->decode(untag(payload), payload_bytes, untag(shard), shard_bytes);
  }
  void request_resync() override { host_->request_resync(); }
  uint32_t epoch() const override { return host_->epoch(); }
  size_t cache_bytes() const override { return host_->cache_bytes(); }

 private:
  std::unique_ptr<PayloadDecoder> host_;
};

class TaggedBackend final : public CodecBackend {
 public:
  std::string_view name() const override { return "tagged"; }
  const MemoryOps& memory() const override { return memory_; }
  bool host_memory() const override { return false; }
  std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    return std::make_unique<TaggedEncoder>(host_codec_backend()->make_encoder(c, n, id), encoders);
  }
  std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    return std::make_unique<TaggedDecoder>(host_codec_backend()->make_decoder(c, n, id));
  }
  std::unique_ptr<InputFence> fence(uintptr_t stream) const override {
    if (stream == 0) return nullptr;
    return std::make_unique<FakeFence>(*reinterpret_cast<FakeStream*>(stream));
  }
  TaggedMemory memory_;
  mutable Census encoders;
};

std::shared_ptr<const CodecBackend> tagged() { return std::make_shared<TaggedBackend>(); }

TEST(EngineBackend, TaggedPointersReallyFault) {
  // The premise of this file: a tagged pointer cannot be read directly.
  TaggedMemory memory;
  std::byte* p = memory.allocate(64);
  EXPECT_DEATH({ [[maybe_unused]] volatile std::byte b = *p; }, "");
  memory.free(p, 64);
}

struct Case {
  int world;
  DType dtype;
  WarmupMode warmup;
  bool in_place;
};

class EngineOnTaggedMemory : public ::testing::TestWithParam<Case> {};

TEST_P(EngineOnTaggedMemory, GathersAreBitwiseExactWithEveryPayloadByteThroughTheBackend) {
  const Case c = GetParam();
  testing::expect_exact_gathers(c.world, [](int) { return tagged(); }, c.dtype, c.warmup, c.in_place);
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngineOnTaggedMemory,
                         ::testing::Values(Case{2, DType::kBF16, WarmupMode::kRaw, false},
                                           Case{3, DType::kFP16, WarmupMode::kKeyFrames, true},
                                           Case{4, DType::kBF16, WarmupMode::kRaw, true}));

TEST(EngineBackend, CorruptionInTransitIsCaughtAndResentOnTaggedMemory) {
  testing::expect_corruption_caught_and_resent(3, [](int) { return tagged(); });
}

TEST(EngineBackend, ResetsPolicyChangesAndAdaptiveSwitchingStayExactOnTaggedMemory) {
  testing::expect_exact_through_resets_and_policy_changes(3, [](int) { return tagged(); });
}

TEST(EngineBackend, EveryRankFailsTogetherOnTaggedMemory) {
  testing::expect_every_rank_fails_together(3, [](int) { return tagged(); });
}

// The delta policy (value-delta streams) on memory the engine cannot touch: every payload
// byte still moves through the backend.
TEST(EngineBackend, DeltaPolicyGathersAreBitwiseExactOnTaggedMemory) {
  testing::expect_exact_delta_gathers(3, [](int) { return tagged(); }, DType::kBF16, WarmupMode::kRaw, true);
  testing::expect_exact_delta_gathers(2, [](int) { return tagged(); }, DType::kFP16, WarmupMode::kKeyFrames, false);
}

TEST(EngineBackend, DeltaFramesAreSmallOnTaggedMemory) {
  testing::expect_delta_frames_are_small(2, [](int) { return tagged(); });
}

TEST(EngineBackend, DeltaCorruptionAndPolicySwitchesOnTaggedMemory) {
  testing::expect_corruption_caught_and_resent(3, [](int) { return tagged(); }, ShardPolicy::kDelta);
  testing::expect_exact_through_delta_policy_switches(3, [](int) { return tagged(); });
}

TEST(EngineBackend, RanksOnDifferentBackendsGatherTogether) {
  // The payloads are the same on every backend, so a host rank and tagged ranks interoperate.
  // (The loopback moves every rank's bytes with tagged memory, which reads host memory too.)
  TaggedMemory either;
  testing::expect_exact_gathers(3, [](int r) { return r == 0 ? host_codec_backend() : tagged(); },
                                DType::kBF16, WarmupMode::kRaw, false, 40, &either);
}

TEST(EngineBackend, HostRecordsAreStagedThroughPayloadMemory) {
  // A device transport is never handed a host pointer: the engine's own records are copied into
  // payload memory first. Every host record exchange therefore costs two copies.
  auto backend = std::make_shared<TaggedBackend>();
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {1000}, 1);
  auto world = make_loopback_world(1);
  auto transport = make_loopback_transport(world, 0, backend->memory());
  const uint64_t before = backend->memory_.copies.load();
  CompressedAllgather engine(*transport, EngineConfig{}, {layout}, backend);
  EXPECT_GE(backend->memory_.copies.load() - before, 4u);  // agreement and epochs, in and out
}

// A policy switch drops the old codecs before it makes the new ones: never both at once, so a
// selection that fits the cache budget fits it throughout the switch (here a 1000-value shard's
// exponent cache, then its previous values, then its exponent cache again).
TEST(EngineBackend, APolicySwitchNeverHoldsTheOldAndNewCodecsAtOnce) {
  auto backend = std::make_shared<TaggedBackend>();
  auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {1000}, 1);
  layout.policy = {ShardPolicy::kCiera};
  auto world = make_loopback_world(1);
  auto transport = make_loopback_transport(world, 0, backend->memory());
  CompressedAllgather engine(*transport, EngineConfig{}, {layout}, backend);
  ASSERT_EQ(backend->encoders.live.load(), 1);
  backend->encoders.peak = 1;
  engine.set_policy(0, 0, ShardPolicy::kDelta);
  engine.set_policy(0, 0, ShardPolicy::kCiera);
  EXPECT_EQ(backend->encoders.live.load(), 1);
  EXPECT_EQ(backend->encoders.peak.load(), 1);
  engine.set_policy(0, 0, ShardPolicy::kRaw);
  EXPECT_EQ(backend->encoders.live.load(), 0);
}

// A backend that cannot make codecs once `fail` is set (as when device memory runs out).
class FailingBackend final : public CodecBackend {
 public:
  std::string_view name() const override { return "failing"; }
  const MemoryOps& memory() const override { return host_memory_ops(); }
  bool host_memory() const override { return true; }
  std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    if (fail) throw std::bad_alloc();
    return host_codec_backend()->make_encoder(c, n, id);
  }
  std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    if (fail) throw std::bad_alloc();
    return host_codec_backend()->make_decoder(c, n, id);
  }
  std::unique_ptr<InputFence> fence(uintptr_t) const override { return nullptr; }
  std::atomic<bool> fail{false};
};

// From a user audit: an engine whose codec state one rank could not make (out of memory there
// alone) threw std::bad_alloc on that rank, naming nothing, and its peers, set up, waited for it
// in their first gather until the timeout. Now every rank fails at construction, naming the rank
// and the bucket.
TEST(EngineBackend, CodecStateOneRankCannotMakeFailsEveryRankAtConstruction) {
  const int world = 3;
  const std::vector<BucketLayout> layouts = {
      BucketLayout::fsdp_split("attention", DType::kBF16, {3000}, world),
      BucketLayout::fsdp_split("experts", DType::kBF16, {3000, 500}, world)};
  const auto errors = testing::run_backend_ranks(
      world,
      [](int rank) {
        auto backend = std::make_shared<FailingBackend>();
        backend->fail = rank == 1;
        return backend;
      },
      [&](int, Transport& t, auto backend) {
        EngineConfig config;
        config.timeout = std::chrono::seconds(60);
        const auto started = std::chrono::steady_clock::now();
        try {
          CompressedAllgather engine(t, config, layouts, backend);
        } catch (const ConfigError&) {
          EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(30));
          throw;
        }
      });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("engine set-up failed on rank 1: bucket 'attention': std::bad_alloc"),
              std::string::npos)
        << e;
  }
}

// A policy switch whose new codecs cannot be made throws on that rank, which keeps the parameter
// raw: the bucket's next gather then fails on every rank (the peers switched), naming the
// policies, instead of going on with ranks that disagree; switching every rank to raw recovers.
TEST(EngineBackend, APolicySwitchThatCannotMakeItsCodecsFailsTheNextGatherOnEveryRank) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000, 500}, world);
  std::vector<std::string> thrown(world);
  auto errors = testing::run_backend_ranks(
      world, [](int) { return std::make_shared<FailingBackend>(); },
      [&](int rank, Transport& t, auto base) {
        auto backend = std::const_pointer_cast<CodecBackend>(base);
        auto& failing = static_cast<FailingBackend&>(*backend);
        testing::Trajectory data(DType::kBF16, layout.total_bytes() / 2, testing::Pattern::kSparse,
                                 5);
        std::vector<std::byte> out(layout.total_bytes());
        EngineConfig config;
        config.warmup_steps = 0;
        CompressedAllgather engine(t, config, {layout}, backend);
        const auto mine = [&] {
          return data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank));
        };
        data.step();
        engine.run(0, mine(), out);
        failing.fail = rank == 0;
        try {
          engine.set_policy(0, 0, ShardPolicy::kDelta);
        } catch (const std::bad_alloc&) {
          thrown[rank] = "bad_alloc";
        }
        failing.fail = false;
        EXPECT_EQ(engine.bucket(0).policy[0], rank == 0 ? ShardPolicy::kRaw : ShardPolicy::kDelta);
        data.step();
        try {
          engine.run(0, mine(), out);
          ADD_FAILURE() << "rank " << rank << ": a gather with unlike policies went on";
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("polic"), std::string::npos) << e.what();
        }
        engine.set_policy(0, 0, ShardPolicy::kRaw);
        for (int step = 0; step < 3; ++step) {
          data.step();
          engine.run(0, mine(), out);
          ASSERT_TRUE(std::equal(out.begin(), out.end(), data.values().begin())) << "step " << step;
        }
      });
  testing::expect_no_errors(errors);
  EXPECT_EQ(thrown, (std::vector<std::string>{"bad_alloc", ""}));
}

// A gather started on a stream whose work is not done yet reads its input only once it is:
// here the input is written after start(), before the stream is released, in a raw warmup
// gather (straight from input to output) and in compressed ones.
TEST(EngineBackend, InputIsReadOnlyAfterTheCallersStreamGetsThere) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3000}, world);
  EngineConfig config;
  config.warmup_steps = 2;
  testing::expect_no_errors(testing::run_backend_ranks(
      world, [](int) { return tagged(); }, [&](int rank, Transport& t, auto backend) {
        testing::Trajectory data(DType::kBF16, layout.total_bytes() / 2, testing::Pattern::kSparse, 3);
        PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
        PayloadBytes out(backend->memory(), layout.total_bytes());
        CompressedAllgather engine(t, config, {layout}, backend);
        const std::vector<std::byte> stale(layout.rank_bytes(rank), std::byte{0x7F});
        for (int step = 0; step < 6; ++step) {
          data.step();
          in.put(stale);
          FakeStream stream;
          const auto ticket = engine.start(0, in.span(), out.span(), reinterpret_cast<uintptr_t>(&stream));
          // start() returned without waiting; now the caller's "kernel" writes the input.
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          in.put(data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank)));
          stream.release();
          engine.wait(ticket);
          EXPECT_GT(stream.waits.load(), 0) << "step " << step;
          const std::vector<std::byte> got = out.get();
          ASSERT_TRUE(std::equal(got.begin(), got.end(), data.values().begin())) << "step " << step;
        }
      }));
}

TEST(EngineBackend, TheHostBackendHasNoStreams) {
  auto world = make_loopback_world(1);
  auto transport = make_loopback_transport(world, 0);
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {100}, 1);
  CompressedAllgather engine(*transport, EngineConfig{}, {layout});
  std::vector<std::byte> in(layout.rank_bytes(0)), out(layout.total_bytes());
  EXPECT_THROW(
      {
        try {
          engine.start(0, in, out, 0x1234);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("host codec backend has no streams"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
  // Nothing changed: the bucket is not busy.
  EXPECT_NO_THROW(engine.run(0, in, out));
}

// From a user audit: a null backend on one rank was thrown there alone, before the agreement,
// and its peers waited in the agreement until the timeout ("peers did not arrive"). Now every
// rank fails at once, naming that rank and the cause; so does a warmup mode out of range, which
// passed the agreement as key frames and ran as neither.
TEST(EngineBackend, ANullBackendOrAnUnknownWarmupOnOneRankFailsEveryRankAtOnce) {
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {100}, 2);
  for (const bool null_backend : {true, false}) {
    auto world = make_loopback_world(2);
    const auto errors = testing::on_rank_threads(2, [&](int rank) {
      auto transport = make_loopback_transport(world, rank);
      EngineConfig config;
      config.timeout = std::chrono::seconds(60);  // a wait for the timeout fails the test below
      if (rank == 1 && !null_backend) config.warmup = static_cast<WarmupMode>(9);
      const auto started = std::chrono::steady_clock::now();
      try {
        CompressedAllgather engine(*transport, config, {layout},
                                   rank == 1 && null_backend ? nullptr : host_codec_backend());
      } catch (const ConfigError&) {
        EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(30))
            << "rank " << rank;
        throw;
      }
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
      EXPECT_NE(e.find(null_backend ? "the codec backend is null" : "warmup mode 9 does not exist"),
                std::string::npos)
          << e;
    }
  }
}

}  // namespace
}  // namespace ciera
