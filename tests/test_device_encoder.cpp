// The GPU encoder's logic (codec/device_encode.hpp), run on the host by the emulation that calls
// the same step functions as the CUDA kernels, writes the CPU encoder's payloads byte for byte:
// every frame of trajectories over dtype x block size x shard size x change pattern x coding
// mode (exact detection), key frames after a resynchronisation included; and value-delta streams
// (every dtype, sizes 0..5, 1000 and 100003, every kind of step, the key frames sent when the
// differences do not fit).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/device_encode_emulation.hpp"
#include "cuda/value_delta_trajectory.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using codec::device::EmulatedEncoder;
using testing::DeltaStep;
using testing::DeltaTrajectory;
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

// ---- value-delta streams (docs/format.md, "Value-delta frames") ---------------------------------

// Frames the value-delta runs compared: key frames of the schedule (first, resynchronising), key
// frames sent because the differences did not fit, 'unchanged' and 'differences' frames.
struct DeltaCounts {
  int key = 0, fallback = 0, unchanged = 0, differences = 0;
  int group_method[3] = {}, escape_method[3] = {};  // packed, constant, rANS
};
DeltaCounts g_delta;

// The emulated device encoder and the CPU encoder on one value-delta trajectory: every payload
// byte for byte, and the receivers' values the device remembers equal to the values sent.
void run_delta(DType dtype, size_t n, uint64_t seed, uint32_t block = 512, bool checksum = true,
               ChangeDetection detection = ChangeDetection::kExact,
               const std::vector<DeltaStep>& steps = testing::delta_schedule()) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + " n " + std::to_string(n) + " B " + std::to_string(block) +
               (checksum ? "" : " no checksum") + " " + std::string(change_detection_name(detection)));
  CodecConfig config;
  config.dtype = dtype;
  config.stream_kind = StreamKind::kValueDelta;
  config.block_values = block;
  config.warmup_steps = 5;  // ignored by value-delta streams, on both
  config.content_checksum = checksum;
  config.detection = detection;  // ignored by value-delta streams, on both
  const StreamIdentity id{23, 4000};
  ShardEncoder cpu(config, n, id);
  EmulatedEncoder gpu(config, n, id);
  DeltaTrajectory trajectory(dtype, n, seed);
  std::vector<std::byte> expected(cpu.max_payload_bytes());
  std::vector<uint8_t> got(cpu.max_payload_bytes());
  for (size_t step = 0; step <= steps.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step) +
                 (step > 0 ? " (" + testing::delta_step_name(steps[step - 1]) + ")" : std::string()));
    if (step > 0) trajectory.step(steps[step - 1]);
    const bool requested = step == steps.size() - 3;
    if (requested) {
      cpu.request_key_frame();
      gpu.request_key_frame();
    }
    const FrameStats stats = cpu.encode(trajectory.span(), expected);
    const uint64_t size = gpu.encode(trajectory.bytes(), got);
    if (stats.kind == FrameKind::kKey) {
      ++(step == 0 || requested ? g_delta.key : g_delta.fallback);
    } else {
      ASSERT_EQ(stats.kind, FrameKind::kValueDelta);
      ++(stats.section == ExponentSection::kUnchanged ? g_delta.unchanged : g_delta.differences);
    }
    ASSERT_EQ(size, stats.payload_bytes) << frame_kind_name(stats.kind) << " frame, "
                                         << exponent_section_name(stats.section) << " section";
    for (size_t k = 0; k < size; ++k) {
      ASSERT_EQ(got[k], static_cast<uint8_t>(expected[k]))
          << "first difference at byte " << k << " of " << size << " (" << frame_kind_name(stats.kind)
          << " frame, " << exponent_section_name(stats.section) << " section)";
    }
    ASSERT_TRUE(std::equal(gpu.sent_values().begin(), gpu.sent_values().end(), trajectory.bytes().begin()))
        << "the device's copy of the values sent is not the values";
    if (stats.section == ExponentSection::kDifferences) {
      // The two streams' methods (docs/format.md, "Symbol stream"): all of them were compared.
      uint64_t groups_body = 0;
      for (unsigned k = 0; k < 8; ++k) groups_body |= uint64_t{got[82 + k]} << (8 * k);
      ++g_delta.group_method[got[80] % 3];
      ++g_delta.escape_method[got[90 + groups_body] % 3];
    }
  }
}

TEST(DeviceEncoder, ValueDeltaFramesAreTheCpuEncodersByteForByte) {
  g_delta = {};
  uint64_t seed = 100;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{1000},
                           size_t{3000}, size_t{100003}}) {
      run_delta(dtype, n, seed++);
    }
  }
  // Below a few dozen values any change falls back to a key frame (the section's 28 bytes of
  // framing exceed a key frame's bound); the larger shards take value-delta frames but for the
  // random steps.
  EXPECT_GE(g_delta.key, 3 * 8 * 2);
  EXPECT_GE(g_delta.fallback, 3 * 8 * 3);
  EXPECT_GE(g_delta.unchanged, 3 * 8 * 2);
  EXPECT_GE(g_delta.differences, 3 * 2 * 9);
  for (int method : {0, 1, 2}) {
    EXPECT_GT(g_delta.group_method[method], 0) << "groups stream method " << method;
    EXPECT_GT(g_delta.escape_method[method], 0) << "escapes stream method " << method;
  }
  std::printf("value-delta frames compared: %d key, %d key instead of differences, %d unchanged, %d differences "
              "(groups packed/constant/rANS %d/%d/%d, escapes %d/%d/%d)\n",
              g_delta.key, g_delta.fallback, g_delta.unchanged, g_delta.differences, g_delta.group_method[0],
              g_delta.group_method[1], g_delta.group_method[2], g_delta.escape_method[0], g_delta.escape_method[1],
              g_delta.escape_method[2]);
}

// Block size and checksum change the key frames and the size bound the differences must fit;
// hash detection changes nothing (value-delta streams keep no block hashes).
TEST(DeviceEncoder, ValueDeltaFramesWithOtherBlockSizesAndNoChecksum) {
  uint64_t seed = 300;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 4096u}) {
      for (const bool checksum : {true, false}) run_delta(dtype, 777, seed++, block, checksum);
    }
    run_delta(dtype, 5000, seed++, 512, true, ChangeDetection::kHash);
  }
}

// Jumps on a growing share of the values: the differences grow past the key frame's bound, and
// the frame where they stop fitting is a key frame on both (the CPU's integer rule).
TEST(DeviceEncoder, ValueDeltaFallsBackToAKeyFrameWhereTheCpuEncoderDoes) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const size_t n = 3001;
    CodecConfig config;
    config.dtype = dtype;
    config.stream_kind = StreamKind::kValueDelta;
    ShardEncoder cpu(config, n);
    EmulatedEncoder gpu(config, n);
    std::vector<std::byte> expected(cpu.max_payload_bytes());
    std::vector<uint8_t> got(cpu.max_payload_bytes());
    const size_t value_bytes = dtype_info(dtype).value_bytes;
    std::vector<std::byte> values(n * value_bytes);
    std::mt19937_64 rng(dtype == DType::kFP32 ? 5 : 6);
    for (auto& b : values) b = static_cast<std::byte>(rng());
    bool saw_key = false, saw_delta = false;
    for (int percent = 0; percent <= 100; percent += 2) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " jumps on " + std::to_string(percent) + "%");
      for (size_t i = 0; i < n; ++i) {
        if (rng() % 100 < static_cast<uint64_t>(percent)) {
          for (size_t k = 0; k < value_bytes; ++k) values[i * value_bytes + k] = static_cast<std::byte>(rng());
        }
      }
      const FrameStats stats = cpu.encode(values, expected);
      const uint64_t size = gpu.encode({reinterpret_cast<const uint8_t*>(values.data()), values.size()}, got);
      if (percent > 0) (stats.kind == FrameKind::kKey ? saw_key : saw_delta) = true;
      ASSERT_EQ(size, stats.payload_bytes);
      ASSERT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(size),
                             reinterpret_cast<const uint8_t*>(expected.data())));
    }
    EXPECT_TRUE(saw_key);
    EXPECT_TRUE(saw_delta);
  }
}

// Tiny shards and random steps of nearly the full width: differences whose packed bound fits
// max_payload_bytes but whose coded size passes the key frame's own bound, where both send the
// key frame instead (the CPU's rule, docs/format.md "Size bound").
TEST(DeviceEncoder, ValueDeltaCodedPastTheKeyFramesBoundIsAKeyFrameOnBoth) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const size_t n : {size_t{10}, size_t{17}, size_t{33}, size_t{65}}) {
      CodecConfig config;
      config.dtype = dtype;
      config.stream_kind = StreamKind::kValueDelta;
      config.block_values = 64;
      ShardEncoder cpu(config, n);
      EmulatedEncoder gpu(config, n);
      std::vector<std::byte> expected(cpu.max_payload_bytes());
      std::vector<uint8_t> got(cpu.max_payload_bytes());
      const size_t value_bytes = dtype_info(dtype).value_bytes;
      const unsigned width = 8 * static_cast<unsigned>(value_bytes);
      std::vector<uint8_t> values(n * value_bytes);
      std::mt19937_64 rng(n + value_bytes);
      for (auto& b : values) b = static_cast<uint8_t>(rng());
      for (int trial = 0; trial < 200; ++trial) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n " + std::to_string(n) + " trial " +
                     std::to_string(trial));
        const unsigned bits = width - static_cast<unsigned>(rng() % 7);
        const uint64_t percent = std::array<uint64_t, 4>{100, 80, 50, 30}[rng() % 4];
        for (size_t i = 0; i < n; ++i) {
          const uint64_t r = rng();
          if (r % 100 >= percent) continue;
          uint32_t x = 0;
          std::memcpy(&x, values.data() + i * value_bytes, value_bytes);
          x += static_cast<uint32_t>((r >> 8) & ((uint64_t{1} << bits) - 1));
          std::memcpy(values.data() + i * value_bytes, &x, value_bytes);
        }
        const FrameStats stats = cpu.encode(std::as_bytes(std::span(values)), expected);
        const uint64_t size = gpu.encode(values, got);
        ASSERT_EQ(size, stats.payload_bytes) << frame_kind_name(stats.kind) << " frame on the CPU";
        ASSERT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(size),
                               reinterpret_cast<const uint8_t*>(expected.data())));
      }
    }
  }
}

}  // namespace
}  // namespace ciera
