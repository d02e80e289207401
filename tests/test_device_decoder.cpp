// The GPU decoder's logic (codec/device_decode.hpp), run on the host by the emulation that calls
// the same step functions as the CUDA kernels, against the CPU decoder: on every frame of
// trajectories over dtype x block size x shard size x change pattern x coding mode, the same
// output bit for bit and the same exponent cache; on corrupted, truncated, misrouted and
// out-of-sequence payloads, the same verdict (both refuse, with the cache left as it was).
#include <gtest/gtest.h>

#include <random>
#include <span>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/device_decode_emulation.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using codec::device::EmulatedDecoder;
using testing::Pattern;
using testing::Trajectory;

std::span<const uint8_t> bytes_of(const std::vector<std::byte>& v, size_t n) {
  return {reinterpret_cast<const uint8_t*>(v.data()), n};
}

// Rewrites the header checksum so that a mutation of the header reaches the later checks.
void reseal(std::vector<std::byte>& payload) {
  if (payload.size() < 80) return;
  auto* p = reinterpret_cast<uint8_t*>(payload.data());
  store_le32(p + 72, static_cast<uint32_t>(checksum64(p, 72)));
}

struct Case {
  DType dtype;
  uint32_t block;
  size_t n;
  Pattern pattern;
  ExponentCoding coding;
  ChangeDetection detection;
};

std::string name_of(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " B " + std::to_string(c.block) + " n " +
         std::to_string(c.n) + " pattern " + std::to_string(static_cast<int>(c.pattern)) +
         " coding " + std::string(exponent_coding_name(c.coding)) + " " +
         std::string(change_detection_name(c.detection));
}

// Decodes a trajectory with both decoders; with `mutate`, tries corrupted copies of each payload
// first, which both must refuse alike (or accept alike, with equal output).
void run(const Case& c, bool mutate, uint64_t seed) {
  SCOPED_TRACE(name_of(c));
  CodecConfig config;
  config.dtype = c.dtype;
  config.block_values = c.block;
  config.coding = c.coding;
  config.detection = c.detection;
  config.warmup_steps = 2;
  const StreamIdentity id{7, 99};
  ShardEncoder encoder(config, c.n, id);
  ShardDecoder cpu(config, c.n, id);
  EmulatedDecoder emulated(config, c.n, id);
  Trajectory trajectory(c.dtype, c.n, c.pattern, seed);
  const size_t value_bytes = dtype_info(c.dtype).value_bytes;
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  std::vector<std::byte> cpu_out(c.n * value_bytes), dev_out(c.n * value_bytes);
  std::mt19937_64 rng(seed);
  bool in_sync = true;
  for (int step = 0; step < 8 && in_sync; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) trajectory.step();
    const FrameStats stats = encoder.encode(trajectory.span(), payload);
    const size_t size = stats.payload_bytes;
    if (mutate) {
      for (int trial = 0; trial < 12 && in_sync; ++trial) {
        std::vector<std::byte> bad(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(size));
        const int kind = static_cast<int>(rng() % 4);
        if (kind == 3 && !bad.empty()) {
          bad.resize(rng() % bad.size());  // truncated
        } else if (!bad.empty()) {
          for (int flips = 1 + static_cast<int>(rng() % 3); flips > 0; --flips) {
            bad[rng() % bad.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
          }
          if (kind != 0) reseal(bad);
        }
        const std::vector<uint8_t> cache_before(emulated.cache().begin(), emulated.cache().end());
        bool cpu_ok = true;
        try {
          cpu.decode(bad, cpu_out);
        } catch (const FormatError&) {
          cpu_ok = false;
        }
        const uint32_t status = emulated.decode(bytes_of(bad, bad.size()),
                                                {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
        ASSERT_EQ(status == codec::device::kOk, cpu_ok)
            << "trial " << trial << ": CPU " << (cpu_ok ? "accepted" : "refused") << ", device "
            << codec::device::describe_status(status, emulated.plan().detail[0], emulated.plan().detail[1]);
        if (cpu_ok) {
          ASSERT_EQ(dev_out, cpu_out);
          in_sync = false;  // both moved on past the encoder; stop this trajectory here
        } else {
          ASSERT_TRUE(std::equal(cache_before.begin(), cache_before.end(), emulated.cache().begin()))
              << "a refused frame changed the device cache";
        }
      }
      if (!in_sync) break;
    }
    cpu.decode(std::span(payload.data(), size), cpu_out);
    const uint32_t status = emulated.decode(bytes_of(payload, size),
                                            {reinterpret_cast<uint8_t*>(dev_out.data()), dev_out.size()});
    ASSERT_EQ(status, codec::device::kOk)
        << codec::device::describe_status(status, emulated.plan().detail[0], emulated.plan().detail[1])
        << " (" << exponent_section_name(stats.section) << " frame)";
    ASSERT_EQ(dev_out, trajectory.values());
    ASSERT_EQ(dev_out, cpu_out);
    ASSERT_TRUE(std::equal(cpu.cached_exponents().begin(), cpu.cached_exponents().end(),
                           emulated.cache().begin()));
  }
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint32_t block : {64u, 512u, 4096u}) {
      for (const size_t n : {size_t{0}, size_t{1}, size_t{777}, size_t{40001}}) {
        for (const Pattern pattern : {Pattern::kSparse, Pattern::kRandom, Pattern::kSpecial}) {
          for (const ExponentCoding coding : {ExponentCoding::kAuto, ExponentCoding::kBlock, ExponentCoding::kFine}) {
            all.push_back({dtype, block, n, pattern, coding, ChangeDetection::kExact});
          }
          all.push_back({dtype, block, n, pattern, ExponentCoding::kBlock, ChangeDetection::kHash});
        }
      }
    }
  }
  return all;
}

TEST(DeviceDecoder, EmulatedStepsDecodeEveryFrameAsTheCpuDecoder) {
  uint64_t seed = 1;
  for (const Case& c : cases()) run(c, false, seed++);
}

TEST(DeviceDecoder, EmulatedStepsRefuseWhatTheCpuDecoderRefuses) {
  uint64_t seed = 1000;
  for (const Case& c : cases()) {
    if (c.n > 1000) continue;
    run(c, true, seed++);
  }
}

TEST(DeviceDecoder, LargeKeyFramesSpanSeveralRansSegments) {
  run({DType::kBF16, 512, 3 * 16384 + 123, Pattern::kSparse, ExponentCoding::kAuto, ChangeDetection::kExact},
      false, 5);
}

// The stream rules (docs/format.md, "Streams") as the CPU decoder applies them.
TEST(DeviceDecoder, StreamPositionRulesMatchTheCpuDecoder) {
  CodecConfig config;
  config.warmup_steps = 1;
  const size_t n = 1000;
  ShardEncoder encoder(config, n, {3, 10});
  Trajectory trajectory(DType::kBF16, n, Pattern::kSparse, 4);
  std::vector<std::vector<std::byte>> frames;
  for (int step = 0; step < 4; ++step) {
    if (step > 0) trajectory.step();
    std::vector<std::byte> payload(encoder.max_payload_bytes());
    payload.resize(encoder.encode(trajectory.span(), payload).payload_bytes);
    frames.push_back(payload);
  }
  std::vector<uint8_t> out(2 * n);
  EmulatedDecoder other_stream(config, n, {4, 10});
  EXPECT_EQ(other_stream.decode(bytes_of(frames[0], frames[0].size()), out), codec::device::kMisrouted);
  EmulatedDecoder d(config, n, {3, 10});
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kNoCache);
  EXPECT_EQ(d.decode(bytes_of(frames[0], frames[0].size()), out), codec::device::kOk);
  EXPECT_EQ(d.decode(bytes_of(frames[2], frames[2].size()), out), codec::device::kOutOfSequence);
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kOk);
  EXPECT_EQ(d.decode(bytes_of(frames[1], frames[1].size()), out), codec::device::kOutOfSequence);  // replay
  EXPECT_EQ(d.decode(bytes_of(frames[2], frames[2].size()), out), codec::device::kOk);
  // A resynchronisation: the next key frame starts a new epoch, accepted only once requested.
  encoder.request_key_frame();
  trajectory.step();
  std::vector<std::byte> key(encoder.max_payload_bytes());
  key.resize(encoder.encode(trajectory.span(), key).payload_bytes);
  EXPECT_EQ(d.decode(bytes_of(key, key.size()), out), codec::device::kUnrequestedEpoch);
  d.request_resync();
  EXPECT_EQ(d.decode(bytes_of(key, key.size()), out), codec::device::kOk);
  EXPECT_EQ(d.state().epoch, 11u);
}

}  // namespace
}  // namespace ciera
