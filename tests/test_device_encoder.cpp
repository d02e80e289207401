// The GPU encoder's logic (codec/device_encode.hpp), run on the host by the emulation that calls
// the same step functions as the CUDA kernels, writes the CPU encoder's payloads byte for byte:
// every frame of trajectories over dtype x block size x shard size x change pattern x coding
// mode (exact detection), key frames after a resynchronisation included.
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/device_encode_emulation.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using codec::device::EmulatedEncoder;
using testing::Pattern;
using testing::Trajectory;

// Frames of each exponent section kind the runs compared (full, unchanged, block, fine).
int g_sections[4] = {};

void run(DType dtype, uint32_t block, size_t n, Pattern pattern, ExponentCoding coding, uint64_t seed,
         ChangeDetection detection = ChangeDetection::kExact, uint32_t hash_bits = 128) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " B " + std::to_string(block) + " n " + std::to_string(n) +
               " pattern " + std::to_string(static_cast<int>(pattern)) + " " +
               std::string(exponent_coding_name(coding)));
  CodecConfig config;
  config.dtype = dtype;
  config.block_values = block;
  config.coding = coding;
  config.detection = detection;
  config.hash_bits = hash_bits;
  config.warmup_steps = 2;
  const StreamIdentity id{11, 500};
  ShardEncoder cpu(config, n, id);
  EmulatedEncoder gpu(config, n, id);
  Trajectory trajectory(dtype, n, pattern, seed);
  std::vector<std::byte> expected(cpu.max_payload_bytes());
  std::vector<uint8_t> got(cpu.max_payload_bytes());
  for (int step = 0; step < 9; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) trajectory.step();
    if (step == 6) {
      cpu.request_key_frame();
      gpu.request_key_frame();
    }
    const FrameStats stats = cpu.encode(trajectory.span(), expected);
    const uint64_t size = gpu.encode({reinterpret_cast<const uint8_t*>(trajectory.values().data()),
                                      trajectory.values().size()}, got);
    ++g_sections[static_cast<int>(stats.section)];
    ASSERT_EQ(size, stats.payload_bytes) << exponent_section_name(stats.section) << " frame";
    for (size_t k = 0; k < size; ++k) {
      ASSERT_EQ(got[k], static_cast<uint8_t>(expected[k]))
          << "first difference at byte " << k << " of " << size << " ("
          << exponent_section_name(stats.section) << " frame)";
    }
  }
}

TEST(DeviceEncoder, EmulatedStepsWriteTheCpuPayloadsByteForByte) {
  uint64_t seed = 1;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 4096u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{777}, size_t{40001}}) {
        for (const Pattern pattern : {Pattern::kNone, Pattern::kSparse, Pattern::kRandom, Pattern::kSpecial}) {
          for (const ExponentCoding coding : {ExponentCoding::kAuto, ExponentCoding::kBlock, ExponentCoding::kFine}) {
            run(dtype, block, n, pattern, coding, seed++);
          }
          run(dtype, block, n, pattern, ExponentCoding::kAuto, seed++, ChangeDetection::kHash);
        }
      }
    }
  }
  for (int section = 0; section < 4; ++section) {
    EXPECT_GT(g_sections[section], 20) << "too few " << exponent_section_name(static_cast<ExponentSection>(section))
                                       << " frames compared";
  }
}

TEST(DeviceEncoder, LargeShardsWithSeveralRansSegments) {
  run(DType::kBF16, 512, 3 * 16384 * 4 + 99, Pattern::kSparse, ExponentCoding::kAuto, 7);
  run(DType::kFP16, 64, 70000, Pattern::kRandom, ExponentCoding::kAuto, 8);
}

// With few hash bits, blocks collide and changed blocks are sent as unchanged (the reliability
// suite's hook): the GPU must make the very same mistake, byte for byte.
TEST(DeviceEncoder, HashCollisionsAreTheCpuEncodersToo) {
  run(DType::kBF16, 64, 20000, Pattern::kRandom, ExponentCoding::kAuto, 9, ChangeDetection::kHash, 3);
  run(DType::kFP16, 512, 20000, Pattern::kSparse, ExponentCoding::kAuto, 10, ChangeDetection::kHash, 70);
}

}  // namespace
}  // namespace ciera
