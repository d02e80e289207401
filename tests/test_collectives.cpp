// The lossless collectives over the loopback transport (ranks as threads): a reduce-scatter whose
// result is, bit for bit, the documented rank-order FP32 sum computed here independently, coded
// or not; an alltoallv that delivers every part bit for bit; and the failures every rank must
// see the same way (disagreeing calls, refused arguments, a corrupted part, a dead peer).
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ciera/collectives.hpp"
#include "ciera/error.hpp"
#include "ciera/loopback.hpp"
#include "collectives/call_record.hpp"
#include "collectives/kernels.hpp"
#include "collectives/reduction.hpp"
#include "common/floats.hpp"
#include "common/thread_pool.hpp"
#include "forwarding_transport.hpp"
#include "rank_threads.hpp"
#include "record_flipping_transport.hpp"
#include "test_util.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace ciera {
namespace {

using testing::get_value;
using testing::put_value;

// Runs `body(rank, transport)` on `world` threads; returns each rank's error text ("" if none).
std::vector<std::string> run_ranks(
    int world, const std::function<void(int, std::shared_ptr<Transport>)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(20),
    const std::function<std::shared_ptr<Transport>(std::shared_ptr<Transport>, int)>& wrap = {}) {
  auto shared = make_loopback_world(world);
  return testing::on_rank_threads(world, [&](int r) {
    std::shared_ptr<Transport> transport = make_loopback_transport(shared, r);
    transport->set_timeout(timeout);
    if (wrap) transport = wrap(transport, r);
    body(r, transport);
  });
}

// Gradient-like values: N(0, scale) with a few specials where asked.
std::vector<std::byte> gradients(DType dtype, size_t n, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n * dtype_info(dtype).value_bytes);
  const auto special = testing::special_bits(dtype);
  for (size_t i = 0; i < n; ++i) {
    uint32_t v = testing::weight_bits(dtype, rng);
    if (specials && rng() % 7 == 0) v = special[rng() % special.size()];
    put_value(dtype, out, i, v);
  }
  return out;
}

float widen(DType dtype, uint32_t bits) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_float(static_cast<uint16_t>(bits));
    case DType::kFP16:
      return fp16_to_float(static_cast<uint16_t>(bits));
    case DType::kFP32:
      break;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t narrow(DType dtype, float f) {
  switch (dtype) {
    case DType::kBF16:
      return float_to_bf16(f);
    case DType::kFP16:
      return float_to_fp16(f);
    case DType::kFP32:
      break;
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// The documented reduction (docs/format.md, "Reduction order"), one value at a time. With
// `nan_meets`, counts per value the additions where two NaNs met (an inf - inf NaN too), whose
// payload IEEE 754 leaves to the hardware.
std::vector<std::byte> reference_reduction(DType dtype, ReduceOp op,
                                           const std::vector<std::vector<std::byte>>& inputs,
                                           int rank, size_t n,
                                           std::vector<int>* nan_meets = nullptr) {
  std::vector<std::byte> out(n * dtype_info(dtype).value_bytes);
  if (nan_meets) nan_meets->assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    volatile float sum =
        widen(dtype, get_value(dtype, inputs[0], static_cast<size_t>(rank) * n + i));
    for (size_t p = 1; p < inputs.size(); ++p) {
      const float x = widen(dtype, get_value(dtype, inputs[p], static_cast<size_t>(rank) * n + i));
      if (nan_meets && std::isnan(sum) && std::isnan(x)) ++(*nan_meets)[i];
      sum = sum + x;
    }
    if (op == ReduceOp::kAvg) sum = sum / static_cast<float>(inputs.size());
    put_value(dtype, out, i, narrow(dtype, sum));
  }
  return out;
}

using ReduceCase = std::tuple<DType, int, size_t, CollectiveCoding, ReduceOp>;

class ReduceScatter : public ::testing::TestWithParam<ReduceCase> {};

TEST_P(ReduceScatter, IsTheRankOrderSumBitForBit) {
  const auto [dtype, world, n, coding, op] = GetParam();
  const bool specials = n % 2 == 1;
  std::vector<std::vector<std::byte>> inputs;
  for (int r = 0; r < world; ++r)
    inputs.push_back(gradients(dtype, n * static_cast<size_t>(world), 100 + r, specials));
  std::vector<std::vector<std::byte>> outputs(static_cast<size_t>(world)),
      twins(static_cast<size_t>(world));
  std::vector<CollectiveStats> stats(static_cast<size_t>(world));
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
    CollectivesConfig config;
    config.coding = coding;
    config.slice_values = 1000;  // 5000 values: seven rounds (250, five of 900, 250)
    // Every round on the caller's thread, one worker, or two (rounds' tasks running at once).
    config.worker_threads = static_cast<unsigned>(world + static_cast<int>(op)) % 3;
    LosslessCollectives collectives(t, config);
    auto& out = outputs[static_cast<size_t>(rank)];
    out.assign(n * dtype_info(dtype).value_bytes, std::byte{0xAB});
    // Twice: the second call reuses the buffers (and, with auto, may switch).
    for (int call = 0; call < 2; ++call)
      stats[static_cast<size_t>(rank)] =
          collectives.reduce_scatter(dtype, op, inputs[static_cast<size_t>(rank)], out);
    // The uncompressed twin on the same transport.
    LosslessCollectives raw(t, {.coding = CollectiveCoding::kRaw});
    twins[static_cast<size_t>(rank)].resize(out.size());
    raw.reduce_scatter(dtype, op, inputs[static_cast<size_t>(rank)],
                       twins[static_cast<size_t>(rank)]);
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    // Bit for bit the twin's, NaN payloads included; the independent reference too, but where two
    // NaNs meet the hardware picks the payload (IEEE 754 leaves it open), so there any NaN does.
    EXPECT_EQ(outputs[static_cast<size_t>(r)], twins[static_cast<size_t>(r)]) << "rank " << r;
    const auto expected = reference_reduction(dtype, op, inputs, r, n);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t got = get_value(dtype, outputs[static_cast<size_t>(r)], i),
                     want = get_value(dtype, expected, i);
      if (got != want && !(std::isnan(widen(dtype, got)) && std::isnan(widen(dtype, want)))) {
        ADD_FAILURE() << "rank " << r << " value " << i << ": " << std::hex << got
                      << " != " << want;
        break;
      }
    }
    const CollectiveStats& s = stats[static_cast<size_t>(r)];
    EXPECT_EQ(s.raw_bytes, (static_cast<uint64_t>(world) - 1) * n * dtype_info(dtype).value_bytes);
    if (coding == CollectiveCoding::kRaw || world == 1 || n == 0) {
      EXPECT_EQ(s.wire_bytes, s.raw_bytes);
    } else if (coding == CollectiveCoding::kExponent && n >= 4096) {
      // Gradient-like exponents take a few bits of their 8 (FP16: 5), less the frames' own
      // bytes (header, table, checksum) per slice: every slice is coded, but FP16's 250-value
      // edges, which its frame's own bytes leave no smaller, may go raw.
      const auto rounds = static_cast<uint32_t>(collectives::rounds_of(n, 1000));
      const auto peers = static_cast<uint32_t>(world - 1);
      if (dtype == DType::kFP16) {
        EXPECT_GE(s.coded_slices, peers * (rounds - 2));
      } else {
        EXPECT_EQ(s.coded_slices, peers * rounds);
      }
      const double most = dtype == DType::kBF16 ? 0.85 : dtype == DType::kFP32 ? 0.95 : 1.0;
      EXPECT_LT(s.wire_bytes, s.raw_bytes * most);
    }
  }
}

std::string reduce_case_name(const ::testing::TestParamInfo<ReduceCase>& info) {
  const auto [dtype, world, n, coding, op] = info.param;
  return std::string(dtype_name(dtype)) + "_w" + std::to_string(world) + "_n" + std::to_string(n) +
         "_" + std::string(collective_coding_name(coding)) + "_" + std::string(reduce_op_name(op));
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, ReduceScatter,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                       ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(size_t{0}, size_t{1}, size_t{777}, size_t{5000}),
                       ::testing::Values(CollectiveCoding::kRaw, CollectiveCoding::kExponent,
                                         CollectiveCoding::kAuto),
                       ::testing::Values(ReduceOp::kSum, ReduceOp::kAvg)),
    reduce_case_name);

// The rounds' slices (docs/format.md, "Rounds"): an edge of S / 4 values first and last, the
// values between them in slices of at most S, as even as whole values allow; short parts are an
// edge and the rest. Every part is covered once, in order.
TEST(Rounds, ShortEdgesAroundEvenSlices) {
  using collectives::rounds_of;
  using collectives::slice_of;
  auto slices = [](uint64_t values, uint64_t slice_values) {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (uint32_t k = 0; k < rounds_of(values, slice_values); ++k) {
      const auto [begin, count] = slice_of(values, k, slice_values);
      out.emplace_back(begin, count);
    }
    return out;
  };
  using Slices = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(slices(0, 1000), Slices{});
  EXPECT_EQ(slices(1, 1000), (Slices{{0, 1}}));
  EXPECT_EQ(slices(250, 1000), (Slices{{0, 250}}));
  EXPECT_EQ(slices(251, 1000), (Slices{{0, 250}, {250, 1}}));
  EXPECT_EQ(slices(500, 1000), (Slices{{0, 250}, {250, 250}}));
  EXPECT_EQ(slices(501, 1000), (Slices{{0, 250}, {250, 1}, {251, 250}}));
  EXPECT_EQ(slices(1500, 1000), (Slices{{0, 250}, {250, 1000}, {1250, 250}}));
  EXPECT_EQ(slices(1501, 1000), (Slices{{0, 250}, {250, 501}, {751, 500}, {1251, 250}}));
  EXPECT_EQ(
      slices(5000, 1000),
      (Slices{
          {0, 250}, {250, 900}, {1150, 900}, {2050, 900}, {2950, 900}, {3850, 900}, {4750, 250}}));
  EXPECT_EQ(slices(3, 1), (Slices{{0, 1}, {1, 1}, {2, 1}}));  // an edge of at least one value
  EXPECT_EQ(slices(7, 3), (Slices{{0, 1}, {1, 3}, {4, 2}, {6, 1}}));
  // The library's default: a gradient part of 3.7M values in slices of 2^20.
  const auto big = slices(3'700'000, uint64_t{1} << 20);
  ASSERT_EQ(big.size(), 6U);
  EXPECT_EQ(big.front(), (std::pair<uint64_t, uint64_t>{0, 262144}));
  EXPECT_EQ(big.back(), (std::pair<uint64_t, uint64_t>{3'700'000 - 262144, 262144}));
  // Past the last round: nothing.
  EXPECT_EQ(slice_of(5000, 7, 1000).values, 0U);
  for (uint64_t values : {0ULL, 1ULL, 2ULL, 999ULL, 1000ULL, 2001ULL, 123457ULL}) {
    for (uint64_t s : {1ULL, 2ULL, 5ULL, 1000ULL, 4096ULL}) {
      uint64_t next = 0;
      for (const auto& [begin, count] : slices(values, s)) {
        ASSERT_EQ(begin, next) << values << " in slices of " << s;
        ASSERT_GE(count, 1U);
        ASSERT_LE(count, s);
        next = begin + count;
      }
      EXPECT_EQ(next, values) << values << " in slices of " << s;
    }
  }
}

// Slices of several frames each (collectives/slice_coding.hpp), the last of a slice shorter and
// frame sizes that differ between ranks (they need not match): the twin's result bit for bit,
// every part's frames read as each sender cut them.
TEST(ReduceScatterFrames, SlicesOfSeveralFramesAreTheTwinsResultBitForBit) {
  const int world = 3;
  const size_t n = 10000;  // four rounds in slices of 4096: 1024, two of 3976, 1024
  std::vector<std::vector<std::byte>> inputs, outputs(world), twins(world);
  for (int r = 0; r < world; ++r)  // rank 1's with specials (NaN payloads, infinities, ...)
    inputs.push_back(gradients(DType::kBF16, n * world, 300 + r, r == 1));
  std::vector<CollectiveStats> stats(world);
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
    CollectivesConfig config;
    config.slice_values = 4096;
    config.frame_values = rank == 2 ? 1500 : 1000;
    LosslessCollectives collectives(t, config);
    outputs[rank].resize(n * 2);
    stats[rank] =
        collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, inputs[rank], outputs[rank]);
    LosslessCollectives raw(t, {.coding = CollectiveCoding::kRaw, .slice_values = 4096});
    twins[rank].resize(n * 2);
    raw.reduce_scatter(DType::kBF16, ReduceOp::kSum, inputs[rank], twins[rank]);
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(outputs[r], twins[r]) << "rank " << r;
    EXPECT_EQ(stats[r].coded_slices, 2u * 4u) << "rank " << r;  // every slice coded
    if (r != 1) {
      EXPECT_LT(stats[r].wire_bytes, stats[r].raw_bytes * 0.85) << "rank " << r;
    }
  }
}

TEST(ReduceScatterOrder, IsRankOrderNotAnyOther) {
  // 1 + 2^-24 + 2^-24 in FP32: rank order gives 1 (each tiny addend rounds away), the other
  // order 1 + 2^-23. The result must be the rank-order one on every rank.
  const int world = 3;
  const float values[3] = {1.0f, 0x1p-24f, 0x1p-24f};
  std::vector<std::vector<std::byte>> inputs(world);
  for (int r = 0; r < world; ++r) {
    inputs[r].resize(world * 4);
    for (int p = 0; p < world; ++p) std::memcpy(inputs[r].data() + 4 * p, &values[r], 4);
  }
  std::vector<float> results(world);
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    collectives.reduce_scatter(DType::kFP32, ReduceOp::kSum, inputs[rank],
                               {reinterpret_cast<std::byte*>(&results[rank]), 4});
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(results[r], 1.0f) << "rank " << r;
  }
}

// Every SIMD target's reduction kernels against the one-value definition, bit for bit: lengths
// around the vector widths and the 2048-value passes, one to five parts, the output in place of
// the first part or apart, sums and averages, specials among the values. Where two NaNs meet in
// an addition, IEEE 754 leaves the payload to the hardware (docs/format.md): a NaN is all that
// is asked there.
TEST(ReductionKernels, EveryTargetIsTheRankOrderDefinition) {
  std::mt19937_64 rng(20261202);
  for (const collectives::ReductionKernels* kernels :
       testing::kernels_of_every_target(collectives::reduction_kernels_for)) {
    for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      for (size_t count = 1; count <= 5; ++count) {
        for (size_t n : {0, 1, 7, 15, 16, 17, 31, 33, 64, 2047, 2048, 2049, 4100}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
            for (bool in_place : {false, true}) {
              std::vector<std::vector<std::byte>> parts;
              for (size_t p = 0; p < count; ++p)
                parts.push_back(gradients(dtype, n, rng(), /*specials=*/p % 2 == 1));
              std::vector<int> nans;
              const auto expected = reference_reduction(dtype, op, parts, 0, n, &nans);
              std::vector<std::byte> separate(expected.size());
              std::byte* out = in_place ? parts[0].data() : separate.data();
              std::vector<const std::byte*> pointers;
              for (const auto& part : parts) pointers.push_back(part.data());
              collectives::reduce_in_rank_order(*kernels, dtype, op, pointers, out, n);
              const std::vector<std::byte> got(out, out + expected.size());
              for (size_t i = 0; i < n; ++i) {
                const uint32_t want = get_value(dtype, expected, i),
                               have = get_value(dtype, got, i);
                if (nans[i] > 0) {
                  ASSERT_TRUE(std::isnan(widen(dtype, have)))
                      << kernels->target << " " << dtype_name(dtype) << " value " << i;
                } else {
                  ASSERT_EQ(have, want) << kernels->target << " " << dtype_name(dtype) << ", "
                                        << count << " parts of " << n << ", value " << i << ", "
                                        << reduce_op_name(op) << (in_place ? ", in place" : "");
                }
              }
            }
          }
        }
      }
    }
  }
}

// The reduction is the definition's whatever the caller's floating-point mode: a caller that
// flushes subnormals (torch.set_flush_denormal(True) sets FTZ and DAZ on its own thread) reduced
// them to zero while the pool's workers, in the default mode, did not, so a reduce-scatter's bits
// depended on which thread reduced a round. Subnormal sums here stay subnormal, and the caller's
// mode is given back.
TEST(ReductionKernels, TheCallersFlushToZeroModeChangesNoBit) {
#if defined(__x86_64__) || defined(__i386__)
  const float tiny = std::numeric_limits<float>::denorm_min() * 1000;
  std::vector<float> a(100, tiny), b(100, tiny), out(100, 1.0f);
  const std::byte* parts[] = {reinterpret_cast<const std::byte*>(a.data()),
                              reinterpret_cast<const std::byte*>(b.data())};
  const unsigned before = _mm_getcsr();
  _mm_setcsr(before | 0x8040u);  // FTZ and DAZ
  collectives::reduce_in_rank_order(DType::kFP32, ReduceOp::kSum, parts,
                                    reinterpret_cast<std::byte*>(out.data()), out.size());
  const unsigned after = _mm_getcsr();
  _mm_setcsr(before);
  EXPECT_EQ(after, before | 0x8040u);  // the caller's mode, back
  for (float v : out) ASSERT_EQ(v, 2 * tiny);
#else
  GTEST_SKIP() << "the flush-to-zero mode is tested on x86 only";
#endif
}

// arrival_wait_s is the wait for the last rank to enter the call: long on the ranks that came
// early, short on the one that came last.
TEST(ReduceScatterStats, ArrivalWaitIsTheWaitForTheLastRank) {
  const int world = 3;
  std::vector<double> waits(world, -1);
  std::latch early_ranks_ready(world - 1);
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    const auto in = gradients(DType::kBF16, 64 * world, 7 + rank, false);
    std::vector<std::byte> out(64 * 2);
    // Rank 2 comes a second after ranks 0 and 1 are at the call, however late a loaded machine
    // (or a sanitizer) makes them on the way to it.
    if (rank == 2) {
      early_ranks_ready.wait();
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    } else {
      early_ranks_ready.count_down();
    }
    waits[rank] = collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out).arrival_wait_s;
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  EXPECT_GE(waits[0], 0.5);
  EXPECT_GE(waits[1], 0.5);
  EXPECT_GE(waits[2], 0.0);
  EXPECT_LT(waits[2], std::min(waits[0], waits[1]));
}

// busiest_link_*: the most bytes one rank sent or received in the call, as sent and raw, the
// same on every rank. Parts for rank 0 are random bits (they go raw), the rest zeros (they code
// to little more than their sign-mantissa plane): rank 0's incoming link is the busiest, raw,
// while the byte ratio of the mean link is above 1.4; with every part zero, every link carries
// the same, and the busiest is the largest sender's.
TEST(ReduceScatterStats, BusiestLinkIsTheMostOneRankSentOrReceived) {
  const int world = 4;
  const uint64_t n = 5000;  // values per part: several rounds of 1024
  for (const bool random_to_zero : {true, false}) {
    for (const CollectiveCoding coding : {CollectiveCoding::kExponent, CollectiveCoding::kRaw}) {
      std::vector<CollectiveStats> stats(world);
      const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
        CollectivesConfig config;
        config.coding = coding;
        config.slice_values = 1024;
        LosslessCollectives collectives(t, config);
        std::vector<std::byte> in(world * n * 2, std::byte{0}), out(n * 2);
        std::mt19937_64 rng(11 + rank);
        if (random_to_zero) {
          for (uint64_t i = 0; i < n; ++i) put_value(DType::kBF16, in, i, rng() & 0xffff);
        }
        stats[rank] = collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
      });
      const std::string what = std::string(random_to_zero ? "random parts to rank 0" : "zeros") +
                               ", " + std::string(collective_coding_name(coding));
      uint64_t raw = 0, wire = 0, most_sent = 0;
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(errors[r], "") << what << ", rank " << r;
        raw += stats[r].raw_bytes;
        wire += stats[r].wire_bytes;
        most_sent = std::max(most_sent, stats[r].wire_bytes);
        EXPECT_EQ(stats[r].busiest_link_raw_bytes, (world - 1) * n * 2) << what << ", rank " << r;
        EXPECT_EQ(stats[r].busiest_link_wire_bytes, stats[0].busiest_link_wire_bytes)
            << what << ", rank " << r;
      }
      const uint64_t busiest = stats[0].busiest_link_wire_bytes;
      if (coding == CollectiveCoding::kRaw) {
        EXPECT_EQ(busiest, (world - 1) * n * 2) << what;
      } else if (random_to_zero) {
        EXPECT_EQ(busiest, (world - 1) * n * 2) << what;  // rank 0 receives three raw parts
        EXPECT_GT(10 * raw, 14 * wire) << what;           // while the mean link's is above 1.4
      } else {
        EXPECT_EQ(busiest, most_sent) << what;  // every part alike: the senders are the busiest
        EXPECT_LT(10 * busiest, 6 * (world - 1) * n * 2) << what;  // the exponents, gone
      }
    }
  }
}

// Counts what this rank hands the transport: its input to every allgather (the records and
// verdicts) and the bytes it sends peers in every alltoallv (the parts).
class CountingTransport final : public testing::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void allgather(const void* in, size_t bytes, void* out) override {
    allgathered += bytes;
    ForwardingTransport::allgather(in, bytes, out);
  }
  void alltoallv(const void* in, std::span<const uint64_t> sc, std::span<const uint64_t> sd,
                 void* out, std::span<const uint64_t> rc, std::span<const uint64_t> rd) override {
    for (size_t p = 0; p < sc.size(); ++p)
      if (static_cast<int>(p) != rank()) sent += sc[p];
    ForwardingTransport::alltoallv(in, sc, sd, out, rc, rd);
  }
  uint64_t allgathered = 0, sent = 0;
};

// control_bytes is exactly the records and verdict this rank gave the record exchanges, one
// record a round (one for a call of empty parts), and wire_bytes + control_bytes all it sent: no
// figure built on the stats leaves out the records (a user audit found them in none).
TEST(CollectiveStats, ControlBytesAreTheRecordsAndVerdictThisRankSent) {
  const int world = 3;
  const uint64_t slice_values = 1024;
  const uint64_t record_bytes = collectives::call_record_bytes(world);
  // counts[from][to] of the alltoallv: uneven, a zero among them; the longest sets the rounds.
  const std::vector<std::vector<uint64_t>> counts = {{0, 5000, 17}, {300, 0, 0}, {1, 2048, 0}};
  for (const CollectiveCoding coding : {CollectiveCoding::kExponent, CollectiveCoding::kRaw}) {
    for (const uint64_t n : {uint64_t{5000}, uint64_t{0}}) {
      const auto errors = run_ranks(
          world,
          [&](int rank, std::shared_ptr<Transport> t) {
            auto& counted = dynamic_cast<CountingTransport&>(*t);
            CollectivesConfig config;
            config.coding = coding;
            config.slice_values = slice_values;
            LosslessCollectives collectives(t, config);
            const std::string what = std::string(collective_coding_name(coding)) + ", " +
                                     std::to_string(n) + " values, rank " + std::to_string(rank);
            auto expect_counted = [&](const CollectiveStats& s, uint64_t allgathered, uint64_t sent,
                                      uint64_t longest, const char* call) {
              const uint64_t rounds =
                  std::max<uint64_t>(1, collectives::rounds_of(longest, slice_values));
              EXPECT_EQ(s.control_bytes, counted.allgathered - allgathered) << call << ", " << what;
              EXPECT_EQ(s.control_bytes, rounds * record_bytes + collectives::verdict_bytes())
                  << call << ", " << what;
              EXPECT_EQ(s.wire_bytes, counted.sent - sent) << call << ", " << what;
            };
            // Twice each: a call's figure is its own, not the object's running total.
            for (int call = 0; call < 2; ++call) {
              const auto in = gradients(DType::kBF16, n * world, 40 + rank, false);
              std::vector<std::byte> out(n * 2);
              uint64_t allgathered = counted.allgathered, sent = counted.sent;
              const CollectiveStats rs =
                  collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
              expect_counted(rs, allgathered, sent, n, "reduce_scatter");

              std::vector<uint64_t> send = counts[rank], recv(world);
              uint64_t longest = 0, total_in = 0, total_out = 0;
              for (int p = 0; p < world; ++p) {
                if (n == 0) send[p] = 0;  // the empty call of each kind
                recv[p] = n == 0 ? 0 : counts[p][rank];
                for (uint64_t c : counts[p]) longest = std::max(longest, n == 0 ? 0 : c);
                total_in += send[p], total_out += recv[p];
              }
              const auto parts = gradients(DType::kBF16, total_in, 50 + rank, false);
              std::vector<std::byte> received(total_out * 2);
              allgathered = counted.allgathered, sent = counted.sent;
              const CollectiveStats a2a =
                  collectives.alltoallv(DType::kBF16, parts, send, received, recv);
              expect_counted(a2a, allgathered, sent, longest, "alltoallv");
            }
          },
          std::chrono::seconds(20),
          [](std::shared_ptr<Transport> inner, int) {
            return std::make_shared<CountingTransport>(std::move(inner));
          });
      for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    }
  }
}

class Alltoallv : public ::testing::TestWithParam<std::tuple<DType, int, CollectiveCoding>> {};

TEST_P(Alltoallv, DeliversEveryPartBitForBit) {
  const auto [dtype, world, coding] = GetParam();
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  // counts[from][to], zeros and odd sizes among them.
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint64_t>> counts(world, std::vector<uint64_t>(world));
  for (auto& row : counts)
    for (auto& c : row) c = rng() % 4 == 0 ? 0 : rng() % 6000;
  std::vector<std::vector<std::byte>> inputs;
  for (int r = 0; r < world; ++r) {
    uint64_t total = 0;
    for (uint64_t c : counts[r]) total += c;
    inputs.push_back(gradients(dtype, total, 300 + r, r % 2 == 0));
  }
  std::vector<std::vector<std::byte>> outputs(world);
  const auto errors = run_ranks(world, [&](int rank, std::shared_ptr<Transport> t) {
    CollectivesConfig config;
    config.coding = coding;
    config.slice_values = 1024;  // parts of up to 6000 values: up to eight rounds, uneven
    config.worker_threads = static_cast<unsigned>(world + static_cast<int>(dtype)) % 3;
    LosslessCollectives collectives(t, config);
    std::vector<uint64_t> recv(world);
    uint64_t total = 0;
    for (int p = 0; p < world; ++p) total += recv[p] = counts[p][rank];
    outputs[rank].assign(total * value_bytes, std::byte{0});
    collectives.alltoallv(dtype, inputs[rank], counts[rank], outputs[rank], recv);
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    std::vector<std::byte> expected;
    for (int p = 0; p < world; ++p) {
      uint64_t at = 0;
      for (int q = 0; q < r; ++q) at += counts[p][q];
      expected.insert(expected.end(), inputs[p].begin() + at * value_bytes,
                      inputs[p].begin() + (at + counts[p][r]) * value_bytes);
    }
    EXPECT_EQ(outputs[r], expected) << "rank " << r;
  }
}

using AlltoallvCase = std::tuple<DType, int, CollectiveCoding>;

std::string alltoallv_case_name(const ::testing::TestParamInfo<AlltoallvCase>& info) {
  const auto [dtype, world, coding] = info.param;
  return std::string(dtype_name(dtype)) + "_w" + std::to_string(world) + "_" +
         std::string(collective_coding_name(coding));
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, Alltoallv,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                       ::testing::Values(1, 2, 4),
                       ::testing::Values(CollectiveCoding::kRaw, CollectiveCoding::kExponent)),
    alltoallv_case_name);

void expect_every_rank(const std::vector<std::string>& errors, const std::string& text) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_NE(errors[r].find(text), std::string::npos) << "rank " << r << ": " << errors[r];
}

TEST(CollectiveFailures, RanksThatDisagreeOnTheCallFailTogether) {
  const auto errors = run_ranks(3, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    const DType dtype = rank == 2 ? DType::kFP16 : DType::kBF16;
    std::vector<std::byte> in(3 * 64 * 2), out(64 * 2);
    collectives.reduce_scatter(dtype, ReduceOp::kSum, in, out);
  });
  expect_every_rank(
      errors,
      "differs between ranks: rank 0 runs a reduce_scatter of bf16 (sum, 64 values per rank), "
      "rank 2 a reduce_scatter of fp16");
}

TEST(CollectiveFailures, RanksWithDifferentSlicesFailTogether) {
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    CollectivesConfig config;
    config.slice_values = rank == 0 ? 1000 : 2000;
    LosslessCollectives collectives(t, config);
    std::vector<std::byte> in(2 * 4000 * 4), out(4000 * 4);
    collectives.reduce_scatter(DType::kFP32, ReduceOp::kSum, in, out);
  });
  expect_every_rank(errors,
                    "rank 1 is in round 0 of slices of 2000 values, rank 0 in round 0 of 1000");
}

// A decoder takes only frames of its own block size and checksum setting: ranks that differ in
// either fail together, naming the setting, before any frame is sent (not as a frame that does
// not decode), in the exponent-coded call and its raw twin alike.
TEST(CollectiveFailures, RanksWithDifferentFrameSettingsFailTogetherNamingThem) {
  for (const bool blocks : {true, false}) {
    for (const CollectiveCoding coding : {CollectiveCoding::kExponent, CollectiveCoding::kRaw}) {
      const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
        CollectivesConfig config;
        config.coding = coding;
        if (blocks) config.block_values = rank == 0 ? 512 : 1024;
        if (!blocks) config.content_checksum = rank == 0;
        LosslessCollectives collectives(t, config);
        std::vector<std::byte> in(2 * 4000 * 2), out(4000 * 2);
        collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
      });
      expect_every_rank(errors,
                        blocks ? "call 0: rank 1 codes with block_values 1024, rank 0 with 512 "
                                 "(CollectivesConfig.block_values must match)"
                               : "call 0: rank 1 codes with content_checksum off, rank 0 with on "
                                 "(CollectivesConfig.content_checksum must match)");
    }
  }
}

// Rounds write the output while later rounds read the input: in place, counts that differ
// between pairs of ranks came back wrong with no error. Refused on every rank, one rank's
// overlap being enough.
TEST(CollectiveFailures, AlltoallvInPlaceFailsEveryRank) {
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    const std::vector<uint64_t> send = {3000, 5000};  // each rank's
    const uint64_t from_each = send[static_cast<size_t>(rank)];
    const std::vector<uint64_t> recv = {from_each, from_each};
    std::vector<std::byte> buffer(10000 * 4), apart(2 * from_each * 4);
    const std::span<const std::byte> in(buffer.data(), 8000 * 4);
    const std::span<std::byte> out = rank == 1 ? std::span<std::byte>(buffer) : apart;  // in place
    collectives.alltoallv(DType::kFP32, in, send, out, recv);
  });
  expect_every_rank(
      errors, "alltoallv: the input and the output overlap; give the output a buffer of its own");
}

TEST(CollectiveFailures, AlltoallvCountsThatDoNotMatchFailEveryRank) {
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    const std::vector<uint64_t> send = {10, rank == 0 ? 5u : 7u};
    const std::vector<uint64_t> recv = {10, 6};  // rank 1 expects 6 from itself: it sends 7
    std::vector<std::byte> in((send[0] + send[1]) * 4), out(16 * 4);
    collectives.alltoallv(DType::kFP32, in, send, out, recv);
  });
  expect_every_rank(errors, "rank 0 sends rank 1 5 values, but rank 1 expects 10 from it");
}

TEST(CollectiveFailures, ARankThatRefusesItsArgumentsIsNamedOnEveryRankAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(3, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    std::vector<std::byte> in(3 * 8 * 2 + (rank == 1 ? 2 : 0)), out(8 * 2);
    collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));  // not a timeout
  EXPECT_NE(errors[1].find("reduce_scatter: the input must be 3 parts of the output's 16 bytes"),
            std::string::npos)
      << errors[1];
  // The peers name the reason too (rank 1's error text, exchanged once the records show it).
  for (int r : {0, 2}) {
    EXPECT_EQ(errors[r].rfind(
                  "lossless collectives: rank 1 refused its arguments to its reduce_scatter "
                  "call 0: reduce_scatter: the input must be 3 parts of the output's 16 bytes",
                  0),
              0u)
        << errors[r];
  }
}

// What a caller above the library refuses (a DTensor, a tensor of another dtype) fails the call on
// every rank at once, as the library's own refusals do; the next call then works everywhere.
TEST(CollectiveFailures, ACallersRefusalIsNamedOnEveryRankAtOnceAndTheNextCallWorks) {
  for (const bool alltoallv : {false, true}) {
    const auto start = std::chrono::steady_clock::now();
    const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
      LosslessCollectives collectives(t);
      std::vector<std::byte> in(2 * 8 * 2, std::byte{0x3f}), out(8 * 2);
      const std::vector<uint64_t> counts = {8, 8};
      auto call = [&] {
        if (alltoallv) {
          std::vector<std::byte> all(in.size());
          collectives.alltoallv(DType::kBF16, in, counts, all, counts);
        } else {
          collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
        }
      };
      try {
        if (rank == 1 && alltoallv) collectives.refuse_alltoallv("alltoallv input is a DTensor");
        if (rank == 1 && !alltoallv)
          collectives.refuse_reduce_scatter("reduce_scatter input is a DTensor");
        call();
        ADD_FAILURE() << "rank " << rank << ": the refused call completed";
      } catch (const ConfigError& e) {
        const std::string want =
            rank == 1
                ? (alltoallv ? "alltoallv input is a DTensor" : "reduce_scatter input is a DTensor")
                : (alltoallv ? "rank 1 refused its arguments to its alltoallv call 0"
                             : "rank 1 refused its arguments to its reduce_scatter call 0");
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      call();
    });
    testing::expect_no_errors(errors);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
}

// A caller that leaves a reduce-scatter to its own (DeepSpeed's, for a tensor CIERA does not take)
// decides on its rank alone: where every rank does, the call passes through with one record
// exchanged and the next call runs in step; where some ranks run it, every rank throws the same
// ConfigError naming both sides and the reasons, at once (not at the timeout: each side would sit
// in its own collective), and with a refusal among them, the refusal. The next call then works.
TEST(CollectiveFailures, APassThroughIsAgreedOnEveryRankAndNamedWhereRanksDiffer) {
  enum class Choice { kRun, kPass, kRefuse };
  using C = Choice;
  const std::vector<std::vector<Choice>> cases = {{C::kPass, C::kPass, C::kPass},
                                                  {C::kRun, C::kPass, C::kPass},
                                                  {C::kPass, C::kRun, C::kRun},
                                                  {C::kRefuse, C::kPass, C::kRun}};
  const std::vector<std::string> wanted = {
      "",
      "lossless collectives: reduce_scatter call 1 runs on rank 0, but ranks 1, 2 pass it through "
      "to the caller's own (every rank must make the same choice); rank 1: not contiguous on 1; "
      "rank 2: not contiguous on 2",
      "lossless collectives: reduce_scatter call 1 runs on ranks 1, 2, but rank 0 passes it "
      "through to the caller's own (every rank must make the same choice); rank 0: not "
      "contiguous on 0",
      "lossless collectives: rank 0 refused its arguments to its reduce_scatter call 1: a DTensor"};
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::string> thrown(3);
    const auto errors = run_ranks(3, [&](int rank, std::shared_ptr<Transport> t) {
      LosslessCollectives collectives(t);
      std::vector<std::byte> in(3 * 8 * 2, std::byte{0x3f}), out(8 * 2);
      collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);  // call 0
      try {
        switch (cases[c][static_cast<size_t>(rank)]) {
          case C::kRun:
            collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
            break;
          case C::kPass:
            collectives.pass_through_reduce_scatter("not contiguous on " + std::to_string(rank));
            break;
          case C::kRefuse:
            collectives.refuse_reduce_scatter("a DTensor");
        }
      } catch (const ConfigError& e) {
        thrown[static_cast<size_t>(rank)] = e.what();
      }
      // In step again, whatever the call before: the sum of three ranks' 0x3f3f (0.74609375).
      std::fill(out.begin(), out.end(), std::byte{0});
      collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
      EXPECT_EQ(get_value(DType::kBF16, out, 7), 0x400f) << "rank " << rank;
    });
    testing::expect_no_errors(errors);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << "case " << c;
    for (size_t r = 0; r < 3; ++r) {
      // The refusing rank throws its own reason, as refuse_reduce_scatter() always has.
      const std::string want = cases[c][r] == C::kRefuse ? "a DTensor" : wanted[c];
      EXPECT_EQ(thrown[r], want) << "case " << c << ", rank " << r;
    }
  }
}

// An unknown dtype or op is refused like any other argument: named on its rank, and its peers
// hear of it at once, not after the timeout, nor as a record they cannot read.
TEST(CollectiveFailures, AnUnknownDtypeOrOpOnOneRankIsNamedOnEveryRankAtOnce) {
  for (const bool bad_op : {false, true}) {
    const auto start = std::chrono::steady_clock::now();
    const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
      LosslessCollectives collectives(t);
      std::vector<std::byte> in(2 * 8 * 2), out(8 * 2);
      const DType dtype = rank == 1 && !bad_op ? static_cast<DType>(7) : DType::kBF16;
      const ReduceOp op = rank == 1 && bad_op ? static_cast<ReduceOp>(2) : ReduceOp::kSum;
      collectives.reduce_scatter(dtype, op, in, out);
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_NE(errors[1].find(bad_op ? "reduce_scatter: unknown reduce op code 2"
                                    : "reduce_scatter: unknown dtype code 7"),
              std::string::npos)
        << errors[1];
    EXPECT_NE(errors[0].find("rank 1 refused its arguments"), std::string::npos) << errors[0];
  }
}

// Counts whose bytes pass 2^64 - 1 used to wrap around to a small size that the buffers matched.
TEST(CollectiveFailures, AlltoallvCountsPastSixtyFourBitsAreRefusedOnEveryRank) {
  const auto errors = run_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    LosslessCollectives collectives(t);
    const uint64_t huge = (uint64_t{1} << 62) + 4;  // FP32: 2^64 + 16 bytes, 16 once wrapped
    const std::vector<uint64_t> send = {0, rank == 0 ? huge : 0};
    const std::vector<uint64_t> recv = {rank == 1 ? huge : 0, 0};
    std::vector<std::byte> in(16), out(16);
    collectives.alltoallv(
        DType::kFP32, rank == 0 ? std::span<const std::byte>(in) : std::span<const std::byte>(),
        send, rank == 1 ? std::span<std::byte>(out) : std::span<std::byte>(), recv);
  });
  EXPECT_NE(errors[0].find("alltoallv: the send counts add up to more than 2^64 - 1 bytes"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("alltoallv: the receive counts add up to more than 2^64 - 1 bytes"),
            std::string::npos)
      << errors[1];
}

// Flips one byte of what rank `victim` receives in every alltoallv from the `first`-th on.
class CorruptingTransport final : public testing::ForwardingTransport {
 public:
  CorruptingTransport(std::shared_ptr<Transport> inner, bool victim, int first = 0)
      : ForwardingTransport(std::move(inner)), victim_(victim), first_(first) {}
  std::string_view name() const override { return "corrupting"; }
  void alltoallv(const void* in, std::span<const uint64_t> sc, std::span<const uint64_t> sd,
                 void* out, std::span<const uint64_t> rc, std::span<const uint64_t> rd) override {
    ForwardingTransport::alltoallv(in, sc, sd, out, rc, rd);
    const size_t peer = static_cast<size_t>(1 - rank());
    if (victim_ && calls_++ >= first_ && rc[peer] > 100)
      static_cast<std::byte*>(out)[rd[peer] + rc[peer] - 9] ^= std::byte{0x10};
  }

 private:
  bool victim_;
  int first_, calls_ = 0;
};

TEST(CollectiveFailures, ACorruptedPartIsAnErrorOnEveryRankAndTheOutputIsUntouched) {
  const size_t n = 4096;
  std::vector<std::vector<std::byte>> outputs(2);
  const auto errors = run_ranks(
      2,
      [&](int rank, std::shared_ptr<Transport> t) {
        LosslessCollectives collectives(t,
                                        {.slice_values = 1024});  // six rounds, each one corrupted
        const auto in = gradients(DType::kBF16, 2 * n, 9 + rank, false);
        outputs[rank].assign(n * 2, std::byte{0x5A});
        collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, outputs[rank]);
      },
      std::chrono::seconds(20),
      [](std::shared_ptr<Transport> inner, int rank) {
        return std::make_shared<CorruptingTransport>(std::move(inner), rank == 1);
      });
  expect_every_rank(errors, "rank 1 could not decode the part from rank 0 (round 0)");
  for (const auto& out : outputs) EXPECT_EQ(out, std::vector<std::byte>(n * 2, std::byte{0x5A}));
}

// Rounds decode out of order when tasks of several rounds run at once (two workers, and the
// caller running what they have not started): the verdict still names the earliest round that
// failed, and a lone failure in the last round is not lost.
TEST(CollectiveFailures, TheVerdictNamesTheEarliestCorruptedRound) {
  const size_t n = 4096;
  for (const unsigned workers : {1u, 2u}) {
    for (const int first : {1, 3}) {
      const auto errors = run_ranks(
          2,
          [&](int rank, std::shared_ptr<Transport> t) {
            // Six rounds; rank 1's from round `first` on corrupted.
            LosslessCollectives collectives(t, {.slice_values = 1024, .worker_threads = workers});
            const auto in = gradients(DType::kBF16, 2 * n, 9 + rank, false);
            std::vector<std::byte> out(n * 2);
            collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
          },
          std::chrono::seconds(20),
          [first](std::shared_ptr<Transport> inner, int rank) {
            return std::make_shared<CorruptingTransport>(std::move(inner), rank == 1, first);
          });
      expect_every_rank(errors, "rank 1 could not decode the part from rank 0 (round " +
                                    std::to_string(first) + ")");
    }
  }
}

// A call record or verdict the transport damaged on its way to rank 1 is an error there naming
// the sender, never a reading. (An audit damaged rank 0's byte count of its slice for rank 1
// into the slice's raw size: rank 1 read coded bytes as values and returned them with no error
// on any rank; the version-4 records had no checksum. Here one bit of that count, and of the
// verdict's ok byte.)
TEST(CollectiveFailures, ADamagedCallRecordOrVerdictIsAnErrorNeverAReading) {
  const size_t n = 4096;
  const size_t record = collectives::call_record_bytes(2);
  struct Damage {
    size_t bytes, at;
    std::byte bit;
    const char* what;
  };
  // The record's per-peer fields start at 48: rank 1's entry, bytes of its slice (+8). Its magic
  // (offset 0): damage, not another build, since the checksum is read first.
  for (const Damage d : {Damage{record, 48 + 24 + 8, std::byte{0x01}, "call record"},
                         Damage{record, 0, std::byte{0x01}, "call record"},
                         Damage{collectives::verdict_bytes(), 0, std::byte{0x01}, "verdict"}}) {
    SCOPED_TRACE(d.what);
    std::vector<std::vector<std::byte>> outputs(2);
    const auto errors = run_ranks(
        2,
        [&](int rank, std::shared_ptr<Transport> t) {
          LosslessCollectives collectives(t);
          const auto in = gradients(DType::kBF16, 2 * n, 9 + rank, false);
          outputs[rank].assign(n * 2, std::byte{0x5A});
          collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, outputs[rank]);
        },
        std::chrono::seconds(2),
        [&](std::shared_ptr<Transport> inner, int rank) -> std::shared_ptr<Transport> {
          if (rank != 1) return inner;
          return std::make_shared<testing::RecordFlippingTransport>(std::move(inner), d.bytes, 0,
                                                                    d.at, d.bit);
        });
    EXPECT_NE(errors[1].find(std::string("the ") + d.what + " from rank 0 arrived damaged"),
              std::string::npos)
        << errors[1];
    EXPECT_EQ(outputs[1], std::vector<std::byte>(n * 2, std::byte{0x5A}))
        << "rank 1 wrote an output";
  }
}

// A verdict's time, which every rank feeds its adaptive switch as the slowest rank's, is read
// only if it is a time: NaN, an infinity, a negative or a huge value (a broken or foreign peer's;
// an audit found them taken as they came) is a FormatError naming the sender, as is a verdict of
// another length.
TEST(CollectiveRecords, AVerdictsTimeIsReadOnlyIfItIsATime) {
  std::vector<std::byte> bytes(collectives::verdict_bytes());
  for (const double seconds : {0.0, -0.0, 1e-300, 0.25, 1e9}) {
    collectives::write_verdict({true, seconds, "fine"}, bytes);
    const collectives::Verdict v = collectives::read_verdict(bytes, 3);
    EXPECT_EQ(v.seconds, seconds);
    EXPECT_TRUE(v.ok);
    EXPECT_EQ(v.message, "fine");
  }
  const double inf = std::numeric_limits<double>::infinity();
  for (const double seconds :
       {std::numeric_limits<double>::quiet_NaN(), inf, -inf, -1.0, -1e-300, 1.5e9, 1e300}) {
    SCOPED_TRACE(seconds);
    collectives::write_verdict({true, seconds, ""}, bytes);
    try {
      (void)collectives::read_verdict(bytes, 3);
      ADD_FAILURE() << "read";
    } catch (const FormatError& e) {
      EXPECT_NE(
          std::string(e.what()).find("the verdict from rank 3 gives its time for the call as"),
          std::string::npos)
          << e.what();
    }
  }
  collectives::write_verdict({true, 1.0, ""}, bytes);
  EXPECT_THROW((void)collectives::read_verdict({bytes.data(), bytes.size() - 1}, 1), FormatError);
}

// The pass-through flag travels in the record; a flag this build does not know (a later build's,
// or damage under a valid checksum) is a FormatError, not a reading that ignores it (version 5
// ignored unknown flags, so its readers took a pass-through for a call of 0 values).
TEST(CollectiveRecords, PassThroughTravelsAndUnknownFlagsAreRefused) {
  collectives::CallRecord mine;
  mine.kind = collectives::CallKind::kReduceScatter;
  mine.dtype = DType::kBF16;
  mine.slice_values = 64;
  mine.block_values = 512;
  mine.part_values = mine.part_bytes = mine.expected_values = {0, 0};
  std::vector<std::byte> bytes(collectives::call_record_bytes(2));
  for (const bool passes : {false, true}) {
    mine.passes_through = passes;
    collectives::write_call_record(mine, bytes);
    EXPECT_EQ(collectives::read_call_record(bytes, 2, 1).passes_through, passes);
  }
  // A rank that runs an alltoallv against one passing a reduce-scatter through: both kinds named.
  std::vector<collectives::CallRecord> two(2, mine);
  two[0].kind = collectives::CallKind::kAlltoallv;
  two[0].passes_through = false;
  two[0].sequence = 3;
  two[1].sequence = 3;
  EXPECT_EQ(collectives::pass_through_text(two, std::vector<std::string>{"", "why"}),
            "lossless collectives: alltoallv call 3 runs on rank 0, but rank 1 passes a "
            "reduce_scatter through to the caller's own (every rank must make the same choice); "
            "rank 1: why");
  // Bit 3 set and the record resealed as a sender would (XXH3-64 with its field, bytes 40..47, 0).
  bytes[12] |= std::byte{8};
  std::fill(bytes.begin() + 40, bytes.begin() + 48, std::byte{0});
  const uint64_t sealed = XXH3_64bits(bytes.data(), bytes.size());
  for (size_t i = 0; i < 8; ++i) bytes[40 + i] = static_cast<std::byte>(sealed >> (8 * i));
  try {
    (void)collectives::read_call_record(bytes, 2, 1);
    ADD_FAILURE() << "read";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown kind, dtype, op or flag"), std::string::npos)
        << e.what();
  }
}

// What no rank's own record holds, check_agreement refuses as a peer's: slices of 0 values (a
// division by zero in slice_of), and a reduce-scatter record whose parts differ in size (whose
// longest part would set every rank's count of rounds). A slice of 2^63 + 1 BF16 values is not
// wrapped to 2 bytes of raw size when its bytes are compared with it.
TEST(CollectiveRecords, CheckAgreementRefusesWhatNoRankWrites) {
  auto records = [](collectives::CallKind kind, uint64_t n, uint64_t slice_values, uint32_t round) {
    std::vector<collectives::CallRecord> all(2);
    for (size_t r = 0; r < 2; ++r) {
      all[r].kind = kind;
      all[r].dtype = DType::kBF16;
      all[r].round = round;
      all[r].slice_values = slice_values;
      all[r].block_values = 512;
      all[r].part_values = {n, n};
      all[r].expected_values = {n, n};
      const uint64_t raw =
          slice_values == 0 ? 0 : collectives::slice_of(n, round, slice_values).values * 2;
      all[r].part_bytes = r == 0 ? std::vector<uint64_t>{0, raw} : std::vector<uint64_t>{raw, 0};
    }
    return all;
  };
  auto format_error = [](const std::vector<collectives::CallRecord>& all) -> std::string {
    try {
      collectives::check_agreement(all);
    } catch (const FormatError& e) {
      return e.what();
    }
    return "accepted";
  };
  const auto rs = collectives::CallKind::kReduceScatter;
  EXPECT_EQ(format_error(records(rs, 1000, 256, 0)), "accepted");
  auto all = records(rs, 1000, 0, 0);
  EXPECT_EQ(format_error(all),
            "lossless collectives: rank 0's call record gives slices of 0 values");
  all = records(rs, 1000, 256, 0);
  all[1].part_values[1] = uint64_t{1} << 40;  // its own part: no peer reads it as sent
  all[1].expected_values[1] = uint64_t{1} << 40;
  EXPECT_EQ(format_error(all),
            "lossless collectives: rank 1's record of reduce_scatter call 0 sends rank 1 "
            "1099511627776 values and expects 1099511627776 from it, not the 1000 of every part");
  // Round 1 of a part of 2^64 - 1 values in slices of as many: a middle slice of 2^63 + 1.
  all = records(collectives::CallKind::kAlltoallv, UINT64_MAX, UINT64_MAX, 1);
  EXPECT_EQ(collectives::slice_of(UINT64_MAX, 1, UINT64_MAX).values, (uint64_t{1} << 63) + 1);
  all[0].part_bytes[1] = 1000;
  all[1].part_bytes[0] = 1000;
  EXPECT_EQ(format_error(all), "accepted");
}

// Forges rank 0's verdict, as every rank receives it, to give `seconds` (resealed: a broken peer,
// not damage in transit).
class VerdictForgingTransport final : public testing::ForwardingTransport {
 public:
  VerdictForgingTransport(std::shared_ptr<Transport> inner, double seconds)
      : ForwardingTransport(std::move(inner)), seconds_(seconds) {}
  void allgather(const void* in, size_t bytes, void* out) override {
    ForwardingTransport::allgather(in, bytes, out);
    if (bytes != collectives::verdict_bytes()) return;
    const std::span<std::byte> rank0(static_cast<std::byte*>(out), bytes);
    collectives::Verdict v = collectives::read_verdict(rank0, 0);
    v.seconds = seconds_;
    collectives::write_verdict(v, rank0);
  }

 private:
  double seconds_;
};

TEST(CollectiveFailures, AVerdictWhoseTimeIsNotATimeFailsEveryRankNamingItsSender) {
  for (const double seconds : {std::numeric_limits<double>::quiet_NaN(),
                               std::numeric_limits<double>::infinity(), -2.0, 1e300}) {
    SCOPED_TRACE(seconds);
    std::vector<std::vector<std::byte>> outputs(3);
    const auto errors = run_ranks(
        3,
        [&](int rank, std::shared_ptr<Transport> t) {
          LosslessCollectives collectives(t, {.coding = CollectiveCoding::kAuto});
          const auto in = gradients(DType::kBF16, 3 * 2048, 5 + rank, false);
          std::vector<std::byte>& out = outputs[rank];
          out.assign(2048 * 2, std::byte{0x5A});
          try {
            collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
          } catch (const FormatError& e) {
            throw std::runtime_error(std::string("FormatError: ") + e.what());
          }
        },
        std::chrono::seconds(20),
        [&](std::shared_ptr<Transport> inner, int) {
          return std::make_shared<VerdictForgingTransport>(std::move(inner), seconds);
        });
    expect_every_rank(errors,
                      "FormatError: lossless collectives: the verdict from rank 0 gives its time "
                      "for the call as ");
    for (const auto& out : outputs)
      EXPECT_EQ(out, std::vector<std::byte>(2048 * 2, std::byte{0x5A}));
  }
}

TEST(CollectiveFailures, ADeadPeerIsACommErrorOnTheOthersWithinTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(
      3,
      [&](int rank, std::shared_ptr<Transport> t) {
        if (rank == 2) return;  // never calls
        LosslessCollectives collectives(t);
        std::vector<std::byte> in(3 * 64 * 2), out(64 * 2);
        collectives.reduce_scatter(DType::kBF16, ReduceOp::kSum, in, out);
      },
      std::chrono::milliseconds(500));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  for (int r : {0, 1})
    EXPECT_NE(errors[r].find("a peer is dead or stalled"), std::string::npos) << errors[r];
}

TEST(CollectiveFailures, ATransportWithoutAlltoallvSaysSo) {
  class NoAlltoallv final : public Transport {
   public:
    int rank() const override { return 0; }
    int size() const override { return 2; }
    std::string_view name() const override { return "minimal"; }
    void allgather(const void*, size_t, void*) override {}
    void allgatherv(const void*, void*, std::span<const uint64_t>,
                    std::span<const uint64_t>) override {}
    void barrier() override {}
    void set_timeout(std::chrono::milliseconds) override {}
    std::chrono::milliseconds timeout() const override { return {}; }
  } transport;
  const uint64_t counts[2] = {0, 0};
  EXPECT_THROW(
      {
        try {
          transport.alltoallv(nullptr, counts, counts, nullptr, counts, counts);
        } catch (const CommError& e) {
          EXPECT_STREQ(e.what(), "the minimal transport has no alltoallv");
          throw;
        }
      },
      CommError);
}

TEST(CollectivesConfig, NamesAndValidation) {
  EXPECT_EQ(parse_collective_coding("auto"), CollectiveCoding::kAuto);
  EXPECT_THROW(parse_collective_coding("zip"), ConfigError);
  CollectivesConfig config;
  config.block_values = 3;
  EXPECT_THROW(config.validate(), ConfigError);
  EXPECT_THROW(LosslessCollectives(nullptr), ConfigError);
  EXPECT_THROW(
      LosslessCollectives(make_loopback_transport(make_loopback_world(1), 0), {.frame_values = 0}),
      ConfigError);
  // Past the codec's shard limit: refused at construction, not by the first call's bound on
  // this rank alone (frame_values need not agree across ranks, so its peers would wait).
  EXPECT_THROW(LosslessCollectives(make_loopback_transport(make_loopback_world(1), 0),
                                   {.frame_values = kMaxShardValues + 1}),
               ConfigError);
  for (int niceness : {-1, 20}) {
    CollectivesConfig bad;
    bad.worker_niceness = niceness;
    try {
      bad.validate();
      ADD_FAILURE() << "worker_niceness " << niceness << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("worker_niceness must be 0..19"), std::string::npos)
          << e.what();
    }
  }
  CollectivesConfig many;
  many.worker_threads = kMaxWorkerThreads;
  EXPECT_NO_THROW(many.validate());
  many.worker_threads = kMaxWorkerThreads + 1;
  try {
    many.validate();
    ADD_FAILURE() << "worker_threads " << many.worker_threads << " accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("worker_threads must be at most 256, got 257"),
              std::string::npos)
        << e.what();
  }
}

// A moved-from object says so (std::logic_error naming the class) instead of dereferencing null;
// the object it moved into works, and the moved-from one can be assigned to again.
TEST(CollectivesConfig, AMovedFromObjectSaysSo) {
  auto world = make_loopback_world(1);
  LosslessCollectives first(make_loopback_transport(world, 0));
  LosslessCollectives second(std::move(first));
  EXPECT_EQ(second.size(), 1);
  try {
    (void)first.rank();  // NOLINT(bugprone-use-after-move): the behaviour under test
    ADD_FAILURE() << "a moved-from LosslessCollectives answered";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("LosslessCollectives: used after it was moved from"),
              std::string::npos)
        << e.what();
  }
  first = std::move(second);
  EXPECT_EQ(first.rank(), 0);
}

// One thread at a time: of two threads calling one rank's object at once, one call is in flight
// (its peer has not called yet) and the other is refused with a std::logic_error, not let in to
// race on the call's buffers and pair with the peer's call; the call in flight then completes,
// bit for bit, once the peer calls.
TEST(CollectivesConfig, ASecondThreadsCallWhileOneIsInFlightIsRefused) {
  auto world = make_loopback_world(2);
  LosslessCollectives rank0(make_loopback_transport(world, 0));
  LosslessCollectives rank1(make_loopback_transport(world, 1));
  const std::vector<float> in0{1.0f, 2.0f, 3.0f, 4.0f}, in1{10.0f, 20.0f, 30.0f, 40.0f};
  std::vector<float> out0[2] = {std::vector<float>(2), std::vector<float>(2)}, out1(2);
  std::atomic<int> refused{0};
  std::string error;
  std::mutex error_lock;
  const auto call = [&](int k) {
    try {
      rank0.reduce_scatter(DType::kFP32, ReduceOp::kSum, std::as_bytes(std::span(in0)),
                           std::as_writable_bytes(std::span(out0[k])));
    } catch (const std::logic_error& e) {
      std::lock_guard lock(error_lock);
      error = e.what();
      ++refused;
    }
  };
  std::thread first(call, 0), second(call, 1);
  while (refused.load() == 0) std::this_thread::yield();  // the other waits for rank 1's call
  rank1.reduce_scatter(DType::kFP32, ReduceOp::kSum, std::as_bytes(std::span(in1)),
                       std::as_writable_bytes(std::span(out1)));
  first.join();
  second.join();
  EXPECT_EQ(refused.load(), 1);
  EXPECT_NE(error.find("LosslessCollectives: reduce_scatter was called while another thread's "
                       "reduce_scatter call on the same object is in flight"),
            std::string::npos)
      << error;
  const std::vector<float> sums{11.0f, 22.0f};
  EXPECT_TRUE(out0[0] == sums || out0[1] == sums);
  EXPECT_EQ(out1, (std::vector<float>{33.0f, 44.0f}));
}

// Holds a one-worker pool's worker in a task of `group` until release().
class HeldWorker {
 public:
  HeldWorker(ThreadPool& pool, TaskGroup& group) {
    pool.submit(group, [this] {
      started_ = true;
      std::lock_guard wait_for_the_gate(gate_);
    });
    while (!started_) std::this_thread::yield();
  }
  void release() { closed_.unlock(); }

 private:
  std::mutex gate_;
  std::unique_lock<std::mutex> closed_{gate_};
  std::atomic<bool> started_{false};
};

// A task no worker has started when the caller waits for its group, the caller runs itself: with
// the only worker held up, waiting for another group's task returns, the task having run on the
// caller's thread, and the held-up task's group is still waited for as before.
TEST(ThreadPool, TheCallerRunsTheWaitedTasksNoWorkerStarted) {
  ThreadPool pool(1, 19);
  TaskGroup held, other;
  HeldWorker worker(pool, held);
  std::thread::id ran_on;
  pool.submit(other, [&] { ran_on = std::this_thread::get_id(); });
  pool.wait(other);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(held.done());
  worker.release();
  pool.wait(held);
  EXPECT_TRUE(held.done());
  // A failing task's exception reaches the waiter either way.
  pool.submit(other, [] { throw ConfigError("task failed"); });
  EXPECT_THROW(pool.wait(other), ConfigError);
}

// run_queued runs on the caller the group's tasks no worker has started, without waiting for
// the one a worker holds, and says whether it ran any.
TEST(ThreadPool, RunQueuedTakesOnlyTheTasksNoWorkerStarted) {
  ThreadPool pool(1, 19);
  TaskGroup group;
  HeldWorker worker(pool, group);
  EXPECT_FALSE(pool.run_queued(group));  // the only task is the worker's
  std::thread::id ran_on;
  pool.submit(group, [&] { ran_on = std::this_thread::get_id(); });
  EXPECT_TRUE(pool.run_queued(group));
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_FALSE(group.done());  // the worker's task still holds the group
  worker.release();
  pool.wait(group);
  EXPECT_TRUE(group.done());
  EXPECT_FALSE(pool.run_queued(group));
}

#if defined(__linux__)
// The pool's workers run at the nice value asked for (the collectives' workers give way to the
// transport's thread), and the submitting thread keeps its own.
TEST(ThreadPool, WorkersRunAtTheirNiceness) {
  auto niceness_here = [] {
    errno = 0;
    return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  };
  const int caller = niceness_here();
  bool settable = false;  // where setpriority is refused (a sandbox), the pool keeps priorities
  std::thread([&] {
    settable = setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), caller + 1) == 0;
  }).join();
  if (!settable) GTEST_SKIP() << "setpriority is refused here";
  for (int asked : {0, 7, 19}) {
    ThreadPool pool(2, asked);
    TaskGroup group;
    std::vector<int> seen(4, -100);
    for (size_t i = 0; i < seen.size(); ++i)
      pool.submit(group, [&, i] { seen[i] = niceness_here(); });
    group.wait();
    for (int s : seen) EXPECT_EQ(s, std::max(caller, asked)) << "asked for " << asked;
    EXPECT_EQ(niceness_here(), caller);
  }
}
#endif

}  // namespace
}  // namespace ciera
