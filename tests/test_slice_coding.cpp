// A coded slice of the lossless collectives (collectives/slice_coding.hpp): frames of
// frame_values values back to back, decoded bit for bit, each frame's table its own; and every
// way the frames can fail to fill the slice is a FormatError saying how.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "collectives/slice_coding.hpp"
#include "common/floats.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using collectives::coded_slice_bound;
using collectives::decode_slice;
using collectives::encode_slice;
using testing::put_value;

// N(0, scale) values rounded into `dtype`.
std::vector<std::byte> normal_values(DType dtype, size_t n, double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::vector<std::byte> out(n * dtype_info(dtype).value_bytes);
  for (size_t i = 0; i < n; ++i) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if (dtype == DType::kBF16) bits = float_to_bf16(f);
    if (dtype == DType::kFP16) bits = float_to_fp16(f);
    put_value(dtype, out, i, bits);
  }
  return out;
}

struct Coded {
  std::vector<std::byte> bytes;
  FrameStats stats;
};

Coded code(const CodecConfig& c, uint64_t frame_values, const std::vector<std::byte>& slice) {
  const uint64_t n = slice.size() / dtype_info(c.dtype).value_bytes;
  Coded coded;
  coded.bytes.resize(coded_slice_bound(c, n, frame_values));
  coded.stats = encode_slice(c, frame_values, slice, coded.bytes);
  coded.bytes.resize(coded.stats.payload_bytes);
  return coded;
}

// The frames' value counts, read from their headers one after another.
std::vector<uint64_t> frame_values_of(std::span<const std::byte> bytes) {
  std::vector<uint64_t> values;
  for (size_t at = 0; at < bytes.size();) {
    const PayloadInfo frame = inspect_leading_payload(bytes.subspan(at));
    values.push_back(frame.num_values);
    at += frame.payload_bytes;
  }
  return values;
}

TEST(SliceCoding, FramesOfFrameValuesDecodeBitForBit) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    CodecConfig c;
    c.dtype = dtype;
    for (const size_t n : {size_t{1}, size_t{999}, size_t{1000}, size_t{1001}, size_t{5000}}) {
      const auto slice = normal_values(dtype, n, 0.02, n);
      // 2^63 too (one frame per slice), whose size in bytes does not fit 64 bits.
      for (const uint64_t frame_values :
           {uint64_t{1000}, uint64_t{333}, uint64_t{1} << 18, uint64_t{1} << 63}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n " + std::to_string(n) + " frames of " +
                     std::to_string(frame_values));
        const Coded coded = code(c, frame_values, slice);
        std::vector<uint64_t> expected;
        for (uint64_t at = 0; at < n; at += frame_values)
          expected.push_back(std::min<uint64_t>(frame_values, n - at));
        EXPECT_EQ(frame_values_of(coded.bytes), expected);
        std::vector<std::byte> out(slice.size(), std::byte{0x5A});
        decode_slice(c, coded.bytes, out);
        EXPECT_EQ(out, slice);
      }
    }
  }
}

// A slice whose two halves have exponents far apart codes smaller as two frames than as one:
// each frame's table fits its half.
TEST(SliceCoding, EachFrameHasATableOfItsOwn) {
  CodecConfig c;
  c.dtype = DType::kFP32;
  auto slice = normal_values(DType::kFP32, 8192, 1e-6, 1);
  const auto high = normal_values(DType::kFP32, 8192, 1e6, 2);
  slice.insert(slice.end(), high.begin(), high.end());
  const Coded one = code(c, 16384, slice), two = code(c, 8192, slice);
  EXPECT_EQ(frame_values_of(two.bytes).size(), 2u);
  // Each half's exponents take about one bit less with a table of their own.
  EXPECT_LT(two.stats.payload_bytes + 16384 / 8 / 2, one.stats.payload_bytes);
  EXPECT_LT(two.stats.coded_symbols_entropy_bits + 16384 * 0.9,
            one.stats.coded_symbols_entropy_bits);
}

void expect_format_error(const CodecConfig& c, std::span<const std::byte> in,
                         std::span<std::byte> out, const std::string& text) {
  try {
    decode_slice(c, in, out);
    ADD_FAILURE() << "decoded; expected: " << text;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(SliceCoding, FramesThatDoNotFillTheSliceExactlyAreFormatErrors) {
  CodecConfig c;
  c.dtype = DType::kBF16;
  const auto slice = normal_values(DType::kBF16, 2500, 0.02, 3);
  const Coded coded = code(c, 1000, slice);  // frames of 1000, 1000 and 500 values
  const auto first = inspect_leading_payload(coded.bytes).payload_bytes;
  std::vector<std::byte> out(slice.size());

  auto longer = coded.bytes;  // the first frame again after the last
  longer.insert(longer.end(), coded.bytes.begin(), coded.bytes.begin() + first);
  expect_format_error(c, longer, out, "a frame of 1000 values where 0 of the slice are left");

  const std::span<const std::byte> all(coded.bytes);
  const auto second = inspect_leading_payload(all.subspan(first)).payload_bytes;
  expect_format_error(c, all.first(first + second), out,
                      "the slice's frames hold 2000 of its 2500 values");
  expect_format_error(c, all.first(all.size() - 1), out, "payload truncated");
  expect_format_error(c, {}, out, "the slice's frames hold 0 of its 2500 values");

  std::vector<std::byte> shorter(2200 * 2);  // the third frame's 500 values where 200 are left
  expect_format_error(c, coded.bytes, shorter, "a frame of 500 values where 200 of the slice");

  auto corrupt = coded.bytes;  // a value of the second frame's sign-mantissa plane changed
  corrupt[first + 200] ^= std::byte{0x01};
  expect_format_error(c, corrupt, out, "checksum");
}

}  // namespace
}  // namespace ciera
