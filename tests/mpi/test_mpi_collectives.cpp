// The lossless collectives over Open MPI (run with the engine's MPI tests under mpirun -np 2, 3,
// 4): a reduce-scatter bitwise equal to the rank-order FP32 sum of the same inputs (gathered with
// MPI_Allgather), coded or raw, and an alltoallv of uneven parts bitwise equal to MPI_Alltoallv.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../test_util.hpp"
#include "ciera/collectives.hpp"
#include "ciera/mpi.hpp"
#include "collectives/call_record.hpp"
#include "common/floats.hpp"
#include "common/poll.hpp"
#include "mpi_main.hpp"

namespace ciera {
namespace {

int rank_of_world() {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int size_of_world() {
  int w;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

// A small allgather over `transport` gives every rank each rank's value: it is still usable.
void expect_an_allgather_lands(Transport& transport) {
  const int W = size_of_world(), mine = rank_of_world() + 1;
  std::vector<int> all(static_cast<size_t>(W));
  transport.allgather(&mine, sizeof mine, all.data());
  for (int p = 0; p < W; ++p) EXPECT_EQ(all[static_cast<size_t>(p)], p + 1);
}

// One rank's side of a byte alltoallv: `bytes(from, to)` for each peer, parts back to back in
// rank order on both sides.
struct ByteExchange {
  std::vector<uint64_t> send, send_at, recv, recv_at;
  uint64_t sent = 0, received = 0;
};
ByteExchange byte_exchange(const std::function<uint64_t(int from, int to)>& bytes) {
  const int W = size_of_world(), rank = rank_of_world();
  ByteExchange x;
  for (int p = 0; p < W; ++p) {
    x.send.push_back(bytes(rank, p));
    x.recv.push_back(bytes(p, rank));
    x.send_at.push_back(x.sent);
    x.recv_at.push_back(x.received);
    x.sent += x.send.back();
    x.received += x.recv.back();
  }
  return x;
}

std::vector<uint16_t> bf16_gradients(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = float_to_bf16(normal(rng));
  return out;
}

class MpiReduceScatter : public ::testing::TestWithParam<CollectiveCoding> {};

TEST_P(MpiReduceScatter, IsTheRankOrderSumOfEveryRanksPart) {
  const int W = size_of_world(), rank = rank_of_world();
  const size_t n = 300001;  // several rANS segments per part, odd
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  const auto input = bf16_gradients(n * W, 40 + rank);
  std::vector<uint16_t> everyone(n * W * W);
  MPI_Allgather(input.data(), static_cast<int>(n * W), MPI_UINT16_T, everyone.data(),
                static_cast<int>(n * W), MPI_UINT16_T, MPI_COMM_WORLD);
  // Two rounds (an edge of 2^18 values and the rest), and seven (more than the rounds in
  // flight): from the second round on, each round's exchange starts while the previous one
  // still moves.
  for (const uint64_t slice : {uint64_t{1} << 20, uint64_t{1} << 16}) {
    const auto rounds = static_cast<uint32_t>(collectives::rounds_of(n, slice));
    ASSERT_EQ(rounds, slice == uint64_t{1} << 20 ? 2U : 7U);
    LosslessCollectives collectives(transport, {.coding = GetParam(), .slice_values = slice});
    std::vector<uint16_t> out(n);
    for (int call = 0; call < 3; ++call) {
      const CollectiveStats stats =
          collectives.reduce_scatter(DType::kBF16, ReduceOp::kAvg, std::as_bytes(std::span(input)),
                                     std::as_writable_bytes(std::span(out)));
      if (GetParam() == CollectiveCoding::kExponent) {
        EXPECT_EQ(stats.coded_slices, static_cast<uint32_t>(W - 1) * rounds) << slice;
        EXPECT_LT(stats.wire_bytes, stats.raw_bytes * 0.8);
      }
    }
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      float sum = bf16_to_float(everyone[static_cast<size_t>(rank) * n + i]);
      for (int p = 1; p < W; ++p)
        sum += bf16_to_float(everyone[static_cast<size_t>(p) * n * W + rank * n + i]);
      wrong += float_to_bf16(sum / static_cast<float>(W)) != out[i];
    }
    EXPECT_EQ(wrong, 0u) << slice;
  }
}

INSTANTIATE_TEST_SUITE_P(Codings, MpiReduceScatter,
                         ::testing::Values(CollectiveCoding::kRaw, CollectiveCoding::kExponent,
                                           CollectiveCoding::kAuto));

TEST(MpiAlltoallv, UnevenPartsMatchMpiAlltoallv) {
  const int W = size_of_world(), rank = rank_of_world();
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  LosslessCollectives collectives(transport);
  std::vector<uint64_t> send(W), recv(W);
  std::vector<int> send_counts(W), recv_counts(W), send_displs(W), recv_displs(W);
  int sent = 0, received = 0;
  for (int p = 0; p < W; ++p) {
    send[p] = (rank + 1) * 7919 + p * 101 + (p == rank ? 0 : 3);  // p == rank: a part kept
    recv[p] = (p + 1) * 7919 + rank * 101 + (p == rank ? 0 : 3);
    send_counts[p] = static_cast<int>(send[p]);
    recv_counts[p] = static_cast<int>(recv[p]);
    send_displs[p] = sent;
    recv_displs[p] = received;
    sent += send_counts[p];
    received += recv_counts[p];
  }
  const auto input = bf16_gradients(static_cast<size_t>(sent), 70 + rank);
  std::vector<uint16_t> out(static_cast<size_t>(received)), expected(static_cast<size_t>(received));
  collectives.alltoallv(DType::kBF16, std::as_bytes(std::span(input)), send,
                        std::as_writable_bytes(std::span(out)), recv);
  MPI_Alltoallv(input.data(), send_counts.data(), send_displs.data(), MPI_UINT16_T, expected.data(),
                recv_counts.data(), recv_displs.data(), MPI_UINT16_T, MPI_COMM_WORLD);
  EXPECT_EQ(out, expected);
}

// Two exchanges in flight at once with an allgather between them, finished in the order started
// (as the lossless collectives run their rounds): each lands whole where its counts say.
TEST(MpiTransport, ExchangesInFlightTogetherLandWhole) {
  const int W = size_of_world(), rank = rank_of_world();
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  std::vector<std::unique_ptr<Transport::PendingExchange>> pending;
  std::vector<std::vector<uint8_t>> in(2), out(2), expected(2);
  for (int e = 0; e < 2; ++e) {
    const auto [send, send_at, recv, recv_at, sent, received] =
        byte_exchange([e](int from, int to) -> uint64_t {  // several of MPI's fragments
          return 200000 + 977 * ((from + 3 * to + e) % 5);
        });
    in[e].resize(sent);
    for (int p = 0; p < W; ++p) {
      for (uint64_t i = 0; i < send[p]; ++i)
        in[e][send_at[p] + i] = static_cast<uint8_t>(i * 131 + rank * 17 + p * 7 + e * 3);
    }
    out[e].assign(received, 0);
    expected[e].resize(received);
    for (int p = 0; p < W; ++p) {
      for (uint64_t i = 0; i < recv[p]; ++i)
        expected[e][recv_at[p] + i] = static_cast<uint8_t>(i * 131 + p * 17 + rank * 7 + e * 3);
    }
    pending.push_back(
        transport->start_alltoallv(in[e].data(), send, send_at, out[e].data(), recv, recv_at));
    if (e == 0) {
      const int mine = rank * 10 + 1;
      std::vector<int> all(static_cast<size_t>(W));
      transport->allgather(&mine, sizeof mine, all.data());
      for (int p = 0; p < W; ++p) EXPECT_EQ(all[p], p * 10 + 1);
    }
  }
  // test() tells completion without waiting (the collectives poll it beside a round's coding):
  // polled, each exchange says so in the end, and finish() then returns at once.
  for (auto& exchange : pending) {
    ASSERT_TRUE(poll_until([&] { return exchange->test(); }, std::chrono::seconds(60)));
    EXPECT_TRUE(exchange->test());
    exchange->finish();
  }
  EXPECT_EQ(out[0], expected[0]);
  EXPECT_EQ(out[1], expected[1]);
}

// The last rank sends itself other than it expects from itself: its own mistake. It fails with
// a ConfigError naming it once the exchange is over; its peers, whose parts are right, get them
// whole, and its own output part is left as it was (refusing before the exchange left the peers
// waiting in MPI until the timeout).
TEST(MpiTransport, ARanksWrongOwnCountFailsItAloneAndItsPeersGetTheirParts) {
  const int W = size_of_world(), rank = rank_of_world();
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  transport->set_timeout(std::chrono::seconds(60));
  auto bytes_from_to = [](int from, int to) -> uint64_t { return 1000 + 37 * from + 11 * to; };
  auto byte_of = [](uint64_t i, int from, int to) {
    return static_cast<uint8_t>(i * 131 + from * 17 + to * 7 + 1);
  };
  const bool wrong = rank == W - 1;
  auto [send, send_at, recv, recv_at, sent, received] = byte_exchange(bytes_from_to);
  if (wrong) {  // expects 5 bytes more from itself than it sends itself; its part is its last
    recv[static_cast<size_t>(rank)] += 5;
    received += 5;
  }
  std::vector<uint8_t> in(sent), out(received, 0xEE);
  for (int p = 0; p < W; ++p) {
    for (uint64_t i = 0; i < send[p]; ++i) in[send_at[p] + i] = byte_of(i, rank, p);
  }
  std::string message;
  try {
    transport->alltoallv(in.data(), send, send_at, out.data(), recv, recv_at);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  if (wrong) {
    EXPECT_NE(message.find("rank " + std::to_string(rank) + " sends itself"), std::string::npos)
        << message;
  } else {
    EXPECT_EQ(message, "");
  }
  for (int p = 0; p < W; ++p) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < recv[p]; ++i) {
      const uint8_t expected = wrong && p == rank ? 0xEE : byte_of(i, p, rank);
      bad += out[recv_at[p] + i] != expected;
    }
    EXPECT_EQ(bad, 0u) << "the part from rank " << p;
  }
  // The transport is still usable on every rank.
  expect_an_allgather_lands(*transport);
}

// The transport's environment settings, read on each rank, set differently on the last rank
// only (or not understood there): every rank refuses with the same ConfigError when the
// transport is made, instead of making calls its peers do not make and waiting out the timeout.
// The ctest entry's own setting comes back afterwards, and a transport made then works.
TEST(MpiTransportSettings, DifferentOrUnreadableOnOneRankFailEveryRankAlike) {
  const int W = size_of_world(), rank = rank_of_world();
  struct Case {
    const char* variable;
    const char* everywhere;  // nullptr: unset
    const char* on_last;
    const char* expected;
  };
  const Case cases[] = {
      {"CIERA_MPI_CHANNELS", nullptr, "3", "CIERA_MPI_CHANNELS must be the same on every rank"},
      {"CIERA_MPI_CHANNELS", "8", "0", "CIERA_MPI_CHANNELS is not a whole number"},
      {"CIERA_MPI_CHANNELS", "8", "8x", "CIERA_MPI_CHANNELS is not a whole number"},
      {"CIERA_MPI_ALLGATHERV", "ring", "nbc",
       "CIERA_MPI_ALLGATHERV must be the same on every rank"},
      {"CIERA_MPI_ALLGATHERV", "auto", "rings", "CIERA_MPI_ALLGATHERV is not one of"},
  };
  for (const Case& c : cases) {
    const char* before = std::getenv(c.variable);
    const std::string kept = before ? before : "";
    const char* value = rank == W - 1 ? c.on_last : c.everywhere;
    if (value) {
      setenv(c.variable, value, 1);
    } else {
      unsetenv(c.variable);
    }
    std::string message;
    try {
      make_mpi_transport(MPI_COMM_WORLD, std::chrono::seconds(20));
    } catch (const ConfigError& e) {
      message = e.what();
    }
    if (before) {
      setenv(c.variable, kept.c_str(), 1);
    } else {
      unsetenv(c.variable);
    }
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << c.variable << "=" << c.on_last << ": " << message;
    EXPECT_NE(message.find(std::to_string(W - 1)), std::string::npos) << message;
    EXPECT_TRUE(same_on_every_rank(message))
        << "the ranks' messages differ; this rank's: " << message;
  }
  // Nothing left behind: the next transport agrees and moves bytes.
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  expect_an_allgather_lands(*transport);
}

// From a user audit: MPI_COMM_NULL (what MPI_Comm_split gives a rank of colour MPI_UNDEFINED)
// made MPI's own check abort the job at the transport's first MPI call; a negative timeout was
// taken, and read as no timeout. Both are std::invalid_argument, on the rank that passed them,
// before any MPI call; set_timeout refuses a negative one too and keeps the timeout it had.
TEST(MpiTransport, NoCommunicatorOrANegativeTimeoutIsRefusedBeforeAnyMpiCall) {
  EXPECT_THROW(make_mpi_transport(MPI_COMM_NULL), std::invalid_argument);
  const int all[] = {0};
  EXPECT_THROW(make_mpi_transport(MPI_COMM_NULL, all), std::invalid_argument);
  EXPECT_THROW(make_mpi_transport(MPI_COMM_WORLD, std::chrono::milliseconds(-1)),
               std::invalid_argument);
  std::vector<MPI_Request> none;
  EXPECT_THROW(mpi_wait_all(none, std::chrono::milliseconds(-5), "nothing"), std::invalid_argument);
  std::shared_ptr<Transport> transport =
      make_mpi_transport(MPI_COMM_WORLD, std::chrono::seconds(20));
  EXPECT_THROW(transport->set_timeout(std::chrono::milliseconds(-1)), std::invalid_argument);
  EXPECT_EQ(transport->timeout(), std::chrono::seconds(20));
  expect_an_allgather_lands(*transport);
}

// Sub-groups the ranks name differently (other members, another order, a rank left out of its own
// group): the same ConfigError on every rank, before any split. Until stop 62 only the ranks whose
// group came out of another size failed, another order passed, and a rank that left itself out
// refused alone while its peers waited in MPI_Comm_split until its watchdog ended the job. A
// partition in reverse order then works, its ranks in the order named.
TEST(MpiSubgroups, GroupsTheRanksNameDifferentlyFailEveryRankAlike) {
  const int W = size_of_world(), rank = rank_of_world();
  ASSERT_GE(W, 2);
  struct Case {
    std::vector<int> group;  // this rank's
    std::string expected;
  };
  const auto own = [&](int r) { return std::vector<int>{r}; };
  const std::vector<Case> cases = {
      {rank == 0 ? std::vector<int>{0, 1} : own(rank),
       "rank 0 named {0, 1} and names rank 1, which named {1}"},
      {rank == 0   ? std::vector<int>{0, 1}
       : rank == 1 ? std::vector<int>{1, 0}
                   : own(rank),
       "rank 0 named {0, 1} and names rank 1, which named {1, 0}"},
      {std::vector<int>{0}, "rank 1 named {0} and leaves itself out"},
      {rank == W - 1 ? std::vector<int>{W - 1, W - 1} : own(rank),
       "rank " + std::to_string(W - 1) + " named {" + std::to_string(W - 1) + ", " +
           std::to_string(W - 1) + "} and names rank " + std::to_string(W - 1) + " twice"},
  };
  for (const Case& c : cases) {
    std::string message;
    try {
      make_mpi_transport(MPI_COMM_WORLD, c.group, std::chrono::seconds(20));
    } catch (const ConfigError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("mpi_transport: the ranks disagree on the groups: " + c.expected),
              std::string::npos)
        << message;
    EXPECT_TRUE(same_on_every_rank(message))
        << "the ranks' messages differ; this rank's: " << message;
  }
  std::vector<int> reversed(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) reversed[static_cast<size_t>(r)] = W - 1 - r;
  std::unique_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD, reversed);
  EXPECT_EQ(transport->rank(), W - 1 - rank);
  EXPECT_EQ(transport->size(), W);
}

// Parts beyond MPI's int counts, on some ranks only (run alone, at 3 ranks: see
// tests/CMakeLists.txt). Rank 0 sends rank 1 more than 2 GiB, and rank 1 keeps its own part
// beyond 2 GiB into its output, while rank 2's counts and displacements all fit in an int. The
// transport must take the same path on every rank whatever its own counts: a rank that chose
// MPI's collective while its peers went point to point would wait for them until the timeout.
TEST(MpiTransportBeyondInt, PartsOver2GiBOnSomeRanksLandWhole) {
  const int W = size_of_world(), rank = rank_of_world();
  ASSERT_GE(W, 3) << "needs a rank whose counts all fit in an int";
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  transport->set_timeout(std::chrono::seconds(120));
  const uint64_t big = (uint64_t{1} << 31) + 4099;
  auto bytes_from_to = [&](int from, int to) -> uint64_t {
    return from == 0 && to == 1 ? big : 16 + 5 * static_cast<uint64_t>(from) + to;
  };
  // Byte i of the part `from` sends `to`; the high bits of i take part, so a part landing a
  // multiple of 256 bytes off is caught.
  auto byte_of = [](uint64_t i, int from, int to) {
    return static_cast<uint8_t>(i * 131 + (i >> 12) * 29 + (i >> 24) * 3 + from * 17 + to * 7 + 1);
  };
  const auto [send, send_at, recv, recv_at, sent, received] = byte_exchange(bytes_from_to);
  std::vector<uint8_t> in(sent), out(received, 0);
  for (int p = 0; p < W; ++p) {
    for (uint64_t i = 0; i < send[p]; ++i) in[send_at[p] + i] = byte_of(i, rank, p);
  }
  transport->alltoallv(in.data(), send, send_at, out.data(), recv, recv_at);
  for (int p = 0; p < W; ++p) {
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < recv[p]; ++i) wrong += out[recv_at[p] + i] != byte_of(i, p, rank);
    EXPECT_EQ(wrong, 0u) << "the part from rank " << p << " (" << recv[p] << " bytes)";
  }
}

// An allgatherv whose output reaches past 2 GiB (parts at displacements beyond MPI's int, as a
// slot stride or parts of several GiB place them) lands whole: until stop 62 the direct path
// refused it as "displacement ... exceeds MPI's per-rank count limit" (a CommError that ended the
// engine), and in auto mode small calls always took that path. The output is allocated, not
// touched: only the parts' pages are written.
TEST(MpiTransportBeyondInt, AllgathervOutputsPast2GiBLandWhole) {
  const int W = size_of_world(), rank = rank_of_world();
  std::shared_ptr<Transport> transport = make_mpi_transport(MPI_COMM_WORLD);
  transport->set_timeout(std::chrono::seconds(120));
  const uint64_t far = (uint64_t{3} << 30) + 12345;
  std::vector<uint64_t> counts(W), displs(W);
  for (int r = 0; r < W; ++r) {
    counts[r] = 16 + 3 * static_cast<uint64_t>(r);
    displs[r] = r == 0 ? 0 : far + 4096 * static_cast<uint64_t>(r);
  }
  const uint64_t size = displs[W - 1] + counts[W - 1];
  std::unique_ptr<uint8_t[]> out(new uint8_t[size]);  // NOLINT: left uninitialised on purpose
  std::vector<uint8_t> in(counts[rank]);
  for (uint64_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(rank * 31 + i + 1);
  for (int round = 0; round < 3; ++round) {  // the first large calls are the auto mode's trials
    transport->allgatherv(in.data(), out.get(), counts, displs);
    for (int r = 0; r < W; ++r) {
      for (uint64_t i = 0; i < counts[r]; ++i) {
        ASSERT_EQ(out[displs[r] + i], static_cast<uint8_t>(r * 31 + i + 1))
            << "round " << round << ", the part of rank " << r << ", byte " << i;
      }
    }
  }
}

}  // namespace
}  // namespace ciera
