// The benchmark trajectory's float conversions must be exact IEEE round-to-nearest-even: the
// benchmarks' "realistic" BF16/FP16 shards are only as good as these casts.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "trajectory.hpp"

namespace ciera::tools {
namespace {

uint16_t bf16_reference(float f) {
  // Round to nearest even on the upper 16 bits, computed with doubles and explicit ties.
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t upper = u >> 16;
  const uint32_t lower = u & 0xFFFF;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) return static_cast<uint16_t>(upper + 1);
  return static_cast<uint16_t>(upper);
}

TEST(Trajectory, Fp16ConversionMatchesTheCompilersFloat16) {
  std::mt19937 rng(1);
  for (int i = 0; i < 2000000; ++i) {
    // Random bit patterns over the finite range, biased towards FP16's range and subnormals.
    uint32_t bits = rng();
    if (i % 2) bits = (bits & 0x807FFFFFu) | ((100u + rng() % 50u) << 23);
    const float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(float_to_fp16(f), want) << std::hex << "input bits " << bits;
  }
}

TEST(Trajectory, Bf16ConversionRoundsToNearestEven) {
  std::mt19937 rng(2);
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = rng();
    const float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16(f), bf16_reference(f)) << std::hex << bits;
  }
}

TEST(Trajectory, IsDeterministicAndMoves) {
  TrajectoryOptions o;
  o.num_values = 10000;
  AdamTrajectory a(o), b(o);
  for (int i = 0; i < 5; ++i) {
    a.step();
    b.step();
  }
  EXPECT_TRUE(std::equal(a.values().begin(), a.values().end(), b.values().begin()));
  std::vector<std::byte> before(a.values().begin(), a.values().end());
  a.step();
  EXPECT_FALSE(std::equal(before.begin(), before.end(), a.values().begin()));
}

TEST(Trajectory, ShardsOfATrajectoryComposeTheWhole) {
  TrajectoryOptions whole;
  whole.num_values = 1000;
  AdamTrajectory all(whole);
  TrajectoryOptions left = whole, right = whole;
  left.num_values = 400;
  right.num_values = 600;
  right.first_index = 400;
  AdamTrajectory a(left), b(right);
  for (int i = 0; i < 3; ++i) {
    all.step();
    a.step();
    b.step();
  }
  EXPECT_TRUE(std::equal(a.values().begin(), a.values().end(), all.values().begin()));
  EXPECT_TRUE(std::equal(b.values().begin(), b.values().end(), all.values().begin() + 800));
}

}  // namespace
}  // namespace ciera::tools
