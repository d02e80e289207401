// The compressed allgather engine over the loopback transport (ranks as threads): output
// bitwise equal to an uncompressed allgather on every rank, every step, and steady-state gathers
// really compressed; configuration mismatches, cold ranks, corrupted payloads and dead peers
// handled the same way on every rank; misuse of the API rejected with std::invalid_argument.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/collectives.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "ciera/loopback.hpp"
#include "common/adaptive_switch.hpp"
#include "engine_backend_suite.hpp"
#include "engine_wire_bound.hpp"
#include "forwarding_transport.hpp"
#include "rank_threads.hpp"
#include "record_flipping_transport.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using testing::Pattern;
using testing::Trajectory;
using testing::sparse_delta_wire_bound;

// Runs `body(rank, transport)` on `world` threads; returns each rank's error text ("" if none).
std::vector<std::string> run_ranks(
    int world, const std::function<void(int, Transport&)>& body,
    const std::function<std::unique_ptr<Transport>(std::shared_ptr<LoopbackWorld>, int)>& make =
        [](std::shared_ptr<LoopbackWorld> w, int r) {
          return make_loopback_transport(std::move(w), r);
        }) {
  auto shared = make_loopback_world(world);
  return testing::on_rank_threads(world, [&](int r) {
    auto transport = make(shared, r);
    transport->set_timeout(std::chrono::seconds(20));
    body(r, *transport);
  });
}

// The bucket's full contents at every step: a trajectory over all parameters of all ranks,
// laid out rank-major exactly as the gathered output must be.
struct BucketData {
  BucketData(const BucketLayout& l, Pattern pattern, uint64_t seed)
      : layout(l), trajectory(l.dtype, l.total_bytes() / dtype_info(l.dtype).value_bytes, pattern, seed) {}
  std::span<const std::byte> input(int rank) const {
    return std::span<const std::byte>(trajectory.values()).subspan(layout.rank_offset(rank), layout.rank_bytes(rank));
  }
  const BucketLayout& layout;
  Trajectory trajectory;
};

// After warmup every gather of a bucket with CIERA parameters is compressed and, after the
// first key frame, within the bound above (checked only where that bound is below the raw size,
// which `compressible` asserts: tiny shards cannot beat their 80-byte payload headers).
void expect_steady_state_compressed(const GatherStats& stats, const BucketLayout& l,
                                    const EngineConfig& config, bool compressible,
                                    const std::string& where) {
  if (stats.step < config.warmup_steps) return;
  EXPECT_FALSE(stats.warmup) << where;
  EXPECT_TRUE(stats.compressed) << where;
  if (!compressible || stats.step == config.warmup_steps) return;  // that one is a key frame
  const uint64_t bound = sparse_delta_wire_bound(l, config.codec.block_values);
  ASSERT_LT(bound, stats.raw_bytes) << where << ": the bound must exclude an engine that sends raw";
  EXPECT_LT(stats.wire_bytes, bound) << where << " (raw " << stats.raw_bytes << ")";
}

struct Case {
  int world;
  DType dtype;
  WarmupMode warmup;
  bool in_place;
};

class EngineRoundTrip : public ::testing::TestWithParam<Case> {};

TEST_P(EngineRoundTrip, HundredsOfStepsAreBitwiseExactOnEveryRank) {
  const Case c = GetParam();
  std::vector<BucketLayout> layouts;
  layouts.push_back(BucketLayout::fsdp_split("experts", c.dtype, {5000, 777, 1, 4096}, c.world));
  layouts.push_back(BucketLayout::fsdp_split("attention", c.dtype, {3000, 3000}, c.world, ShardPolicy::kRaw));
  // Uneven and empty shards, mixed policies.
  BucketLayout odd;
  odd.name = "odd";
  odd.dtype = c.dtype;
  odd.policy = {ShardPolicy::kCiera, ShardPolicy::kRaw, ShardPolicy::kCiera};
  for (int r = 0; r < c.world; ++r) odd.shard_values.push_back({r == 1 ? 0u : 1000u + 37u * r, 5u, r % 2 ? 3u : 600u});
  layouts.push_back(odd);
  layouts[1].policy[1] = ShardPolicy::kCiera;

  constexpr int kSteps = 120;
  EngineConfig config;
  config.warmup_steps = 5;
  config.warmup = c.warmup;
  config.codec.block_values = 256;

  // Every rank owns a copy of the trajectories and advances them identically, so all ranks see
  // the same step's data without sharing memory.
  const auto errors = run_ranks(c.world, [&](int rank, Transport& t) {
    std::vector<std::unique_ptr<BucketData>> mine;
    for (size_t b = 0; b < layouts.size(); ++b) {
      mine.push_back(std::make_unique<BucketData>(layouts[b], b == 2 ? Pattern::kSpecial : Pattern::kSparse, 10 + b));
    }
    CompressedAllgather engine(t, config, layouts);
    std::vector<std::vector<std::byte>> out(layouts.size());
    for (size_t b = 0; b < layouts.size(); ++b) out[b].resize(layouts[b].total_bytes());
    for (int step = 0; step < kSteps; ++step) {
      std::vector<CompressedAllgather::Ticket> tickets;
      // All buckets in flight at once.
      for (size_t b = 0; b < layouts.size(); ++b) {
        if (step > 0) mine[b]->trajectory.step();
        const auto input = mine[b]->input(rank);
        std::span<const std::byte> source = input;
        if (c.in_place) {
          std::memcpy(out[b].data() + layouts[b].rank_offset(rank), input.data(), input.size());
          source = {out[b].data() + layouts[b].rank_offset(rank), input.size()};
        }
        tickets.push_back(engine.start(b, source, out[b]));
      }
      for (size_t b = 0; b < layouts.size(); ++b) {
        const GatherStats stats = engine.wait(tickets[b]);
        EXPECT_EQ(stats.step, static_cast<uint64_t>(step));
        EXPECT_EQ(stats.warmup, c.warmup == WarmupMode::kRaw && step < 5);
        EXPECT_FALSE(stats.resynchronised);
        ASSERT_TRUE(std::equal(out[b].begin(), out[b].end(), mine[b]->trajectory.values().begin()))
            << "rank " << rank << " bucket " << b << " step " << step;
        // Buckets 0 and 1 hold sparse data; bucket 2 special values, whose exponents change often.
        expect_steady_state_compressed(stats, layouts[b], config, b != 2,
                                       "rank " + std::to_string(rank) + " bucket " +
                                           std::to_string(b) + " step " + std::to_string(step));
      }
    }
    EXPECT_GT(engine.cache_bytes(), 0u);
  });
  testing::expect_no_errors(errors);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, EngineRoundTrip,
    ::testing::Values(Case{1, DType::kBF16, WarmupMode::kRaw, false},
                      Case{2, DType::kBF16, WarmupMode::kRaw, false},
                      Case{3, DType::kFP16, WarmupMode::kKeyFrames, false},
                      Case{4, DType::kFP32, WarmupMode::kRaw, true},
                      Case{4, DType::kBF16, WarmupMode::kKeyFrames, true}));

TEST(Engine, MismatchedConfigurationFailsOnEveryRankNamingTheDifference) {
  const int world = 3;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    EngineConfig config;
    if (rank == 2) config.codec.block_values = 256;
    CompressedAllgather engine(t, config, {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
  });
  for (int r = 0; r < world; ++r) {
    const std::string m = errors[r];
    EXPECT_NE(m.find("block_values"), std::string::npos) << m;
    EXPECT_NE(m.find("'512' on ranks 0,1"), std::string::npos) << m;
    EXPECT_NE(m.find("'256' on rank 2"), std::string::npos) << m;
    EXPECT_EQ(m, errors[0]) << "every rank reports the same difference";
  }
}

TEST(Engine, MismatchedShardSizesAndDtypesAreNamed) {
  const int world = 2;
  auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{},
                               {BucketLayout::fsdp_split("layer0", DType::kBF16, {rank == 0 ? 1000u : 1002u}, world)});
  });
  for (int r = 0; r < world; ++r) EXPECT_NE(errors[r].find("shard_values"), std::string::npos);
  errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{},
                               {BucketLayout::fsdp_split("layer0", rank ? DType::kFP16 : DType::kBF16, {1000}, world)});
  });
  for (int r = 0; r < world; ++r) EXPECT_NE(errors[r].find("dtype"), std::string::npos);
  // A layout that is wrong on one rank only is still reported by every rank.
  errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{},
                               {BucketLayout::fsdp_split("layer0", DType::kBF16, {1000}, rank ? 3 : world)});
  });
  for (int r = 0; r < world; ++r)
    EXPECT_NE(errors[r].find("rejected on rank 1"), std::string::npos) << errors[r];
}

// Whether `text` is UTF-8 throughout (what the binding needs to make it a Python exception).
bool is_utf8(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const size_t n = lead < 0x80         ? 1
                     : (lead >> 5) == 6  ? 2
                     : (lead >> 4) == 14 ? 3
                     : (lead >> 3) == 30 ? 4
                                         : 0;
    if (n == 0 || i + n > text.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// A refusal's reason is cut to its record field, and a long value in a configuration mismatch to
// an excerpt: both on a character boundary (a cut inside one made the binding raise
// UnicodeDecodeError on every rank instead of the error), and the excerpt where the values differ
// (names that differed only past the 77th byte were shown as two identical prefixes). The cut
// is marked "..." (a user audit read cut texts as whole ones: "expected a CPU tenso"), and the
// refusing rank, which has the whole reason, names it whole.
TEST(Engine, TextsCutForTheWireStayUtf8AndShowWhereLongValuesDiffer) {
  const int world = 2;
  const std::string reason = std::string(78, 'x') + "\xC3\xA9";  // 80 bytes; the field keeps 79
  auto errors = run_ranks(world, [&](int rank, Transport& t) {
    const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world);
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    std::vector<std::byte> in(layout.rank_bytes(rank)), out(layout.total_bytes());
    if (rank == 1) engine.refuse(0, reason);
    engine.run(0, in, out);
  });
  for (const std::string& e : errors) EXPECT_TRUE(is_utf8(e)) << e;
  EXPECT_NE(errors[0].find(": " + std::string(76, 'x') + "..."), std::string::npos) << errors[0];
  EXPECT_EQ(errors[0].find(std::string(77, 'x')), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find(": " + reason), std::string::npos) << errors[1];
  std::string layers;
  for (int i = 0; i < 40; ++i) layers += "\xE5\xB1\xA4";  // 120 bytes of a 3-byte character
  errors = run_ranks(world, [&](int rank, Transport& t) {
    const std::string name = layers + (rank == 0 ? "attention" : "experts");
    CompressedAllgather engine(t, EngineConfig{},
                               {BucketLayout::fsdp_split(name, DType::kBF16, {1000}, world)});
  });
  for (const std::string& e : errors) {
    EXPECT_TRUE(is_utf8(e)) << e;
    EXPECT_NE(e.find("attention' on rank 0"), std::string::npos) << e;
    EXPECT_NE(e.find("experts' on rank 1"), std::string::npos) << e;
    EXPECT_EQ(e, errors[0]);
  }
}

// wait() from inside a transport call (where a Python transport's callables run) waited for
// itself for ever; it is refused. Tickets are unique across engines: another engine's is unknown
// (it used to be taken for this engine's gather of the same number).
TEST(Engine, WaitFromTheCommunicationThreadAndForeignTicketsAreRefused) {
  struct CallingBack final : testing::ForwardingTransport {
    using ForwardingTransport::ForwardingTransport;
    std::function<void()> during;
    void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                    std::span<const uint64_t> displs) override {
      if (during) during();
      ForwardingTransport::allgatherv(in, out, counts, displs);
    }
  };
  auto world = make_loopback_world(1);
  CallingBack transport(make_loopback_transport(world, 0));
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {1000}, 1);
  CompressedAllgather engine(transport, EngineConfig{}, {layout});
  std::vector<std::byte> in(layout.rank_bytes(0)), out(layout.total_bytes());
  std::atomic<CompressedAllgather::Ticket> target{0};
  std::string refused;
  bool on_communication_thread = false;
  transport.during = [&] {
    while (target.load() == 0) std::this_thread::yield();  // start() returns before the exchange
    on_communication_thread = engine.on_communication_thread();
    try {
      engine.wait(target.load());
    } catch (const std::invalid_argument& e) {
      refused = e.what();
    }
    // run() would start a gather and leave it writing into its buffers when its wait() threw.
    try {
      engine.start(0, in, out);
    } catch (const std::invalid_argument& e) {
      refused += std::string(" | ") + e.what();
    }
  };
  target = engine.start(0, in, out);
  EXPECT_NO_THROW(engine.wait(target.load()));
  transport.during = nullptr;
  EXPECT_TRUE(on_communication_thread);
  EXPECT_FALSE(engine.on_communication_thread());
  EXPECT_NE(refused.find("wait: called on the engine's communication thread"), std::string::npos)
      << refused;
  EXPECT_NE(refused.find("start: called on the engine's communication thread"), std::string::npos)
      << refused;

  // Both engines with a gather in flight: per-engine counters gave the two the same number.
  auto other_world = make_loopback_world(1);
  auto other_transport = make_loopback_transport(other_world, 0);
  CompressedAllgather other(*other_transport, EngineConfig{}, {layout});
  std::vector<std::byte> other_out(layout.total_bytes());
  other.wait(other.start(0, in, other_out));
  const CompressedAllgather::Ticket mine = engine.start(0, in, out);
  const CompressedAllgather::Ticket theirs = other.start(0, in, other_out);
  EXPECT_THROW(engine.wait(theirs), std::invalid_argument);
  EXPECT_NO_THROW(engine.wait(mine));
  EXPECT_NO_THROW(other.wait(theirs));
}

// A timeout <= 0 used to reach the transport, whose first wait then said that the peers "did
// not arrive within -1 ms"; a layout past 2^64 bytes wrapped to a size of 0 that a raw gather
// took, or died in an allocation. Both are now named in the agreement, on every rank.
TEST(Engine, ANonPositiveTimeoutAndAnOverflowingLayoutAreConfigErrors) {
  const int world = 2;
  auto errors = run_ranks(world, [&](int, Transport& t) {
    EngineConfig config;
    config.timeout = std::chrono::milliseconds(-1);
    CompressedAllgather engine(t, config,
                               {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
  });
  for (int r = 0; r < world; ++r)
    EXPECT_NE(errors[r].find("timeout must be > 0 ms, got -1 ms"), std::string::npos) << errors[r];
  // Thousands of coding threads, one rank's typo, are refused on every rank (that rank starts
  // kMaxWorkerThreads of them before its agreement says no).
  errors = run_ranks(world, [&](int rank, Transport& t) {
    EngineConfig config;
    config.worker_threads = rank == 1 ? 100000 : 2;
    CompressedAllgather engine(t, config,
                               {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find(r == 1 ? "worker_threads must be at most 256, got 100000"
                                    : "rejected on rank 1"),
              std::string::npos)
        << errors[r];
  }
  BucketLayout huge;
  huge.name = "huge";
  huge.dtype = DType::kBF16;
  huge.policy = {ShardPolicy::kRaw};
  huge.shard_values = {{uint64_t{1} << 63}, {uint64_t{1} << 63}};
  EXPECT_THROW(huge.validate(), ConfigError);
  BucketLayout forged =
      BucketLayout::fsdp_split("b\nblock_values=512", DType::kBF16, {1000}, world);
  EXPECT_THROW(forged.validate(), ConfigError);  // a name that would add a line to the agreement
  errors = run_ranks(
      world, [&](int, Transport& t) { CompressedAllgather engine(t, EngineConfig{}, {huge}); });
  for (int r = 0; r < world; ++r)
    EXPECT_NE(errors[r].find("more than 2^64 - 1 bytes"), std::string::npos) << errors[r];
}

// The agreement sizes its buffer from the description lengths the ranks announce: each was
// bounded by 1 GiB, but world x 1 GiB together was an allocation that failed with std::bad_alloc
// (or took the host's memory) instead of an error. Both bounds are ConfigErrors naming the
// lengths, on every rank. (Every rank's announcement is forged here, as a foreign peer's would
// read on every rank.)
TEST(Engine, DescriptionLengthsPastTheAgreementsBoundAreConfigErrorsOnEveryRank) {
  struct Announcing final : testing::ForwardingTransport {
    Announcing(std::shared_ptr<Transport> inner, std::vector<uint64_t> lengths)
        : ForwardingTransport(std::move(inner)), lengths_(std::move(lengths)) {}
    void allgather(const void* in, size_t bytes, void* out) override {
      ForwardingTransport::allgather(in, bytes, out);
      // The digests (docs/format.md, "Engine protocol": length, XXH3-128, error flag; u64s),
      // each made distinct so that every rank's text is asked for.
      if (bytes == 4 * sizeof(uint64_t) && !done_) {
        auto* digests = static_cast<uint64_t*>(out);
        for (size_t r = 0; r < lengths_.size(); ++r) {
          digests[4 * r] = lengths_[r];
          digests[4 * r + 1] = r;
        }
        done_ = true;
      }
    }
    std::vector<uint64_t> lengths_;
    bool done_ = false;
  };
  const int world = 3;
  const uint64_t gib = uint64_t{1} << 30, half = gib / 2;
  const std::pair<std::vector<uint64_t>, std::string> cases[] = {
      {{half, half, half},
       "configuration agreement: the ranks announced descriptions of 1610612736 bytes in all "
       "(rank 0 536870912, rank 1 536870912, rank 2 536870912; at most 1073741824 together)"},
      {{100, gib + 1, 100},
       "configuration agreement: rank 1 announced a 1073741825-byte description (at most "
       "1073741824)"}};
  for (const auto& [lengths, expected] : cases) {
    const auto errors = run_ranks(
        world,
        [&](int, Transport& t) {
          try {
            CompressedAllgather engine(
                t, EngineConfig{}, {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
          } catch (const ConfigError& e) {
            throw std::runtime_error(std::string("ConfigError: ") + e.what());
          }
        },
        [&](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
          return std::make_unique<Announcing>(make_loopback_transport(std::move(w), r), lengths);
        });
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(errors[r], "ConfigError: " + expected) << "rank " << r;
  }
}

// Counts the bytes this rank receives from its collectives (its own part included).
class ReceivedBytesTransport final : public testing::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void allgather(const void* in, size_t bytes, void* out) override {
    received += bytes * static_cast<uint64_t>(size());
    ForwardingTransport::allgather(in, bytes, out);
  }
  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    for (const uint64_t c : counts) received += c;
    ForwardingTransport::allgatherv(in, out, counts, displs);
  }
  uint64_t received = 0;
};

// Every rank's description lists every rank's shard sizes, so gathering them all was W^2 x
// parameters bytes on every rank at construction (932,256 bytes a rank here with protocol 2,
// past the 1 GiB bound at about 1024 ranks of 128 parameters a bucket). Where they match, a rank
// now receives a marker and a digest from each rank (40 bytes), and the stream epochs and set-up
// flags (8): 768 bytes.
TEST(Engine, AgreementReceivesBytesLinearInTheWorldWhereTheConfigurationsMatch) {
  const int world = 16;
  std::vector<BucketLayout> buckets;
  for (int b = 0; b < 8; ++b)
    buckets.push_back(BucketLayout::fsdp_split("layer" + std::to_string(b), DType::kBF16,
                                               std::vector<uint64_t>(128, 1000 + b), world,
                                               ShardPolicy::kRaw));
  std::vector<uint64_t> received(world);
  const auto errors = run_ranks(
      world,
      [&](int rank, Transport& t) {
        CompressedAllgather engine(t, EngineConfig{}, buckets);
        received[rank] = dynamic_cast<ReceivedBytesTransport&>(t).received;
      },
      [](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
        return std::make_unique<ReceivedBytesTransport>(make_loopback_transport(std::move(w), r));
      });
  testing::expect_no_errors(errors);
  for (int r = 0; r < world; ++r) EXPECT_EQ(received[r], uint64_t{48} * world) << "rank " << r;
  std::printf(
      "agreement and set-up, %d ranks, 8 buckets of 128 parameters: %llu bytes received "
      "a rank\n",
      world, static_cast<unsigned long long>(received[0]));
}

// Ranks whose descriptions differ still read every rank's facts, so the first difference is
// named as before; a description that several ranks share is sent once (rank 5 alone differs
// here: the texts of ranks 0 and 5 travel, not 16). A local error that every rank shares
// (identical digests) is still read and named.
TEST(Engine, AgreementNamesAMismatchInALargeWorldSendingEachDescriptionOnce) {
  const int world = 16;
  std::vector<uint64_t> received(world), texts(world);
  const auto errors = run_ranks(
      world,
      [&](int rank, Transport& t) {
        auto& counted = dynamic_cast<ReceivedBytesTransport&>(t);
        EngineConfig config;
        if (rank == 5) config.codec.block_values = 1024;
        try {
          CompressedAllgather engine(
              t, config, {BucketLayout::fsdp_split("b", DType::kBF16, {1000, 24}, world)});
        } catch (...) {
          received[rank] = counted.received;
          throw;
        }
      },
      [](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
        return std::make_unique<ReceivedBytesTransport>(make_loopback_transport(std::move(w), r));
      });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r],
              "configuration mismatch across ranks: block_values is '1024' on rank 5; '512' on "
              "ranks 0,1,2,3,4,6,7,8,9,10,11,12,13,14,15");
    // 40 bytes a rank for the marker and digest, then two descriptions of well under 2 KiB.
    EXPECT_LT(received[r], uint64_t{40} * world + 2 * 2048) << "rank " << r;
  }
  std::printf("agreement, %d ranks, one differing: %llu bytes received a rank\n", world,
              static_cast<unsigned long long>(received[0]));
  const auto same_error = run_ranks(world, [&](int, Transport& t) {
    EngineConfig config;
    config.timeout = std::chrono::milliseconds(-1);
    CompressedAllgather engine(t, config,
                               {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
  });
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(same_error[r].find("configuration rejected on rank 0: "), 0u) << same_error[r];
}

// A build of engine protocol 2 or earlier sends its description's length where this one sends
// its marker, and a later build another marker: the two sides would otherwise pair different
// collectives. Every rank of this build names the protocol version after the first collective.
TEST(Engine, AgreementNamesAPeerOfAnotherProtocolAfterItsFirstCollective) {
  struct Marking final : testing::ForwardingTransport {
    Marking(std::shared_ptr<Transport> inner, uint64_t rank1_sends)
        : ForwardingTransport(std::move(inner)), rank1_sends_(rank1_sends) {}
    void allgather(const void* in, size_t bytes, void* out) override {
      ++collectives;
      ForwardingTransport::allgather(in, bytes, out);
      if (collectives == 1 && bytes == sizeof(uint64_t))
        static_cast<uint64_t*>(out)[1] = rank1_sends_;
    }
    void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                    std::span<const uint64_t> displs) override {
      ++collectives;
      ForwardingTransport::allgatherv(in, out, counts, displs);
    }
    uint64_t rank1_sends_;
    int collectives = 0;
  };
  const int world = 3;
  const std::pair<uint64_t, std::string> cases[] = {
      {2291,  // an older build's description length
       "configuration mismatch across ranks: protocol_version is '2 or older' on rank 1; '3' on "
       "ranks 0,2"},
      {0x4349455241475204,
       "configuration mismatch across ranks: protocol_version is '3' on ranks 0,2; '4' on rank 1"},
      {0xffffffffffffffff,
       "configuration mismatch across ranks: protocol_version is '3' on ranks 0,2; 'unknown "
       "(sent 0xffffffffffffffff)' on rank 1"}};
  for (const auto& [rank1_sends, expected] : cases) {
    std::vector<int> collectives(world);
    const auto errors = run_ranks(
        world,
        [&](int rank, Transport& t) {
          try {
            CompressedAllgather engine(
                t, EngineConfig{}, {BucketLayout::fsdp_split("b", DType::kBF16, {1000}, world)});
          } catch (...) {
            collectives[rank] = dynamic_cast<Marking&>(t).collectives;
            throw;
          }
        },
        [&](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
          return std::make_unique<Marking>(make_loopback_transport(std::move(w), r), rank1_sends);
        });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(errors[r], expected) << "rank " << r;
      EXPECT_EQ(collectives[r], 1) << "rank " << r;
    }
  }
}

// The test transport itself: no world was a null dereference, counts shorter than the world
// were read past (here, and by the peers reading this rank's send counts).
TEST(LoopbackTransport, RefusesNoWorldAndCountsThatAreNotOnePerRank) {
  EXPECT_THROW(make_loopback_transport(nullptr, 0), ConfigError);
  const std::unique_ptr<Transport> t = make_loopback_transport(make_loopback_world(2), 0);
  const std::vector<uint64_t> one = {4}, two = {4, 4};
  std::byte in[8]{}, out[8]{};
  try {
    t->allgatherv(in, out, one, one);
    FAIL() << "one count for two ranks was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("need 2 entries, one per rank, got 1"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(t->alltoallv(in, two, one, out, two, two), ConfigError);
}

// A second transport for a rank would count as another arrival at each rendezvous, as if a rank
// that has none had come: refused while the first exists, taken again once it is gone.
TEST(LoopbackTransport, RefusesASecondTransportForTheSameRank) {
  const auto world = make_loopback_world(2);
  auto first = make_loopback_transport(world, 0);
  try {
    make_loopback_transport(world, 0);
    FAIL() << "a second transport for rank 0 was made";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "loopback rank 0 already has a transport in this world (each rank takes one)");
  }
  first.reset();
  EXPECT_NO_THROW(make_loopback_transport(world, 0));
  EXPECT_NO_THROW(make_loopback_transport(world, 1));
}

TEST(Engine, WrongBufferSizeOnOneRankFailsEveryRank) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world);
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    std::vector<std::byte> in(layout.rank_bytes(rank) - (rank == 1 ? 2 : 0)), out(layout.total_bytes());
    engine.run(0, in, out);
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(errors[r].find("rank 1 rejected"), std::string::npos) << errors[r];
  }
}

// In place means exactly this rank's part of the output: an input elsewhere in the output (here
// rank 0's part, on rank 1) would be overwritten while the gather reads it, and the output
// would be wrong with no error. Refused on every rank, and the next, correct, gather works.
TEST(Engine, AnInputOverlappingTheOutputOutsideItsOwnPartFailsEveryRank) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world);
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    BucketData data(layout, Pattern::kSparse, 5);
    std::vector<std::byte> out(layout.total_bytes());
    const auto input = data.input(rank);
    std::byte* at = out.data() + (rank == 1 ? layout.rank_offset(0) : layout.rank_offset(rank));
    std::memcpy(at, input.data(), input.size());
    try {
      engine.run(0, {at, input.size()}, out);
      ADD_FAILURE() << "rank " << rank << ": the gather from the wrong part completed";
    } catch (const ConfigError& e) {
      EXPECT_NE(
          std::string(e.what()).find("rank 1 rejected its gather of bucket 'b': input overlaps "
                                     "output byte 0, own part at 3000"),
          std::string::npos)
          << e.what();
    }
    std::byte* own = out.data() + layout.rank_offset(rank);
    std::memcpy(own, input.data(), input.size());
    engine.run(0, {own, input.size()}, out);
    EXPECT_EQ(std::memcmp(out.data(), data.trajectory.span().data(), out.size()), 0)
        << "rank " << rank;
  });
  testing::expect_no_errors(errors);
}

// A caller's refusal (a binding that found a null pointer) fails the gather on every rank at
// once, naming the rank and its reason; the bucket's next gather then succeeds everywhere.
TEST(Engine, ARefusedGatherFailsEveryRankAtOnceAndTheNextOneWorks) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    BucketData data(layout, Pattern::kSparse, 5);
    std::vector<std::byte> out(layout.total_bytes());
    try {
      if (rank == 1) engine.refuse(0, "input is a null pointer (0) for 2000 bytes");
      engine.run(0, data.input(rank), out);
      ADD_FAILURE() << "rank " << rank << ": the refused gather completed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 rejected its gather of bucket 'b': input is a "
                                           "null pointer (0) for 2000 bytes"),
                std::string::npos)
          << e.what();
    }
    engine.run(0, data.input(rank), out);
    EXPECT_EQ(std::memcmp(out.data(), data.trajectory.span().data(), out.size()), 0)
        << "rank " << rank;
  });
  testing::expect_no_errors(errors);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));  // not a timeout
}

// Two buckets gathered at a slot stride into one interleaved buffer, in place, as DeepSpeed's
// coalesced fetch lays them out: each rank's slot holds its part of A, then of B, then a gap.
// Raw warmup (the direct allgatherv), key frames and compressed steps all land exactly at the
// slots, and the gap bytes are never written.
TEST(Engine, GathersIntoAnInterleavedOutputAtASlotStride) {
  const int world = 3;
  std::vector<BucketLayout> layouts = {BucketLayout::fsdp_split("A", DType::kBF16, {3000}, world),
                                       BucketLayout::fsdp_split("B", DType::kBF16, {1200, 6}, world)};
  constexpr uint64_t kGap = 10;
  const uint64_t a = layouts[0].rank_bytes(0), b = layouts[1].rank_bytes(0);
  const uint64_t slot = a + b + kGap;
  const uint64_t offset[] = {0, a};
  EngineConfig config;
  config.warmup_steps = 4;
  config.codec.block_values = 256;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data[] = {{layouts[0], Pattern::kSparse, 3}, {layouts[1], Pattern::kSparse, 4}};
    CompressedAllgather engine(t, config, layouts);
    std::vector<std::byte> out(world * slot, std::byte{0xA5});
    for (int step = 0; step < 12; ++step) {
      std::vector<CompressedAllgather::Ticket> tickets;
      for (size_t k = 0; k < 2; ++k) {
        if (step > 0) data[k].trajectory.step();
        const auto input = data[k].input(rank);
        std::byte* own = out.data() + rank * slot + offset[k];
        std::memcpy(own, input.data(), input.size());
        const std::span<std::byte> output(out.data() + offset[k], (world - 1) * slot + input.size());
        tickets.push_back(engine.start(k, {own, input.size()}, output, 0, slot));
      }
      for (size_t k = 0; k < 2; ++k) {
        const GatherStats stats = engine.wait(tickets[k]);
        EXPECT_EQ(stats.compressed, static_cast<uint32_t>(step) >= config.warmup_steps) << "step " << step;
        for (int r = 0; r < world; ++r) {
          const auto want = data[k].input(r);
          ASSERT_EQ(std::memcmp(out.data() + r * slot + offset[k], want.data(), want.size()), 0)
              << "rank " << rank << " bucket " << k << " part of rank " << r << " step " << step;
        }
      }
      for (int r = 0; r < world; ++r) {
        for (uint64_t i = a + b; i < slot; ++i) ASSERT_EQ(out[r * slot + i], std::byte{0xA5}) << "gap written";
      }
    }
  });
  testing::expect_no_errors(errors);
}

TEST(Engine, ASlotStrideSmallerThanAPartFailsEveryRank) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world);
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    const uint64_t part = layout.rank_bytes(rank);
    const uint64_t stride = rank == 1 ? part - 2 : part;
    std::vector<std::byte> in(part), out((world - 1) * stride + part);
    engine.run(0, in, out, 0, stride);
  });
  for (int r = 0; r < world; ++r) {
    const std::string m = errors[r];
    EXPECT_NE(m.find("rank 1 rejected"), std::string::npos) << m;
    EXPECT_NE(m.find("slot stride of 2998 bytes is less than rank 0's 3000 bytes"), std::string::npos) << m;
  }
}

// Gathers started together share a round; one that a rank rejects fails alone on every rank,
// and the gathers started with it (before and after it) complete exactly.
TEST(Engine, ARejectedGatherFailsAloneInItsRound) {
  const int world = 2;
  std::vector<BucketLayout> layouts;
  for (const char* name : {"A", "B", "C"}) {
    layouts.push_back(BucketLayout::fsdp_split(name, DType::kBF16, {1000}, world));
  }
  std::vector<std::vector<std::string>> outcome(world);  // per rank: "ok" or the error, per gather
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    EngineConfig config;
    config.warmup_steps = 0;
    CompressedAllgather engine(t, config, layouts);
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<std::byte>> in(3), out(3);
      std::vector<CompressedAllgather::Ticket> tickets;
      for (size_t b = 0; b < 3; ++b) {
        const bool wrong = rank == 0 && b == 1 && step == 1;  // B's input is short on rank 0
        in[b].assign(layouts[b].rank_bytes(rank) - (wrong ? 2 : 0), std::byte{static_cast<uint8_t>(step + rank)});
        out[b].assign(layouts[b].total_bytes(), std::byte{0});
        tickets.push_back(engine.start(b, in[b], out[b]));
      }
      for (size_t b = 0; b < 3; ++b) {
        try {
          engine.wait(tickets[b]);
          outcome[rank].push_back("ok");
          EXPECT_EQ(out[b][layouts[b].rank_offset(1 - rank)], std::byte{static_cast<uint8_t>(step + 1 - rank)});
        } catch (const ConfigError& e) {
          outcome[rank].push_back(e.what());
        }
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[r], "");
    ASSERT_EQ(outcome[r].size(), 9u);
    for (size_t i = 0; i < 9; ++i) {
      if (i == 4) {  // step 1, bucket B
        EXPECT_NE(outcome[r][i].find("rank 0 rejected"), std::string::npos) << outcome[r][i];
      } else {
        EXPECT_EQ(outcome[r][i], "ok") << "rank " << r << " gather " << i;
      }
    }
  }
}

// A rank that loses its caches mid-run (a restart) is detected and recovered by a key-frame
// round all ranks enter together; the output stays exact throughout.
TEST(Engine, ColdRankIsResynchronisedAndStaysExact) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3333}, world);
  EngineConfig config;
  config.warmup_steps = 2;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 5);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    int resyncs = 0;
    for (int step = 0; step < 40; ++step) {
      data.trajectory.step();
      if (rank == 1 && step == 20) engine.reset_caches();
      const GatherStats stats = engine.run(0, data.input(rank), out);
      resyncs += stats.resynchronised;
      if (step == 20) {
        EXPECT_TRUE(stats.resynchronised) << "rank " << rank;
      }
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin())) << step;
    }
    EXPECT_EQ(resyncs, 1);
  });
  testing::expect_no_errors(errors);
}

// Reliability test 9 through the engine: a change detector weakened to collide (1 bit of each
// block's hash) misses changed blocks; the content checksum catches each such frame, the gather
// is re-sent as key frames on every rank, and every output stays exact.
TEST(Engine, HashCollisionsAreCaughtAndResentAsKeyFrames) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {40000, 999}, world);
  EngineConfig config;
  config.warmup_steps = 1;
  config.codec.detection = ChangeDetection::kHash;
  config.codec.coding = ExponentCoding::kBlock;
  config.codec.hash_bits = 1;
  config.codec.block_values = 64;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 9);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    int resyncs = 0;
    for (int step = 0; step < 30; ++step) {
      data.trajectory.step();
      const GatherStats stats = engine.run(0, data.input(rank), out);
      resyncs += stats.resynchronised;
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin()))
          << "rank " << rank << " step " << step;
    }
    EXPECT_GT(resyncs, 0) << "rank " << rank << ": no collision was caught, so none was tested";
  });
  testing::expect_no_errors(errors);
}

// A key-frame round in raw warmup moves every encoder's epoch on while no decoder sees a frame;
// a codec replaced after that (a policy change on every rank) must still take the sender's next
// key frame at once, without a failed verdict and a second key-frame round.
TEST(Engine, CodecsReplacedAfterAResyncInRawWarmupTakeTheNextKeyFrame) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3333}, world);
  EngineConfig config;
  config.warmup = WarmupMode::kRaw;
  config.warmup_steps = 3;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 7);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    int resyncs = 0;
    for (int step = 0; step < 10; ++step) {
      data.trajectory.step();
      if (rank == 1 && step == 1) engine.reset_caches();  // a key-frame round at step 1, raw
      if (step == 2) {
        engine.set_policy(0, 0, ShardPolicy::kRaw);
        engine.set_policy(0, 0, ShardPolicy::kCiera);
      }
      const GatherStats stats = engine.run(0, data.input(rank), out);
      resyncs += stats.resynchronised;
      EXPECT_EQ(stats.compressed, step >= 3) << step;
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin())) << step;
    }
    EXPECT_EQ(resyncs, 1) << "rank " << rank << ": only the cold rank's round";
  });
  testing::expect_no_errors(errors);
}

// reset_caches() called again before the next gather keeps the codecs the first call made:
// made anew each time, the cold rank's decoders moved one epoch ahead per call while its peers'
// encoders move one per key-frame round, and three resets in a row failed every later gather
// ("stale or out-of-sequence key frame ... again after a key-frame round").
TEST(Engine, ResetsInARowAreOneReset) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3333}, world);
  EngineConfig config;
  config.warmup_steps = 0;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 7);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    for (int step = 0; step < 8; ++step) {
      data.trajectory.step();
      if (rank == 0 && (step == 2 || step == 5)) {
        for (int i = 0; i < (step == 2 ? 3 : 5); ++i) engine.reset_caches();
      }
      if (step == 6) {
        // Resets with refused gathers between them (a refusal fails the round in the control
        // exchange, before any key-frame round): they too are one reset.
        for (int i = 0; i < 3; ++i) {
          if (rank == 0) engine.reset_caches();
          EXPECT_THROW(engine.refuse(0, "refused on purpose"), ConfigError);
        }
      }
      const GatherStats stats = engine.run(0, data.input(rank), out);
      EXPECT_EQ(stats.resynchronised, step == 2 || step == 5 || step == 6) << step;
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin())) << step;
    }
  });
  testing::expect_no_errors(errors);
}

// Corrupts the gathered payload of one rank at chosen calls: the decoder rejects it, every rank
// agrees on a key-frame round, and the result is exact. Persistent corruption fails everywhere.
TEST(Engine, CorruptedPayloadIsCaughtAndResent) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {30000}, world);
  EngineConfig config;
  config.warmup_steps = 1;
  const auto errors = run_ranks(
      world,
      [&](int rank, Transport& t) {
        BucketData data(layout, Pattern::kSparse, 6);
        CompressedAllgather engine(t, config, {layout});
        std::vector<std::byte> out(layout.total_bytes());
        const auto& counted = dynamic_cast<const testing::CorruptingTransport&>(t);
        for (int step = 0; step < 10; ++step) {
          data.trajectory.step();
          const uint64_t before = counted.carried(), records_before = counted.records_carried();
          const GatherStats stats = engine.run(0, data.input(rank), out);
          EXPECT_EQ(stats.resynchronised, step == 4) << "rank " << rank << " step " << step;
          ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin()));
          // Both exchanges of the re-sent gather (the first alone was reported before).
          EXPECT_EQ(stats.wire_bytes, counted.carried() - before)
              << "rank " << rank << " step " << step;
          // And every record and verdict it took (a user audit found them in no figure).
          EXPECT_EQ(stats.control_bytes, counted.records_carried() - records_before)
              << "rank " << rank << " step " << step;
        }
      },
      [](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
        // An agreement that matches uses no allgatherv (engine protocol 3); the payload of step s
        // is call s. Corrupt on rank 2.
        return std::make_unique<testing::CorruptingTransport>(
            make_loopback_transport(std::move(w), r), host_memory_ops(),
            [r](int call) { return r == 2 && call == 4; });
      });
  testing::expect_no_errors(errors);
}

// A control record or verdict the transport damaged on its way to one rank is an error on that
// rank naming the sender (and, that rank gone, on the others at the timeout), never a decision:
// rank 0's record with the raw flag set, as rank 1 saw it, once made rank 1 take the peers'
// envelopes for raw values and return them with no error.
TEST(Engine, ADamagedControlRecordOrVerdictIsAnErrorNeverADecision) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {30000}, world);
  EngineConfig config;
  config.warmup_steps = 0;
  config.timeout = std::chrono::seconds(2);
  struct Damage {
    size_t record_bytes;
    size_t at;  // in rank 0's part of what rank 1 received
    const char* what;
  };
  // Control: rank 0's first record's flags (offset 16 + 12), the raw bit. Verdict: its first
  // verdict's `failed` field.
  for (const Damage c : {Damage{1040, 28, "control record"}, Damage{1024, 0, "verdict record"}}) {
    SCOPED_TRACE(c.what);
    std::vector<char> returned(world, 0);
    const auto errors = run_ranks(
        world,
        [&](int rank, Transport& t) {
          BucketData data(layout, Pattern::kSparse, 6);
          CompressedAllgather engine(t, config, {layout});
          std::vector<std::byte> out(layout.total_bytes());
          for (int step = 0; step < 4; ++step) {
            data.trajectory.step();
            engine.run(0, data.input(rank), out);
            ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin()))
                << step;
          }
          returned[rank] = 1;
        },
        [&](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
          auto inner = make_loopback_transport(std::move(w), r);
          if (r != 1) return inner;
          const std::byte bit = c.record_bytes == 1040 ? std::byte{0x08} : std::byte{0x01};
          return std::make_unique<testing::RecordFlippingTransport>(std::move(inner),
                                                                    c.record_bytes, 2, c.at, bit);
        });
    EXPECT_NE(errors[1].find(std::string("the ") + c.what + " from rank 0 arrived damaged"),
              std::string::npos)
        << errors[1];
    EXPECT_NE(errors[0], "") << "rank 0 went on as if nothing happened";
    EXPECT_FALSE(returned[0] || returned[1]);
  }
}

TEST(Engine, PersistentCorruptionFailsOnEveryRank) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {30000}, world);
  EngineConfig config;
  config.warmup_steps = 0;
  const auto errors = run_ranks(
      world,
      [&](int rank, Transport& t) {
        BucketData data(layout, Pattern::kSparse, 6);
        CompressedAllgather engine(t, config, {layout});
        std::vector<std::byte> out(layout.total_bytes());
        engine.run(0, data.input(rank), out);
      },
      [](std::shared_ptr<LoopbackWorld> w, int r) -> std::unique_ptr<Transport> {
        return std::make_unique<testing::CorruptingTransport>(
            make_loopback_transport(std::move(w), r), host_memory_ops(),
            [r](int) { return r == 1; });
      });
  for (int r = 0; r < world; ++r) {
    const std::string m = errors[r];
    EXPECT_NE(m.find("again after a key-frame round"), std::string::npos) << m;
    EXPECT_NE(m.find("checksum"), std::string::npos) << m;
    EXPECT_EQ(m, errors[0]);
  }
}

// Ranks that start their buckets in different orders fail with CommError; that is final, and
// the next gather, in order this time, says so and names the first failure.
TEST(Engine, AfterACommErrorEveryGatherSaysTheEngineGathersNoMore) {
  const int world = 2;
  const std::vector<BucketLayout> layouts = {
      BucketLayout::fsdp_split("a", DType::kBF16, {3000}, world),
      BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world)};
  std::vector<std::string> first(world), later(world);
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    CompressedAllgather engine(t, EngineConfig{}, layouts);
    std::vector<std::byte> in(layouts[0].rank_bytes(rank)), out(layouts[0].total_bytes());
    try {
      engine.run(rank == 0 ? 0 : 1, in, out);
    } catch (const CommError& e) {
      first[rank] = e.what();
    }
    for (size_t bucket : {0, 1}) {
      try {
        engine.run(bucket, in, out);
      } catch (const CommError& e) {
        later[rank] += std::string(e.what()) + "\n";
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "");
    // After the name of this rank's own gather, the same text on every rank (until stop 62 each
    // named itself as the one in order).
    const size_t at = first[r].find("gathers out of order");
    ASSERT_NE(at, std::string::npos) << first[r];
    // Its own gather counted from 1 (once "at step 0", read beside a training step as another).
    EXPECT_EQ(first[r].substr(0, at), std::string("the 1st gather of bucket '") +
                                          (r == 0 ? "a" : "b") + "' (control exchange): ");
    EXPECT_EQ(first[r].substr(at),
              "gathers out of order: rank 1 is gathering bucket 1 while rank 0 gathers bucket 0 "
              "(start() must be called in the same order on every rank)");
    const std::string once =
        "this engine gathers no more since an earlier gather failed (make a new engine and "
        "transport): " +
        first[r] + "\n";
    EXPECT_EQ(later[r], once + once);
  }
}

// An engine calls its transport from its own thread: a second engine, or lossless collectives,
// on the same transport would interleave their calls with its own (until stop 62 two engines on
// one MPI transport delivered wrong bytes without an error, then MPI aborted). Refused, naming the
// holder; once the engine is gone the transport takes another. Lossless collectives, which call it
// from their caller's thread, may share one (a coded one and its uncoded twin).
TEST(Engine, ATransportServesOneEngineAtATime) {
  auto world = make_loopback_world(1);
  std::shared_ptr<Transport> t = make_loopback_transport(world, 0);
  const std::vector<BucketLayout> layouts = {BucketLayout::fsdp_split("a", DType::kBF16, {64}, 1)};
  {
    CompressedAllgather engine(*t, EngineConfig{}, layouts);
    const auto refused = [](const std::function<void()>& make, const std::string& who) {
      try {
        make();
        ADD_FAILURE() << who << " was made on a transport an engine uses";
      } catch (const ConfigError& e) {
        EXPECT_EQ(std::string(e.what()),
                  who +
                      ": the transport is in use by an engine (an engine needs a transport of "
                      "its own: make one for each)");
      }
    };
    refused([&] { CompressedAllgather second(*t, EngineConfig{}, layouts); },
            "CompressedAllgather");
    refused([&] { LosslessCollectives collectives(t); }, "LosslessCollectives");
  }
  {
    LosslessCollectives coded(t), twin(t, {.coding = CollectiveCoding::kRaw});
    try {
      CompressedAllgather engine(*t, EngineConfig{}, layouts);
      ADD_FAILURE() << "an engine was made on a transport lossless collectives use";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("in use by lossless collectives"), std::string::npos)
          << e.what();
    }
  }
  CompressedAllgather engine(*t, EngineConfig{}, layouts);  // the transport is free again
  std::vector<std::byte> in(layouts[0].total_bytes(), std::byte{1}), out(in.size());
  engine.run(0, in, out);
  EXPECT_EQ(out, in);
}

// The engine waits for its peers as long as its own configuration says, and gives its caller
// the transport back as it was: with the timeout the caller had set, also after a constructor
// that refused its configuration.
TEST(Engine, GivesTheTransportBackWithTheTimeoutItHad) {
  using std::chrono::milliseconds;
  auto world = make_loopback_world(1);
  std::shared_ptr<Transport> t = make_loopback_transport(world, 0);
  t->set_timeout(milliseconds(4321));
  const std::vector<BucketLayout> layouts = {BucketLayout::fsdp_split("a", DType::kBF16, {64}, 1)};
  EngineConfig config;
  config.timeout = milliseconds(1234);
  {
    CompressedAllgather engine(*t, config, layouts);
    EXPECT_EQ(t->timeout(), milliseconds(1234));
  }
  EXPECT_EQ(t->timeout(), milliseconds(4321));
  config.worker_threads = 1000;  // refused by the constructor
  EXPECT_THROW(CompressedAllgather(*t, config, layouts), ConfigError);
  EXPECT_EQ(t->timeout(), milliseconds(4321));
}

// Resident memory of this process, in bytes (Linux: /proc/self/statm's second field, in pages).
size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t total_pages = 0, resident_pages = 0;
  statm >> total_pages >> resident_pages;
  return resident_pages * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// reliability.md row 11: a long soak with changing shapes keeps memory flat. Engines are made,
// used and destroyed round after round with buckets of other shapes and dtypes (as a training
// that re-lays its buckets, or FSDP2 wrapping another model); once every shape has been seen, the
// process's resident memory stops growing: no engine, codec or transport state outlives its
// engine. Not under the sanitizers, whose quarantine keeps freed memory on purpose.
TEST(Engine, ASoakWithChangingShapesKeepsMemoryFlat) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP()
      << "a sanitizer keeps freed memory (its quarantine): resident memory says nothing here";
#else
  struct Shape {
    DType dtype;
    std::vector<uint64_t> params;
  };
  const std::vector<Shape> shapes = {{DType::kBF16, {300000, 3000}},
                                     {DType::kFP32, {50000, 50000, 7}},
                                     {DType::kFP16, {1, 120000}},
                                     {DType::kBF16, {70000}}};
  EngineConfig config;
  config.warmup_steps = 1;
  const auto round = [&](size_t k) {
    const Shape& shape = shapes[k % shapes.size()];
    const BucketLayout layout = BucketLayout::fsdp_split("soak", shape.dtype, shape.params, 2);
    testing::expect_no_errors(run_ranks(2, [&](int rank, Transport& t) {
      BucketData data(layout, Pattern::kSparse, 7 + k);
      CompressedAllgather engine(t, config, {layout});
      std::vector<std::byte> out(layout.total_bytes());
      for (int step = 0; step < 3; ++step) {
        if (step > 0) data.trajectory.step();
        engine.wait(engine.start(0, data.input(rank), out));
        ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin()))
            << "round " << k << " rank " << rank << " step " << step;
      }
    }));
  };
  for (size_t k = 0; k < 2 * shapes.size(); ++k) round(k);  // every shape, twice
  const size_t settled = resident_bytes();
  for (size_t k = 0; k < 10 * shapes.size(); ++k) round(k);
  const size_t after = resident_bytes();
  EXPECT_LT(after, settled + (8u << 20)) << "resident " << settled << " -> " << after
                                         << " bytes over " << 10 * shapes.size() << " rounds";
#endif
}

TEST(Engine, DeadPeerMakesOthersFailWithinTheTimeout) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {3000}, world);
  EngineConfig config;
  config.timeout = std::chrono::milliseconds(1500);
  const auto begin = std::chrono::steady_clock::now();
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 7);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    for (int step = 0; step < 10; ++step) {
      if (rank == 2 && step == 3) return;  // this rank dies
      data.trajectory.step();
      engine.run(0, data.input(rank), out);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  EXPECT_LT(seconds, 10.0);
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("dead or stalled"), std::string::npos) << errors[r];
  }
  EXPECT_EQ(errors[2], "");
}

TEST(Engine, SetPolicyMustMatchAcrossRanks) {
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4000, 4000}, world);
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 8);
    CompressedAllgather engine(t, EngineConfig{}, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    engine.run(0, data.input(rank), out);
    // Matching change: fine, and still exact.
    engine.set_policy(0, 1, ShardPolicy::kRaw);
    data.trajectory.step();
    engine.run(0, data.input(rank), out);
    EXPECT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin()));
    // Only rank 0 changes: every rank fails, naming the policies.
    if (rank == 0) engine.set_policy(0, 0, ShardPolicy::kRaw);
    engine.run(0, data.input(rank), out);
  });
  for (int r = 0; r < world; ++r) EXPECT_NE(errors[r].find("policies"), std::string::npos);
}

// Misuse of the API that a rank can see alone is std::invalid_argument, thrown at once, and
// changes nothing (include/ciera/engine.hpp).
class EngineMisuse : public ::testing::Test {
 protected:
  static constexpr int kWorld = 2;
  // Two buckets of two parameters each.
  std::vector<BucketLayout> layouts = {
      BucketLayout::fsdp_split("a", DType::kBF16, {4000, 4000}, kWorld),
      BucketLayout::fsdp_split("b", DType::kBF16, {2000, 1000}, kWorld)};

  // Runs `on_rank0(engine)` on rank 0 while rank 0's gather of bucket `busy` is in flight: rank 1
  // starts its own only afterwards, so the gather cannot finish earlier. Both ranks then finish
  // that gather and one more of each bucket, which must be exact and, for `busy` with warmup 0,
  // not resynchronised (the failed call changed nothing).
  void while_in_flight(size_t busy, const std::function<void(CompressedAllgather&)>& on_rank0) {
    std::promise<void> checked;
    std::shared_future<void> checked_future = checked.get_future().share();
    EngineConfig config;
    config.warmup_steps = 0;
    const auto errors = run_ranks(kWorld, [&](int rank, Transport& t) {
      std::vector<std::unique_ptr<BucketData>> data;
      for (size_t b = 0; b < layouts.size(); ++b) {
        data.push_back(std::make_unique<BucketData>(layouts[b], Pattern::kSparse, 20 + b));
      }
      CompressedAllgather engine(t, config, layouts);
      std::vector<std::vector<std::byte>> out(layouts.size());
      for (size_t b = 0; b < layouts.size(); ++b) out[b].resize(layouts[b].total_bytes());
      for (size_t b = 0; b < layouts.size(); ++b) engine.run(b, data[b]->input(rank), out[b]);
      if (rank == 1) checked_future.wait();
      const auto ticket = engine.start(busy, data[busy]->input(rank), out[busy]);
      if (rank == 0) {
        on_rank0(engine);
        checked.set_value();
      }
      EXPECT_FALSE(engine.wait(ticket).resynchronised);
      for (size_t b = 0; b < layouts.size(); ++b) {
        data[b]->trajectory.step();
        const GatherStats stats = engine.run(b, data[b]->input(rank), out[b]);
        EXPECT_FALSE(stats.resynchronised) << "rank " << rank << " bucket " << b;
        EXPECT_TRUE(stats.compressed) << "rank " << rank << " bucket " << b;
        EXPECT_TRUE(std::equal(out[b].begin(), out[b].end(), data[b]->trajectory.values().begin()));
      }
    });
    testing::expect_no_errors(errors);
  }

  // Runs `body(engine)` on a one-rank engine.
  void alone(const std::function<void(CompressedAllgather&)>& body) {
    testing::expect_no_errors(run_ranks(1, [&](int, Transport& t) {
      CompressedAllgather engine(t, EngineConfig{},
                                 {BucketLayout::fsdp_split("a", DType::kBF16, {100, 50}, 1)});
      body(engine);
    }));
  }
};

TEST_F(EngineMisuse, StartOfAMissingBucket) {
  alone([](CompressedAllgather& e) {
    std::vector<std::byte> in(300), out(300);
    EXPECT_THROW(e.start(1, in, out), std::invalid_argument);
  });
}

TEST_F(EngineMisuse, StartOfABucketAlreadyInFlight) {
  while_in_flight(0, [&](CompressedAllgather& e) {
    std::vector<std::byte> in(layouts[0].rank_bytes(0)), out(layouts[0].total_bytes());
    EXPECT_THROW(e.start(0, in, out), std::invalid_argument);
  });
}

TEST_F(EngineMisuse, WaitForAnUnknownOrAlreadyWaitedTicket) {
  alone([](CompressedAllgather& e) {
    std::vector<std::byte> in(300), out(300);
    const auto ticket = e.start(0, in, out);
    EXPECT_THROW(e.wait(ticket + 1), std::invalid_argument);
    e.wait(ticket);
    EXPECT_THROW(e.wait(ticket), std::invalid_argument);
  });
}

TEST_F(EngineMisuse, SetPolicyOfAMissingBucket) {
  alone([](CompressedAllgather& e) {
    EXPECT_THROW(e.set_policy(1, 0, ShardPolicy::kRaw), std::invalid_argument);
  });
}

TEST_F(EngineMisuse, SetPolicyOfAMissingParameter) {
  alone([](CompressedAllgather& e) {
    EXPECT_THROW(e.set_policy(0, 2, ShardPolicy::kRaw), std::invalid_argument);
  });
}

TEST_F(EngineMisuse, SetPolicyToAnUnknownPolicy) {
  alone([](CompressedAllgather& e) {
    EXPECT_THROW(e.set_policy(0, 0, static_cast<ShardPolicy>(7)), std::invalid_argument);
    EXPECT_EQ(e.bucket(0).policy[0], ShardPolicy::kCiera);
  });
}

TEST_F(EngineMisuse, SetPolicyWhileTheBucketIsInFlight) {
  while_in_flight(0, [](CompressedAllgather& e) {
    EXPECT_THROW(e.set_policy(0, 0, ShardPolicy::kRaw), std::invalid_argument);
    EXPECT_EQ(e.bucket(0).policy[0], ShardPolicy::kCiera);
  });
}

// No bucket is reset, not even those before the one in flight.
TEST_F(EngineMisuse, ResetCachesWhileAGatherIsInFlight) {
  while_in_flight(
      1, [](CompressedAllgather& e) { EXPECT_THROW(e.reset_caches(), std::invalid_argument); });
}

TEST_F(EngineMisuse, BucketOutOfRange) {
  alone([](CompressedAllgather& e) {
    EXPECT_THROW(e.bucket(1), std::invalid_argument);
    EXPECT_EQ(e.bucket(0).name, "a");
  });
}

TEST(AdaptiveSwitch, ProbesBothWaysThenKeepsTheFasterAndReprobes) {
  AdaptiveSwitch sw;
  const uint32_t P = AdaptiveSwitch::kProbeGathers;
  for (uint64_t i = 0; i < 2 * P; ++i) EXPECT_EQ(sw.compress(i), i < P);
  // Raw measured faster for both buckets: raw is chosen.
  for (size_t b = 0; b < 2; ++b) {
    sw.record(b, true, 0.010);
    sw.record(b, false, 0.008);
  }
  EXPECT_FALSE(sw.prefers_compressed());
  EXPECT_FALSE(sw.compress(2 * P));
  EXPECT_FALSE(sw.compress(2 * P + AdaptiveSwitch::kReprobeEvery - 1));
  EXPECT_TRUE(sw.compress(2 * P + AdaptiveSwitch::kReprobeEvery));  // probe of the other way
  // The sum over buckets decides: bucket 1 gains more from compression than bucket 0 loses.
  for (int i = 0; i < 8; ++i) {
    sw.record(0, true, 0.010);
    sw.record(0, false, 0.009);
    sw.record(1, true, 0.020);
    sw.record(1, false, 0.040);
  }
  EXPECT_TRUE(sw.prefers_compressed());
}

TEST(Engine, AdaptiveSwitchingStaysExact) {
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {60000, 3000}, world);
  EngineConfig config;
  config.warmup_steps = 3;
  config.adaptive = true;
  const auto errors = run_ranks(world, [&](int rank, Transport& t) {
    BucketData data(layout, Pattern::kSparse, 12);
    CompressedAllgather engine(t, config, {layout});
    std::vector<std::byte> out(layout.total_bytes());
    int compressed = 0, raw = 0;
    for (int step = 0; step < 3 + 2 * static_cast<int>(AdaptiveSwitch::kProbeGathers) + 20; ++step) {
      data.trajectory.step();
      const GatherStats stats = engine.run(0, data.input(rank), out);
      if (step >= 3) (stats.compressed ? compressed : raw)++;
      // The probe schedule is the same on every rank: compressed first, then raw.
      if (step >= 3 && step < 3 + static_cast<int>(AdaptiveSwitch::kProbeGathers)) {
        EXPECT_TRUE(stats.compressed) << step;
      }
      ASSERT_TRUE(std::equal(out.begin(), out.end(), data.trajectory.values().begin())) << step;
    }
    EXPECT_GE(compressed, static_cast<int>(AdaptiveSwitch::kProbeGathers));
    EXPECT_GE(raw, static_cast<int>(AdaptiveSwitch::kProbeGathers));
  });
  testing::expect_no_errors(errors);
}

TEST(Engine, FsdpSplitMatchesTorchSharding) {
  const auto l = BucketLayout::fsdp_split("b", DType::kBF16, {10, 3, 0}, 4);
  // ceil(10/4) = 3: 3,3,3,1; ceil(3/4) = 1: 1,1,1,0; empty parameter: zeros.
  EXPECT_EQ(l.shard_values[0], (std::vector<uint64_t>{3, 1, 0}));
  EXPECT_EQ(l.shard_values[3], (std::vector<uint64_t>{1, 0, 0}));
  EXPECT_EQ(l.total_bytes(), 2u * 13);
  EXPECT_EQ(l.rank_offset(2), 2u * 8);
}

}  // namespace
}  // namespace ciera
