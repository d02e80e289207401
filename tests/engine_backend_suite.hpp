// The engine on a codec backend whose payload memory a test cannot touch directly (a GPU's, or
// the host test's tagged memory): every buffer is filled and read through the backend's
// MemoryOps, and the ranks are threads over the loopback transport moving bytes with that memory.
// Shared by tests/test_engine_backend.cpp (the tagged host backend, in CI) and
// tests/cuda/test_cuda_engine.cpp (the CUDA backend, on a GPU).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/engine.hpp"
#include "ciera/loopback.hpp"
#include "forwarding_transport.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"

namespace ciera::testing {

// `bytes` of a backend's payload memory.
class PayloadBytes {
 public:
  PayloadBytes(const MemoryOps& memory, size_t bytes)
      : memory_(memory), data_(memory.allocate(bytes)), bytes_(bytes) {}
  ~PayloadBytes() { memory_.free(data_, bytes_); }
  PayloadBytes(const PayloadBytes&) = delete;
  PayloadBytes& operator=(const PayloadBytes&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return bytes_; }
  std::span<std::byte> span() const { return {data_, bytes_}; }
  void put(std::span<const std::byte> host, size_t at = 0) {
    memory_.copy(data_ + at, host.data(), host.size());
  }
  std::vector<std::byte> get() const {
    std::vector<std::byte> host(bytes_);
    memory_.copy(host.data(), data_, bytes_);
    return host;
  }

 private:
  const MemoryOps& memory_;
  std::byte* data_;
  size_t bytes_;
};

using BackendOf = std::function<std::shared_ptr<const CodecBackend>(int rank)>;
using RankBody = std::function<void(int rank, Transport&, std::shared_ptr<const CodecBackend>)>;
// Wraps a rank's loopback transport (to corrupt or stall it), or replaces it (an NCCL
// transport); identity by default.
using WrapTransport = std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>, int rank)>;

// Runs `body` on `world` threads, rank r on backend_of(r) and a loopback transport moving bytes
// with that backend's memory (or with `loopback_memory`, which must read every rank's buffers,
// when ranks use different backends); returns each rank's error text ("" if none).
inline std::vector<std::string> run_backend_ranks(int world, const BackendOf& backend_of,
                                                  const RankBody& body,
                                                  const WrapTransport& wrap = {},
                                                  const MemoryOps* loopback_memory = nullptr) {
  auto shared = make_loopback_world(world);
  return on_rank_threads(world, [&](int r) {
    auto backend = backend_of(r);
    std::unique_ptr<Transport> transport =
        make_loopback_transport(shared, r, loopback_memory ? *loopback_memory : backend->memory());
    if (wrap) transport = wrap(std::move(transport), r);
    transport->set_timeout(std::chrono::seconds(30));
    body(r, *transport, backend);
  });
}

// One rank's part of a multi-bucket run: every bucket of `layouts` gathered together for `steps`
// steps, each from its own trajectory (seed `seed` + bucket; bucket 2 of special values, the
// others sparse), in place or not. Every rank's output is the rank-major concatenation of every
// rank's input, bit for bit, at every step; `check(bucket, step, stats)` sees each gather's
// stats. Returns the engine's cache_bytes() at the end.
inline size_t gather_every_bucket(int rank, Transport& t, const std::shared_ptr<const CodecBackend>& backend,
                                  const EngineConfig& config, const std::vector<BucketLayout>& layouts,
                                  DType dtype, bool in_place, int steps, uint64_t seed,
                                  const std::function<void(size_t, int, const GatherStats&)>& check) {
  const MemoryOps& memory = backend->memory();
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  std::vector<Trajectory> data;
  std::vector<std::unique_ptr<PayloadBytes>> in, out;
  for (size_t b = 0; b < layouts.size(); ++b) {
    data.emplace_back(dtype, layouts[b].total_bytes() / value_bytes,
                      b == 2 ? Pattern::kSpecial : Pattern::kSparse, seed + b);
    in.push_back(std::make_unique<PayloadBytes>(memory, layouts[b].rank_bytes(rank)));
    out.push_back(std::make_unique<PayloadBytes>(memory, layouts[b].total_bytes()));
  }
  CompressedAllgather engine(t, config, layouts, backend);
  for (int step = 0; step < steps; ++step) {
    std::vector<CompressedAllgather::Ticket> tickets;
    for (size_t b = 0; b < layouts.size(); ++b) {
      if (step > 0) data[b].step();
      const auto mine = data[b].span().subspan(layouts[b].rank_offset(rank), layouts[b].rank_bytes(rank));
      std::span<const std::byte> input;
      if (in_place) {
        out[b]->put(mine, layouts[b].rank_offset(rank));
        input = {out[b]->data() + layouts[b].rank_offset(rank), mine.size()};
      } else {
        in[b]->put(mine);
        input = {in[b]->data(), mine.size()};
      }
      tickets.push_back(engine.start(b, input, out[b]->span()));
    }
    for (size_t b = 0; b < layouts.size(); ++b) {
      const GatherStats stats = engine.wait(tickets[b]);
      const std::vector<std::byte> got = out[b]->get();
      if (!std::equal(got.begin(), got.end(), data[b].values().begin())) {
        ADD_FAILURE() << "rank " << rank << " bucket " << b << " step " << step << ": output not exact";
        return engine.cache_bytes();
      }
      check(b, step, stats);
    }
  }
  return engine.cache_bytes();
}

// Three buckets (uneven and empty shards, raw and CIERA parameters) gathered together for
// `steps` steps through warmup into compressed steady state: every rank's output is the
// rank-major concatenation of every rank's input, bit for bit, at every step; steady-state
// gathers are compressed. `in_place`: each rank's input is its slot of the output.
inline void expect_exact_gathers(int world, const BackendOf& backend_of, DType dtype,
                                 WarmupMode warmup, bool in_place, int steps = 40,
                                 const MemoryOps* loopback_memory = nullptr,
                                 const WrapTransport& wrap = {}) {
  std::vector<BucketLayout> layouts;
  layouts.push_back(BucketLayout::fsdp_split("experts", dtype, {5000, 777, 1, 4096}, world));
  layouts.push_back(BucketLayout::fsdp_split("attention", dtype, {3000, 3000}, world, ShardPolicy::kRaw));
  BucketLayout odd;
  odd.name = "odd";
  odd.dtype = dtype;
  odd.policy = {ShardPolicy::kCiera, ShardPolicy::kRaw, ShardPolicy::kCiera};
  for (int r = 0; r < world; ++r) odd.shard_values.push_back({r == 1 ? 0u : 1000u + 37u * r, 5u, r % 2 ? 3u : 600u});
  layouts.push_back(odd);
  EngineConfig config;
  config.warmup_steps = 4;
  config.warmup = warmup;
  config.codec.block_values = 256;
  expect_no_errors(run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    const size_t cache_bytes = gather_every_bucket(rank, t, backend, config, layouts, dtype, in_place, steps, 20,
                                                   [&](size_t b, int step, const GatherStats& stats) {
      // Bucket 1 has only raw parameters; the others compress after warmup.
      if (b == 1 || step < 4) {
        EXPECT_EQ(stats.compressed, b != 1 && warmup == WarmupMode::kKeyFrames);
      } else {
        EXPECT_TRUE(stats.compressed) << "bucket " << b << " step " << step;
      }
      if (b == 0 && step > 5) {
        EXPECT_LT(stats.wire_bytes, stats.raw_bytes) << "step " << step;
      }
    });
    EXPECT_GT(cache_bytes, 0u);
  }, wrap, loopback_memory));
}

// Flips one bit in the middle of rank 0's envelope (its payload's sign-mantissa plane) after
// each allgatherv call `corrupt_call(call)` picks (calls counted from 0), through `memory`.
class CorruptingTransport final : public ForwardingTransport {
 public:
  CorruptingTransport(std::unique_ptr<Transport> inner, const MemoryOps& memory,
                      std::function<bool(int)> corrupt_call)
      : ForwardingTransport(std::move(inner)),
        memory_(memory),
        corrupt_call_(std::move(corrupt_call)) {}
  std::string_view name() const override { return "corrupting"; }
  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    ForwardingTransport::allgatherv(in, out, counts, displs);
    for (const uint64_t n : counts) carried_ += n;
    if (corrupt_call_(calls_++) && counts[0] > 0) {
      std::byte* at = static_cast<std::byte*>(out) + displs[0] + counts[0] / 2;
      std::byte bit;
      memory_.copy(&bit, at, 1);
      bit ^= std::byte{0x10};
      memory_.copy(at, &bit, 1);
    }
  }
  void allgather(const void* in, size_t bytes, void* out) override {
    ForwardingTransport::allgather(in, bytes, out);
    records_carried_ += uint64_t{bytes} * static_cast<uint64_t>(size());
  }
  // Bytes all ranks' allgatherv calls carried so far (payloads: records go by allgather).
  uint64_t carried() const { return carried_; }
  // Bytes all ranks' allgather calls carried so far (the engine's records and verdicts).
  uint64_t records_carried() const { return records_carried_; }

 private:
  const MemoryOps& memory_;
  std::function<bool(int)> corrupt_call_;
  int calls_ = 0;
  uint64_t carried_ = 0;
  uint64_t records_carried_ = 0;
};

// A payload corrupted in transit on one rank is caught by that rank's decoder, every rank
// learns of it in the verdict exchange and re-sends key frames, and the output stays exact.
inline void expect_corruption_caught_and_resent(int world, const BackendOf& backend_of,
                                                ShardPolicy policy = ShardPolicy::kCiera) {
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {30000}, world, policy);
  EngineConfig config;
  config.warmup_steps = 1;
  std::vector<std::shared_ptr<const CodecBackend>> backends;
  for (int r = 0; r < world; ++r) backends.push_back(backend_of(r));
  const int victim = world - 1;
  expect_no_errors(run_backend_ranks(
      world, [&](int r) { return backends[r]; },
      [&](int rank, Transport& t, auto backend) {
        Trajectory data(DType::kBF16, layout.total_bytes() / 2, Pattern::kSparse, 6);
        PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
        PayloadBytes out(backend->memory(), layout.total_bytes());
        CompressedAllgather engine(t, config, {layout}, backend);
        for (int step = 0; step < 10; ++step) {
          data.step();
          in.put(data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank)));
          const GatherStats stats = engine.run(0, in.span(), out.span());
          EXPECT_EQ(stats.resynchronised, step == 4) << "rank " << rank << " step " << step;
          const std::vector<std::byte> got = out.get();
          ASSERT_TRUE(std::equal(got.begin(), got.end(), data.values().begin())) << step;
        }
      },
      [&](std::unique_ptr<Transport> inner, int r) -> std::unique_ptr<Transport> {
        // An agreement that matches uses no allgatherv (engine protocol 3): the payload exchange
        // of step s is call s. Step 4 is compressed (warmup 1).
        return std::make_unique<CorruptingTransport>(
            std::move(inner), backends[r]->memory(),
            [r, victim](int call) { return r == victim && call == 4; });
      }));
}

// Codec state replaced mid-run: a cold rank (reset_caches) at step 12, a policy switched on every
// rank at step 20 (raw -> CIERA and back), adaptive switching on; every gather stays exact and the
// cold rank's gather is a key-frame round.
inline void expect_exact_through_resets_and_policy_changes(int world, const BackendOf& backend_of,
                                                           const WrapTransport& wrap = {}) {
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3333, 512}, world);
  EngineConfig config;
  config.warmup_steps = 3;
  config.adaptive = true;
  expect_no_errors(run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    Trajectory data(DType::kBF16, layout.total_bytes() / 2, Pattern::kSparse, 9);
    PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
    PayloadBytes out(backend->memory(), layout.total_bytes());
    CompressedAllgather engine(t, config, {layout}, backend);
    for (int step = 0; step < 32; ++step) {
      data.step();
      if (rank == world - 1 && step == 12) engine.reset_caches();
      if (step == 20) engine.set_policy(0, 1, ShardPolicy::kRaw);
      if (step == 26) engine.set_policy(0, 1, ShardPolicy::kCiera);
      in.put(data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank)));
      const GatherStats stats = engine.run(0, in.span(), out.span());
      if (step == 12) {
        EXPECT_TRUE(stats.resynchronised) << "rank " << rank;
      }
      const std::vector<std::byte> got = out.get();
      ASSERT_TRUE(std::equal(got.begin(), got.end(), data.values().begin())) << "rank " << rank << " step " << step;
    }
  }, wrap));
}

// A problem one rank sees alone (a wrong output size, a different configuration) fails every
// rank with the same error, through the staged records.
inline void expect_every_rank_fails_together(int world, const BackendOf& backend_of) {
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {4096}, world);
  auto errors = run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    EngineConfig config;
    config.codec.block_values = rank == 1 ? 1024 : 512;
    CompressedAllgather engine(t, config, {layout}, backend);
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("configuration mismatch across ranks"), std::string::npos) << e;
    EXPECT_EQ(e, errors[0]);
  }
  errors = run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
    PayloadBytes out(backend->memory(), layout.total_bytes() + (rank == 0 ? 2 : 0));
    CompressedAllgather engine(t, EngineConfig{}, {layout}, backend);
    engine.run(0, in.span(), out.span());
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("output is"), std::string::npos) << e;
    EXPECT_EQ(e, errors[0]);
  }
}

// ---- The delta policy (value-delta streams; backends whose coders take them) -------------------

// Three buckets with delta parameters gathered together for `steps` steps: all delta (uneven and
// empty shards), delta mixed with raw and ciera in one bucket, and delta over special values
// (NaN payloads, infinities, subnormals, -0). Every rank's output is exact at every step; a
// bucket with delta parameters travels coded from its first gather, raw warmup or not (its
// ciera parameters go raw meanwhile), and cache_bytes() is exactly the codecs' state: value_bytes
// per value of every delta shard received and of this rank's own, plus the ciera caches.
inline void expect_exact_delta_gathers(int world, const BackendOf& backend_of, DType dtype,
                                       WarmupMode warmup, bool in_place, int steps = 30) {
  const auto d = ShardPolicy::kDelta, c = ShardPolicy::kCiera, r = ShardPolicy::kRaw;
  std::vector<BucketLayout> layouts;
  BucketLayout deltas;
  deltas.name = "deltas";
  deltas.dtype = dtype;
  deltas.policy = {d, d, d, d};
  for (int rank = 0; rank < world; ++rank) {
    deltas.shard_values.push_back({rank == 1 ? 0u : 3000u + 41u * rank, 1, rank % 2 ? 0u : 777u, 2048});
  }
  layouts.push_back(deltas);
  BucketLayout mixed = BucketLayout::fsdp_split("mixed", dtype, {5000, 3001, 64, 4096, 999}, world);
  mixed.policy = {d, c, r, c, d};
  layouts.push_back(mixed);
  layouts.push_back(BucketLayout::fsdp_split("special", dtype, {2500, 7}, world, d));
  EngineConfig config;
  config.warmup_steps = 4;
  config.warmup = warmup;
  config.codec.block_values = 256;
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  expect_no_errors(run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    const size_t cache_bytes = gather_every_bucket(rank, t, backend, config, layouts, dtype, in_place, steps, 70,
                                                   [&](size_t b, int step, const GatherStats& stats) {
      EXPECT_TRUE(stats.compressed) << "bucket " << b << " step " << step;
      EXPECT_EQ(stats.warmup, warmup == WarmupMode::kRaw && step < 4) << "step " << step;
    });
    // The codecs' state, exactly: delta parameters value_bytes per value, ciera ones the
    // exponent caches (exact detection: a byte per value, sender included).
    uint64_t expected = 0;
    for (const BucketLayout& l : layouts) {
      for (size_t k = 0; k < l.params(); ++k) {
        if (l.policy[k] == r) continue;
        for (int p = 0; p < world; ++p) {
          expected += l.shard_values[p][k] * (l.policy[k] == d ? value_bytes : 1);
        }
      }
    }
    EXPECT_EQ(cache_bytes, expected) << "rank " << rank;
  }));
}

// A second gather of identical input (FSDP2's backward re-gather of the forward's unchanged
// values) sends each delta shard as a header-only "unchanged" frame: the wire carries envelope
// and payload headers, nothing per value. Slightly moved values (a few percent nudged by one
// ulp, as small optimiser steps move BF16 weights) cost far less than raw bytes, and less than
// exponent reuse of the same data, which always sends every sign-mantissa bit.
inline void expect_delta_frames_are_small(int world, const BackendOf& backend_of) {
  const std::vector<uint64_t> params = {60000, 20001, 4096};
  std::vector<BucketLayout> layouts = {
      BucketLayout::fsdp_split("delta", DType::kBF16, params, world, ShardPolicy::kDelta),
      BucketLayout::fsdp_split("ciera", DType::kBF16, params, world, ShardPolicy::kCiera)};
  EngineConfig config;
  config.warmup_steps = 2;
  expect_no_errors(run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    const MemoryOps& memory = backend->memory();
    const BucketLayout& l = layouts[0];
    // The same values for both buckets: BF16 weights, 3% of them nudged by +-1 ulp per step.
    std::mt19937_64 rng(99);
    std::vector<std::byte> values(l.total_bytes());
    for (size_t i = 0; i < values.size() / 2; ++i) put_value(DType::kBF16, values, i, weight_bits(DType::kBF16, rng));
    PayloadBytes in(memory, l.rank_bytes(rank)), out(memory, l.total_bytes());
    CompressedAllgather engine(t, config, layouts, backend);
    auto gather = [&](size_t bucket) {
      in.put(std::span<const std::byte>(values).subspan(l.rank_offset(rank), l.rank_bytes(rank)));
      const GatherStats stats = engine.run(bucket, in.span(), out.span());
      const std::vector<std::byte> got = out.get();
      EXPECT_TRUE(std::equal(got.begin(), got.end(), values.begin())) << "bucket " << bucket;
      return stats;
    };
    const uint64_t header_only = world * (24 + 8 * params.size() + params.size() * 128);
    for (int step = 0; step < 8; ++step) {
      for (size_t i = 0; i < values.size() / 2; ++i) {
        if (step > 0 && rng() % 100 < 3) {
          const uint32_t v = get_value(DType::kBF16, values, i);
          put_value(DType::kBF16, values, i, (v + (rng() & 1 ? 1 : 0xFFFF)) & 0xFFFF);
        }
      }
      const GatherStats forward = gather(0);
      const GatherStats backward = gather(0);  // unchanged input
      const GatherStats ciera = gather(1);
      if (step == 0) continue;  // key frames
      EXPECT_LT(backward.wire_bytes, header_only) << "step " << step;
      EXPECT_LT(forward.wire_bytes * 3, forward.raw_bytes) << "step " << step;
      if (step > int(config.warmup_steps)) {
        EXPECT_LT(forward.wire_bytes, ciera.wire_bytes) << "step " << step;
      }
    }
  }));
}

// Policies switched on every rank mid-run, ciera <-> delta <-> raw, with a cold rank and adaptive
// switching on: every switch restarts the parameter's streams with a key frame, and every gather
// stays exact.
inline void expect_exact_through_delta_policy_switches(int world, const BackendOf& backend_of) {
  auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {20000, 3333, 512}, world);
  layout.policy[0] = ShardPolicy::kDelta;
  EngineConfig config;
  config.warmup_steps = 3;
  config.adaptive = true;
  const std::vector<std::pair<int, ShardPolicy>> switches = {
      {6, ShardPolicy::kDelta}, {10, ShardPolicy::kCiera}, {14, ShardPolicy::kRaw},
      {18, ShardPolicy::kDelta}, {22, ShardPolicy::kRaw}, {26, ShardPolicy::kCiera}};
  expect_no_errors(run_backend_ranks(world, backend_of, [&](int rank, Transport& t, auto backend) {
    Trajectory data(DType::kBF16, layout.total_bytes() / 2, Pattern::kSparse, 19);
    PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
    PayloadBytes out(backend->memory(), layout.total_bytes());
    CompressedAllgather engine(t, config, {layout}, backend);
    for (int step = 0; step < 32; ++step) {
      data.step();
      for (const auto& [at, policy] : switches) {
        if (step == at) engine.set_policy(0, 1, policy);
      }
      if (step == 12) engine.set_policy(0, 0, ShardPolicy::kCiera);
      if (step == 20) engine.set_policy(0, 0, ShardPolicy::kDelta);
      if (rank == world - 1 && step == 16) engine.reset_caches();
      in.put(data.span().subspan(layout.rank_offset(rank), layout.rank_bytes(rank)));
      const GatherStats stats = engine.run(0, in.span(), out.span());
      if (step == 16) {
        EXPECT_TRUE(stats.resynchronised) << "rank " << rank;
      }
      const std::vector<std::byte> got = out.get();
      ASSERT_TRUE(std::equal(got.begin(), got.end(), data.values().begin())) << "rank " << rank << " step " << step;
    }
  }));
}

}  // namespace ciera::testing
