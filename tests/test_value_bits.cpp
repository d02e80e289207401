// The per-value split/merge and the rANS segment decoder that the CUDA kernels run
// (format/value_bits.hpp, entropy/rans_segment.hpp) compute exactly what the CPU codec computes:
// checked here on the host, so the kernels' logic is tested on every machine, GPU or not.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "common/bytes.hpp"
#include "entropy/rans.hpp"
#include "entropy/rans_segment.hpp"
#include "entropy/stream_writer_hd.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/planes.hpp"
#include "format/value_bits.hpp"
#include "test_util.hpp"

namespace ciera {
namespace {

using ciera::testing::random_bytes;

TEST(ValueBits, SplitAndMergeEqualTheCpuPlanes) {
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const size_t vb = dtype == DType::kFP32 ? 4 : 2;
    for (const uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{8}, uint64_t{9},
                             uint64_t{1001}, uint64_t{16384}}) {
      const auto values = random_bytes(n * vb, n + static_cast<uint64_t>(dtype));
      // The groups the kernels' threads take, last first: no group may depend on another's bytes.
      const auto code = static_cast<uint8_t>(dtype);
      std::vector<uint8_t> exps(n), sm(format::SignMantissaLayout(dtype, n).total_bytes());
      for (uint64_t g = format::bits::group_count(code, n); g-- > 0;) {
        format::bits::split_group(code, values.data(), n, g, exps.data(), sm.data());
      }
      const format::SignMantissaLayout layout(dtype, n);
      std::vector<uint8_t> cpu_exps(n), cpu_sm(layout.total_bytes());
      for (uint64_t first = 0; first < n; first += format::kMaxChunkValues) {
        const size_t count = static_cast<size_t>(std::min<uint64_t>(format::kMaxChunkValues, n - first));
        format::split_values(layout, format::kernels(), values.data() + first * vb, first, count,
                             cpu_exps.data() + first, cpu_sm.data());
      }
      EXPECT_EQ(exps, cpu_exps) << dtype_name(dtype) << " n " << n;
      EXPECT_EQ(sm, cpu_sm) << dtype_name(dtype) << " n " << n;
      std::vector<uint8_t> back(n * vb);
      for (uint64_t g = format::bits::group_count(code, n); g-- > 0;) {
        format::bits::merge_group(code, [&](uint64_t i) { return exps[i]; }, sm.data(), n, g, back.data());
      }
      EXPECT_EQ(back, values) << dtype_name(dtype) << " n " << n;
    }
  }
}

// Segment offsets of a rANS symbol stream, as the GPU decoder needs them.
struct Segments {
  entropy::RansModel model;
  const uint8_t* first = nullptr;
  std::vector<uint64_t> offsets;  // one per segment, then the end
};

Segments parse(const std::vector<uint8_t>& stream, uint64_t symbols) {
  ByteReader in(stream.data(), stream.size(), "test");
  EXPECT_EQ(in.u8(), static_cast<uint8_t>(entropy::StreamMethod::kRans));
  in.u8();
  const uint64_t body = in.u64();
  ByteReader b(in.cursor(), body, "test");
  Segments s;
  s.model = entropy::RansModel::read_table(b, 255, "test");
  const uint64_t count = entropy::rans_segment_count(symbols);
  const uint8_t* lengths = b.cursor();
  s.first = lengths + 4 * (count - 1);
  const uint64_t total = static_cast<uint64_t>(stream.data() + stream.size() - s.first);
  s.offsets.push_back(0);
  for (uint64_t j = 0; j + 1 < count; ++j) s.offsets.push_back(s.offsets.back() + load_le32(lengths + 4 * j));
  s.offsets.push_back(total);
  return s;
}

TEST(ValueBits, RansSegmentsDecodeOneByOneAsTheCpuDecoderDoes) {
  std::mt19937_64 rng(3);
  const uint64_t n = 3 * entropy::kRansSegmentSymbols + 1234;
  std::vector<uint8_t> symbols(n);
  for (auto& s : symbols) s = static_cast<uint8_t>(120 + std::min<int>(10, static_cast<int>(rng() % 64 == 0 ? rng() % 11 : rng() % 3)));
  entropy::ArraySource source(symbols);
  std::vector<uint8_t> scratch;
  const entropy::Histogram hist = entropy::histogram_of(source, scratch);
  std::vector<uint8_t> stream(entropy::symbol_stream_bound(n, 8));
  const auto stats = entropy::write_symbol_stream(source, hist, 8, stream.data(), stream.size(), scratch);
  ASSERT_EQ(stats.method, entropy::StreamMethod::kRans);
  stream.resize(stats.bytes);
  const Segments s = parse(stream, n);
  std::vector<uint32_t> slots(entropy::kRansTotal);
  for (unsigned sym = 0; sym < 256; ++sym) {
    for (uint32_t slot = s.model.start[sym]; slot < s.model.start[sym] + s.model.freq[sym]; ++slot) {
      slots[slot] = entropy::rans_slot_entry(sym, s.model.freq[sym], s.model.start[sym]);
    }
  }
  std::vector<uint8_t> out(n);
  for (uint64_t j = 0; j + 1 < s.offsets.size(); ++j) {
    const uint64_t first = j * entropy::kRansSegmentSymbols;
    const uint64_t count = std::min<uint64_t>(entropy::kRansSegmentSymbols, n - first);
    ASSERT_TRUE(entropy::rans_decode_segment(slots.data(), s.first + s.offsets[j],
                                             s.offsets[j + 1] - s.offsets[j], count, out.data() + first))
        << "segment " << j;
  }
  EXPECT_EQ(out, symbols);
  // A flipped word or state, a segment cut short or with a byte too many: malformed.
  for (const uint64_t at : {uint64_t{3}, uint64_t{70}, s.offsets[1] - 1}) {
    std::vector<uint8_t> bad(s.first, s.first + s.offsets[1]);
    bad[at] ^= 0x40;
    EXPECT_FALSE(entropy::rans_decode_segment(slots.data(), bad.data(), bad.size(),
                                              entropy::kRansSegmentSymbols, out.data()))
        << "byte " << at;
  }
  EXPECT_FALSE(entropy::rans_decode_segment(slots.data(), s.first, s.offsets[1] - 2,
                                            entropy::kRansSegmentSymbols, out.data()));
  std::vector<uint8_t> longer(s.first, s.first + s.offsets[1]);
  longer.push_back(0);
  longer.push_back(0);
  EXPECT_FALSE(entropy::rans_decode_segment(slots.data(), longer.data(), longer.size(),
                                            entropy::kRansSegmentSymbols, out.data()));
}

}  // namespace
}  // namespace ciera

namespace ciera {
namespace {

// The GPU's symbol stream writer (entropy/stream_writer_hd.hpp), its steps run in loops, writes
// exactly the CPU's write_symbol_stream bytes: empty, constant, packed, rANS of one and of many
// segments, and streams near the rANS/packed boundary.
std::vector<uint8_t> write_like_the_gpu(const std::vector<uint8_t>& v) {
  namespace dev = entropy::device;
  auto w = std::make_unique<dev::WriterPlan>();
  for (uint8_t s : v) ++w->count[s];
  w->total = v.size();
  dev::plan_writer(w.get());
  const uint64_t segments = entropy::rans_segment_count(v.size());
  std::vector<uint8_t> scratch(segments * dev::kSegmentScratch);
  std::vector<uint64_t> seg_bytes(segments + 1), seg_offsets(segments + 1);
  for (uint64_t j = 0; j < segments; ++j) dev::encode_segment(w.get(), v.data(), scratch.data(), seg_bytes.data(), j);
  std::vector<uint8_t> out(dev::kStreamHeader + 2 * v.size() + 4096);
  dev::finish_writer(w.get(), seg_bytes.data(), seg_offsets.data(), out.data());
  for (uint64_t j = 0; j < segments; ++j) {
    dev::copy_segment(w.get(), scratch.data(), seg_bytes.data(), seg_offsets.data(), out.data(), j);
  }
  for (uint64_t k = 0; k < w->bytes - dev::kStreamHeader; ++k) dev::packed_byte(w.get(), v.data(), out.data(), k);
  out.resize(w->bytes);
  return out;
}

std::vector<uint8_t> write_like_the_cpu(const std::vector<uint8_t>& v, unsigned bits) {
  entropy::ArraySource source(v);
  std::vector<uint8_t> scratch;
  const auto hist = entropy::histogram_of(source, scratch);
  std::vector<uint8_t> out(entropy::symbol_stream_bound(v.size(), bits));
  const auto stats = entropy::write_symbol_stream(source, hist, bits, out.data(), out.size(), scratch);
  out.resize(stats.bytes);
  return out;
}

TEST(ValueBits, GpuStreamWriterWritesTheCpuBytes) {
  std::mt19937_64 rng(31);
  std::vector<std::vector<uint8_t>> inputs{{}, {5}, std::vector<uint8_t>(999, 7)};
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = trial < 280 ? 1 + rng() % 3000 : entropy::kRansSegmentSymbols * (1 + rng() % 3) + rng() % 5000;
    const unsigned alphabet = 2 + static_cast<unsigned>(rng() % 40);
    const double skew = 0.2 + 0.08 * static_cast<double>(rng() % 10);
    std::vector<double> weights(alphabet);
    for (unsigned s = 0; s < alphabet; ++s) weights[s] = std::pow(skew, s);
    std::discrete_distribution<unsigned> pick(weights.begin(), weights.end());
    std::vector<uint8_t> v(n);
    for (auto& s : v) s = static_cast<uint8_t>(100 + pick(rng));
    inputs.push_back(std::move(v));
  }
  int rans = 0, packed = 0;
  for (const auto& v : inputs) {
    const auto cpu = write_like_the_cpu(v, 8);
    ASSERT_EQ(write_like_the_gpu(v), cpu) << "n " << v.size();
    rans += cpu[0] == 2;
    packed += cpu[0] == 0;
  }
  EXPECT_GT(rans, 50);
  EXPECT_GT(packed, 10);
}

}  // namespace
}  // namespace ciera
