// The compressed allgather engine on the CUDA backend over CIERA's NCCL transport: 2-4 ranks as
// threads sharing the one GPU, each with its own communicator (NCCL >= 2.30 with
// NCCL_MULTI_RANK_GPU_ENABLE=1; skipped, saying why, otherwise or without a GPU). The same checks
// as on the loopback (tests/engine_backend_suite.hpp): every gather bit for bit, a payload
// corrupted in transit caught and re-sent; and a rank that stops gathering fails the others with
// CommError within the timeout.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ciera/cuda.hpp"
#include "ciera/nccl.hpp"
#include "cuda/cuda_test_util.hpp"
#include "engine_backend_suite.hpp"

namespace ciera::nccl {
namespace {

using ciera::testing::PayloadBytes;

// Skips unless `world` ranks can share device 0 through NCCL here.
#define SKIP_WITHOUT_SHARED_GPU_NCCL()                                              \
  do {                                                                              \
    SKIP_WITHOUT_DEVICE();                                                          \
    std::string why;                                                                \
    if (!::ciera::nccl::available(&why)) GTEST_SKIP() << why;                       \
    const std::string version = ::ciera::nccl::library_version();                   \
    if (std::stoi(version.substr(version.find('.') + 1)) < 30 && version[0] == '2') \
      GTEST_SKIP() << "NCCL " << version << " cannot put several ranks on one GPU (2.30+)"; \
  } while (0)

std::shared_ptr<const CodecBackend> gpu() {
  static const auto backend = cuda::codec_backend(0);
  return backend;
}

// Every rank's loopback replaced by an NCCL transport of one communicator.
ciera::testing::WrapTransport over_nccl(int world, std::chrono::milliseconds timeout) {
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  auto id = std::make_shared<UniqueId>(make_unique_id());
  return [id, world, timeout](std::unique_ptr<Transport>, int rank) {
    Options options;
    options.device = 0;
    options.timeout = timeout;
    return make_transport(*id, rank, world, options);
  };
}

class NcclEngine : public ::testing::TestWithParam<int> {};

TEST_P(NcclEngine, GathersAreBitwiseExactOverNccl) {
  SKIP_WITHOUT_SHARED_GPU_NCCL();
  const int world = GetParam();
  ciera::testing::expect_exact_gathers(world, [](int) { return gpu(); }, DType::kBF16,
                                       WarmupMode::kRaw, world % 2 == 0, 30, nullptr,
                                       over_nccl(world, std::chrono::seconds(60)));
}

INSTANTIATE_TEST_SUITE_P(Worlds, NcclEngine, ::testing::Values(2, 3, 4));

TEST(NcclEngineFaults, ResetsPolicyChangesAndAdaptiveSwitchingStayExact) {
  SKIP_WITHOUT_SHARED_GPU_NCCL();
  ciera::testing::expect_exact_through_resets_and_policy_changes(
      3, [](int) { return gpu(); }, over_nccl(3, std::chrono::seconds(60)));
}

TEST(NcclEngineFaults, ARankThatStopsGatheringFailsTheOthersWithinTheTimeout) {
  SKIP_WITHOUT_SHARED_GPU_NCCL();
  const int world = 3;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {100000}, world);
  EngineConfig config;
  config.warmup_steps = 1;
  config.timeout = std::chrono::seconds(3);
  const auto started = std::chrono::steady_clock::now();
  const auto errors = ciera::testing::run_backend_ranks(
      world, [](int) { return gpu(); },
      [&](int rank, Transport& t, auto backend) {
        PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
        PayloadBytes out(backend->memory(), layout.total_bytes());
        CompressedAllgather engine(t, config, {layout}, backend);
        for (int step = 0; step < 6; ++step) {
          if (rank == 2 && step == 3) return;  // stops gathering (its engine closes)
          engine.run(0, in.span(), out.span());
        }
      },
      over_nccl(world, std::chrono::seconds(3)));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("dead or stalled"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
  EXPECT_LT(seconds, 30.0);
}

}  // namespace
}  // namespace ciera::nccl
