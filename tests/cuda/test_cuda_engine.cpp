// The compressed allgather engine on the CUDA codec backend: ranks as threads sharing one GPU,
// over the loopback transport moving device memory (the multi-rank NCCL path is
// test_nccl_transport.cpp's). The same checks the host runs on tagged memory
// (tests/engine_backend_suite.hpp), plus what only a device has: the caller's stream as the
// input's fence, and a host rank and GPU ranks gathering together.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "ciera/cuda.hpp"
#include "cuda/cuda_test_util.hpp"
#include "engine_backend_suite.hpp"

namespace ciera::cuda {
namespace {

using ciera::testing::PayloadBytes;

std::shared_ptr<const CodecBackend> gpu() {
  static const auto backend = codec_backend(0);
  return backend;
}

struct Case {
  int world;
  DType dtype;
  WarmupMode warmup;
  bool in_place;
};

class CudaEngine : public ::testing::TestWithParam<Case> {};

TEST_P(CudaEngine, GathersAreBitwiseExactOnDeviceMemory) {
  SKIP_WITHOUT_DEVICE();
  const Case c = GetParam();
  ciera::testing::expect_exact_gathers(c.world, [](int) { return gpu(); }, c.dtype, c.warmup, c.in_place);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CudaEngine,
                         ::testing::Values(Case{2, DType::kBF16, WarmupMode::kRaw, false},
                                           Case{3, DType::kFP16, WarmupMode::kKeyFrames, true},
                                           Case{4, DType::kBF16, WarmupMode::kRaw, true},
                                           Case{4, DType::kFP32, WarmupMode::kRaw, false}));

TEST(CudaEngineFaults, CorruptionInTransitIsCaughtAndResent) {
  SKIP_WITHOUT_DEVICE();
  ciera::testing::expect_corruption_caught_and_resent(3, [](int) { return gpu(); });
}

TEST(CudaEngineFaults, ResetsPolicyChangesAndAdaptiveSwitchingStayExact) {
  SKIP_WITHOUT_DEVICE();
  ciera::testing::expect_exact_through_resets_and_policy_changes(3, [](int) { return gpu(); });
}

TEST(CudaEngineFaults, EveryRankFailsTogether) {
  SKIP_WITHOUT_DEVICE();
  ciera::testing::expect_every_rank_fails_together(3, [](int) { return gpu(); });
}

TEST(CudaEngineFaults, AHostRankAndGpuRanksGatherTogether) {
  SKIP_WITHOUT_DEVICE();
  // The loopback moves every rank's bytes with the device's memory (cudaMemcpyDefault reads
  // host memory too).
  ciera::testing::expect_exact_gathers(
      3, [](int r) { return r == 0 ? host_codec_backend() : gpu(); }, DType::kBF16,
      WarmupMode::kRaw, false, 40, &gpu()->memory());
}

// The caller's stream holds the input back (a host function on it that blocks until released,
// then the copy that writes the input): the gather must read the input only after both, while
// start() returns at once.
void CUDART_CB block_until(void* flag) {
  auto* released = static_cast<std::atomic<bool>*>(flag);
  while (!released->load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

TEST(CudaEngineFaults, InputIsReadOnlyAfterTheCallersStreamGetsThere) {
  SKIP_WITHOUT_DEVICE();
  const int world = 2;
  const auto layout = BucketLayout::fsdp_split("b", DType::kBF16, {200000, 3000}, world);
  EngineConfig config;
  config.warmup_steps = 2;
  ciera::testing::expect_no_errors(ciera::testing::run_backend_ranks(
      world, [](int) { return gpu(); }, [&](int rank, Transport& t, auto backend) {
        ciera::testing::Trajectory data(DType::kBF16, layout.total_bytes() / 2,
                                        ciera::testing::Pattern::kSparse, 3);
        PayloadBytes in(backend->memory(), layout.rank_bytes(rank));
        PayloadBytes out(backend->memory(), layout.total_bytes());
        CompressedAllgather engine(t, config, {layout}, backend);
        cudaStream_t stream = nullptr;
        ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
        const std::vector<std::byte> stale(layout.rank_bytes(rank), std::byte{0x7F});
        for (int step = 0; step < 6; ++step) {
          data.step();
          in.put(stale);
          std::vector<std::byte> fresh(data.values().begin() + layout.rank_offset(rank),
                                       data.values().begin() + layout.rank_offset(rank) + layout.rank_bytes(rank));
          std::atomic<bool> released{false};
          ASSERT_EQ(cudaLaunchHostFunc(stream, block_until, &released), cudaSuccess);
          ASSERT_EQ(cudaMemcpyAsync(in.data(), fresh.data(), fresh.size(), cudaMemcpyHostToDevice, stream),
                    cudaSuccess);
          const auto ticket = engine.start(0, in.span(), out.span(), reinterpret_cast<uintptr_t>(stream));
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          released = true;
          engine.wait(ticket);
          const std::vector<std::byte> got = out.get();
          ASSERT_TRUE(std::equal(got.begin(), got.end(), data.values().begin())) << "step " << step;
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        }
        cudaStreamDestroy(stream);
      }));
}

TEST(CudaEngineFaults, ANonexistentDeviceIsAConfigError) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_THROW(codec_backend(1 << 20), ConfigError);
  EXPECT_THROW(codec_backend(-1), ConfigError);
}

}  // namespace
}  // namespace ciera::cuda
