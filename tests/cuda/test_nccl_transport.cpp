// The NCCL transport on a GPU: W ranks as threads of this process, each with its own
// communicator made from one shared id, rank r on GPU r mod (GPUs). Several ranks on one GPU
// need NCCL 2.30 or newer with NCCL_MULTI_RANK_GPU_ENABLE=1 (set below, before any NCCL call);
// where the loaded NCCL is older and the machine has fewer GPUs than a test's ranks, that test
// is reported Skipped with the reason, as is every test without NCCL or a GPU. The one-rank and
// set-up tests run on any NCCL the transport supports.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ciera/nccl.hpp"
#include "cuda/cuda_test_util.hpp"

namespace ciera::nccl {
namespace {

using Bytes = std::vector<uint8_t>;
using ciera::cuda::testing::DeviceVector;
using Clock = std::chrono::steady_clock;

// NCCL reads it when it makes a communicator; set before main, so before any NCCL call.
[[maybe_unused]] const bool kMultiRankGpuEnabled = [] {
  return setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0) == 0;
}();

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// Whether `ranks` ranks can run here; if not, why.
bool ranks_fit(int ranks, std::string* why) {
  if (!available(why)) return false;
  const int gpus = device_count();
  if (ranks <= gpus) return true;
  const std::string version = library_version();
  int major = 0, minor = 0;
  std::sscanf(version.c_str(), "%d.%d", &major, &minor);
  if (major > 2 || (major == 2 && minor >= 30)) return true;
  *why = std::to_string(ranks) + " ranks on " + std::to_string(gpus) +
         " GPU(s) need NCCL 2.30 or newer (NCCL_MULTI_RANK_GPU_ENABLE); the NCCL loaded is " +
         version;
  return false;
}

#define SKIP_UNLESS_RANKS_FIT(ranks)                    \
  do {                                                  \
    std::string why;                                    \
    if (!ranks_fit((ranks), &why)) GTEST_SKIP() << why; \
  } while (0)

// Runs body(rank, transport) on `ranks` threads, each with its own transport; returns each
// rank's exception (null where none). Failed expectations inside `body` fail the test.
//
// Ranks that share a GPU share its CUDA context: a call that waits for the whole device (cudaFree)
// between two collectives would wait for a peer's kernel that waits for this rank. So bodies
// allocate their device buffers before their first collective and free them after their last.
std::vector<std::exception_ptr> run_ranks(int ranks, std::chrono::milliseconds timeout,
                                          const std::function<void(int, Transport&)>& body) {
  const UniqueId id = make_unique_id();
  const int gpus = device_count();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        const int device = r % gpus;
        cudaSetDevice(device);
        auto transport = make_transport(id, r, ranks, {.device = device, .timeout = timeout});
        body(r, *transport);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

std::string what(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << what(errors[r]);
}

// Rank r's bytes for a call (`salt` tells calls apart).
Bytes pattern(int rank, size_t n, int salt = 0) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i)
    b[i] = static_cast<uint8_t>(rank * 131 + salt * 17 + i * 7 + (i >> 8));
  return b;
}

constexpr auto kTimeout = std::chrono::seconds(60);
constexpr uint8_t kUntouched = 0xEE;

TEST(NcclTransport, OneRankGathersItselfOnAnyNcclVersion) {
  SKIP_UNLESS_RANKS_FIT(1);
  expect_no_errors(run_ranks(1, kTimeout, [](int, Transport& t) {
    EXPECT_EQ(t.name(), "nccl");
    EXPECT_EQ(t.size(), 1);
    const Bytes in = pattern(0, 1001);
    DeviceVector<uint8_t> d_in(in), d_out(in.size());
    t.allgather(d_in.get(), in.size(), d_out.get());
    EXPECT_EQ(d_out.host(), in);
    Bytes host_out(in.size());
    t.allgather(in.data(), in.size(), host_out.data());  // host buffers, staged
    EXPECT_EQ(host_out, in);
    const uint64_t counts[] = {in.size()}, displs[] = {5};
    Bytes gapped(in.size() + 5, kUntouched);
    t.allgatherv(in.data(), gapped.data(), counts, displs);
    EXPECT_EQ(Bytes(gapped.begin() + 5, gapped.end()), in);
    EXPECT_EQ(Bytes(gapped.begin(), gapped.begin() + 5), Bytes(5, kUntouched));
    t.barrier();
  }));
}

class NcclRanks : public ::testing::TestWithParam<int> {};

TEST_P(NcclRanks, AllgatherOutOfPlaceAndInPlace) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  expect_no_errors(run_ranks(ranks, kTimeout, [ranks](int rank, Transport& t) {
    const size_t largest = size_t{1} << 20;
    DeviceVector<uint8_t> d_in(largest), d_out(largest * ranks), d_in_place(largest * ranks);
    for (const size_t bytes : {size_t{1}, size_t{1001}, largest}) {
      Bytes expected;
      for (int r = 0; r < ranks; ++r) {
        const Bytes part = pattern(r, bytes);
        expected.insert(expected.end(), part.begin(), part.end());
      }
      const Bytes mine = pattern(rank, bytes);
      d_in.put(mine.data(), bytes);
      t.allgather(d_in.get(), bytes, d_out.get());
      EXPECT_EQ(d_out.host(bytes * ranks), expected)
          << "out of place, " << bytes << " bytes, rank " << rank;
      Bytes slot(bytes * ranks, kUntouched);
      std::memcpy(slot.data() + rank * bytes, mine.data(), bytes);
      d_in_place.put(slot.data(), slot.size());
      t.allgather(d_in_place.get() + rank * bytes, bytes, d_in_place.get());
      EXPECT_EQ(d_in_place.host(bytes * ranks), expected)
          << "in place, " << bytes << " bytes, rank " << rank;
    }
  }));
}

TEST_P(NcclRanks, AllgathervWithUnequalAndZeroCountsLeavesTheGapsAlone) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  // Every other rank sends nothing; the others send different amounts; 64-byte gaps between
  // the ranges, which must keep what the caller had there. Then equal rank-major counts (one
  // ncclAllGather) through the same call.
  std::vector<uint64_t> counts, displs, equal_counts, equal_displs;
  uint64_t at = 64;
  for (int r = 0; r < ranks; ++r) {
    counts.push_back(r % 2 == 1 ? 0 : 1000 * (r + 1) + 3 * r + 1);
    displs.push_back(at);
    at += counts.back() + 64;
    equal_counts.push_back(4096);
    equal_displs.push_back(4096 * r);
  }
  const uint64_t extent = at;
  expect_no_errors(run_ranks(ranks, kTimeout, [&](int rank, Transport& t) {
    const uint64_t largest = std::max<uint64_t>(extent, 4096 * ranks);
    DeviceVector<uint8_t> d_in(largest), d_out(largest);
    for (const bool equal : {false, true}) {
      const auto& c = equal ? equal_counts : counts;
      const auto& d = equal ? equal_displs : displs;
      const uint64_t size = equal ? 4096 * ranks : extent;
      Bytes expected(size, kUntouched);
      for (int r = 0; r < ranks; ++r) {
        const Bytes part = pattern(r, c[r], 1);
        std::copy(part.begin(), part.end(), expected.begin() + d[r]);
      }
      const Bytes mine = pattern(rank, c[rank], 1);
      d_in.put(mine.data(), mine.size());
      d_out.put(Bytes(size, kUntouched).data(), size);
      t.allgatherv(d_in.get(), d_out.get(), c, d);
      EXPECT_EQ(d_out.host(size), expected)
          << (equal ? "equal" : "unequal") << " counts, rank " << rank;
    }
  }));
}

TEST_P(NcclRanks, AllgathervManyReportsEachCallInOrderOnceItIsComplete) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  constexpr int kCalls = 4;
  expect_no_errors(run_ranks(ranks, kTimeout, [ranks](int rank, Transport& t) {
    std::vector<std::vector<uint64_t>> counts(kCalls), displs(kCalls);
    std::vector<Bytes> expected(kCalls);
    std::vector<std::unique_ptr<DeviceVector<uint8_t>>> ins, outs;
    std::vector<Transport::AllgathervCall> calls;
    for (int i = 0; i < kCalls; ++i) {
      uint64_t at = 0;
      for (int r = 0; r < ranks; ++r) {
        counts[i].push_back(i == 2 ? 0
                                   : (i + 1) * 777 + r * (i % 2) * 100);  // call 2 gathers nothing
        displs[i].push_back(at);
        at += counts[i].back();
      }
      for (int r = 0; r < ranks; ++r) {
        const Bytes part = pattern(r, counts[i][r], i);
        expected[i].insert(expected[i].end(), part.begin(), part.end());
      }
      ins.push_back(std::make_unique<DeviceVector<uint8_t>>(
          pattern(rank, std::max<uint64_t>(counts[i][rank], 1), i)));
      outs.push_back(std::make_unique<DeviceVector<uint8_t>>(std::max<uint64_t>(at, 1)));
      calls.push_back({ins.back()->get(), outs.back()->get(), counts[i], displs[i]});
    }
    std::vector<size_t> order;
    t.allgatherv_many(calls, [&](size_t i) {
      order.push_back(i);
      EXPECT_EQ(outs[i]->host(expected[i].size()), expected[i])
          << "call " << i << " reported before it was complete";
    });
    EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3}));
  }));
}

TEST_P(NcclRanks, HostBuffersAreStagedThroughTheDevice) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  expect_no_errors(run_ranks(ranks, kTimeout, [ranks](int rank, Transport& t) {
    const size_t bytes = 3000;
    Bytes expected;
    for (int r = 0; r < ranks; ++r) {
      const Bytes part = pattern(r, bytes);
      expected.insert(expected.end(), part.begin(), part.end());
    }
    const Bytes mine = pattern(rank, bytes);
    DeviceVector<uint8_t> d_out(bytes * ranks), d_in(mine);
    // Host to host, host in place, host to device, device to host.
    Bytes out(bytes * ranks, kUntouched);
    t.allgather(mine.data(), bytes, out.data());
    EXPECT_EQ(out, expected) << "host to host";
    Bytes in_place(bytes * ranks, kUntouched);
    std::copy(mine.begin(), mine.end(), in_place.begin() + rank * bytes);
    t.allgather(in_place.data() + rank * bytes, bytes, in_place.data());
    EXPECT_EQ(in_place, expected) << "host, in place";
    t.allgather(mine.data(), bytes, d_out.get());
    EXPECT_EQ(d_out.host(), expected) << "host to device";
    Bytes from_device(bytes * ranks, kUntouched);
    t.allgather(d_in.get(), bytes, from_device.data());
    EXPECT_EQ(from_device, expected) << "device to host";
    // allgatherv into host memory with gaps: only the ranks' ranges are written back.
    std::vector<uint64_t> counts, displs;
    Bytes gapped_expected;
    for (int r = 0; r < ranks; ++r) {
      counts.push_back(100 + r);
      displs.push_back(gapped_expected.size() + 16);
      gapped_expected.resize(displs.back(), kUntouched);
      const Bytes part = pattern(r, counts.back(), 2);
      gapped_expected.insert(gapped_expected.end(), part.begin(), part.end());
    }
    Bytes gapped(gapped_expected.size(), kUntouched);
    t.allgatherv(pattern(rank, counts[rank], 2).data(), gapped.data(), counts, displs);
    EXPECT_EQ(gapped, gapped_expected) << "allgatherv into host memory";
  }));
}

TEST_P(NcclRanks, BarrierWaitsForTheLastRank) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  std::atomic<int64_t> last_entered_ns{0};
  std::vector<int64_t> left_ns(static_cast<size_t>(ranks), 0);
  const auto start = Clock::now();
  auto now_ns = [&] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  };
  expect_no_errors(run_ranks(ranks, kTimeout, [&](int rank, Transport& t) {
    t.barrier();  // everyone set up
    if (rank == ranks - 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      last_entered_ns = now_ns();
    }
    t.barrier();
    left_ns[static_cast<size_t>(rank)] = now_ns();
  }));
  for (int r = 0; r < ranks; ++r)
    EXPECT_GE(left_ns[static_cast<size_t>(r)], last_entered_ns.load()) << "rank " << r;
}

// A peer that never makes the call: every other rank gets a CommError naming the operation,
// itself and the timeout, within about the timeout, and every later call fails at once.
TEST_P(NcclRanks, AStalledPeerIsACommErrorOnEveryOtherRankWithinTheTimeout) {
  const int ranks = GetParam();
  SKIP_UNLESS_RANKS_FIT(ranks);
  const auto timeout = std::chrono::milliseconds(2000);
  std::atomic<int> failed{0};
  std::vector<double> seconds(static_cast<size_t>(ranks), 0);
  std::vector<std::string> messages(static_cast<size_t>(ranks));
  const auto errors = run_ranks(ranks, timeout, [&](int rank, Transport& t) {
    if (rank == ranks - 1) {  // the stalled one: waits (boundedly) until the others gave up
      const auto until = Clock::now() + std::chrono::seconds(60);
      while (failed < ranks - 1 && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    DeviceVector<uint8_t> d_in(pattern(rank, 4096)), d_out(4096 * ranks);
    const auto start = Clock::now();
    try {
      t.allgather(d_in.get(), 4096, d_out.get());
      ADD_FAILURE() << "rank " << rank << ": the allgather completed without its peer";
    } catch (const CommError& e) {
      seconds[static_cast<size_t>(rank)] =
          std::chrono::duration<double>(Clock::now() - start).count();
      messages[static_cast<size_t>(rank)] = e.what();
    }
    ++failed;
    EXPECT_THROW(t.barrier(), CommError);  // broken: at once, not after another timeout
  });
  expect_no_errors(errors);
  for (int r = 0; r + 1 < ranks; ++r) {
    const std::string& m = messages[static_cast<size_t>(r)];
    EXPECT_NE(m.find("ncclAllGather"), std::string::npos) << m;
    EXPECT_NE(m.find("rank " + std::to_string(r) + " of " + std::to_string(ranks)),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("2000 ms"), std::string::npos) << m;
    EXPECT_GE(seconds[static_cast<size_t>(r)], 1.9) << m;
    EXPECT_LT(seconds[static_cast<size_t>(r)], 15.0) << "rank " << r << " took too long to give up";
  }
}

std::string ranks_name(const ::testing::TestParamInfo<int>& p) {
  return std::to_string(p.param) + "ranks";
}
INSTANTIATE_TEST_SUITE_P(Ranks, NcclRanks, ::testing::Values(2, 3, 4), ranks_name);

// A peer that never joins the communicator: set-up fails with a CommError within about the
// timeout (non-blocking init, aborted), on any NCCL version.
TEST(NcclTransport, APeerThatNeverJoinsIsACommErrorAtSetUp) {
  SKIP_UNLESS_RANKS_FIT(1);
  const UniqueId id = make_unique_id();
  const auto start = Clock::now();
  try {
    make_transport(id, 0, 2, {.device = 0, .timeout = std::chrono::milliseconds(2000)});
    FAIL() << "a communicator of two ranks set up with one";
  } catch (const CommError& e) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_NE(std::string(e.what()).find("set-up"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("2000 ms"), std::string::npos) << e.what();
    EXPECT_LT(seconds, 15.0);
  }
}

}  // namespace
}  // namespace ciera::nccl
