// rANS and symbol streams: exact round trips, size close to the entropy bound, strict parsing.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "ciera/error.hpp"
#include "entropy/rans.hpp"
#include "entropy/symbol_stream.hpp"

namespace ciera::entropy {
namespace {

// A source that serves a vector in chunks of a fixed size (exercises chunk boundaries).
class ChunkedSource final : public SymbolSource {
 public:
  ChunkedSource(const std::vector<uint8_t>& v, size_t chunk) : v_(v), chunk_(chunk) {}
  size_t chunk_count() const override { return (v_.size() + chunk_ - 1) / chunk_; }
  size_t max_chunk_symbols() const override { return chunk_; }
  std::span<const uint8_t> chunk(size_t i, uint8_t* scratch) const override {
    const size_t first = i * chunk_;
    const size_t n = std::min(chunk_, v_.size() - first);
    std::copy(v_.begin() + first, v_.begin() + first + n, scratch);  // force the scratch path
    return {scratch, n};
  }

 private:
  const std::vector<uint8_t>& v_;
  size_t chunk_;
};

std::vector<uint8_t> exponent_like(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0, 0.02);
  std::vector<uint8_t> v(n);
  for (auto& s : v) {
    const double x = std::fabs(normal(rng)) + 1e-30;
    s = static_cast<uint8_t>(std::clamp(127 + static_cast<int>(std::floor(std::log2(x))), 0, 255));
  }
  return v;
}

std::vector<uint8_t> decode_all(const std::vector<uint8_t>& stream, uint64_t n, unsigned max_symbol,
                                size_t piece) {
  ByteReader in(stream.data(), stream.size(), "test");
  SymbolStreamReader reader;
  reader.open(in, n, max_symbol, "test stream");
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; i += piece) reader.get(out.data() + i, std::min<size_t>(piece, n - i));
  reader.finish();
  EXPECT_EQ(in.remaining(), 0u);
  return out;
}

std::vector<uint8_t> encode(const std::vector<uint8_t>& v, unsigned bits, size_t chunk,
                            StreamStats* stats = nullptr) {
  ChunkedSource src(v, chunk);
  std::vector<uint8_t> scratch;
  const Histogram hist = histogram_of(src, scratch);
  std::vector<uint8_t> out(symbol_stream_bound(v.size(), bits));
  const StreamStats s = write_symbol_stream(src, hist, bits, out.data(), out.size(), scratch);
  out.resize(s.bytes);
  if (stats) *stats = s;
  return out;
}

TEST(Rans, ReciprocalDivisionIsExactForEveryFrequency) {
  // The encoder replaces x / freq by a multiply and shift; a round trip through every frequency
  // from 1 to 4095, with the states driven across their whole range, proves it exact.
  std::mt19937_64 rng(1);
  for (uint32_t freq = 1; freq < kRansTotal; ++freq) {
    Histogram h;
    h.count[0] = freq;
    h.count[1] = kRansTotal - freq;
    h.total = kRansTotal;
    const RansModel model = RansModel::from_histogram(h);
    ASSERT_EQ(model.freq[0], freq);
    std::vector<uint8_t> symbols(256);
    for (size_t i = 0; i < symbols.size(); ++i) symbols[i] = (i % 2 == 0) ? 0 : static_cast<uint8_t>(rng() % 2);
    std::vector<uint8_t> buffer(2 * symbols.size() + kRansStateBytes);
    RansEncoder encoder(model);
    encoder.begin(buffer.data() + buffer.size(), buffer.data(), symbols.size(), nullptr);
    ASSERT_TRUE(encoder.put_reverse(symbols.data(), symbols.size()));
    const uint8_t* bytes = encoder.bytes_begin();
    RansDecoder decoder;
    decoder.begin(model, bytes, static_cast<uint64_t>(buffer.data() + buffer.size() - bytes),
                  symbols.size(), "test");
    std::vector<uint8_t> back(symbols.size());
    decoder.get(back.data(), back.size());
    decoder.finish();
    ASSERT_EQ(back, symbols) << "freq " << freq;
  }
}

TEST(SymbolStream, RoundTripsEveryMethodAndChunking) {
  std::mt19937_64 rng(2);
  std::vector<std::vector<uint8_t>> inputs;
  inputs.push_back({});
  inputs.push_back({7});
  inputs.push_back(std::vector<uint8_t>(1000, 42));  // constant
  inputs.push_back(exponent_like(100000, 3));         // rANS
  std::vector<uint8_t> uniform(5000);
  for (auto& s : uniform) s = static_cast<uint8_t>(rng());
  inputs.push_back(uniform);                           // packed (incompressible)
  std::vector<uint8_t> skewed(20000, 0);
  for (size_t i = 0; i < skewed.size(); i += 97) skewed[i] = static_cast<uint8_t>(1 + rng() % 3);
  inputs.push_back(skewed);
  for (const auto& v : inputs) {
    for (size_t chunk : {size_t{1}, size_t{3}, size_t{512}, size_t{70000}}) {
      StreamStats stats;
      const auto stream = encode(v, 8, chunk, &stats);
      EXPECT_LE(stream.size(), symbol_stream_bound(v.size(), 8));
      for (size_t piece : {size_t{1}, size_t{511}, size_t{100000}}) {
        EXPECT_EQ(decode_all(stream, v.size(), 255, piece), v)
            << "n=" << v.size() << " chunk=" << chunk << " piece=" << piece;
      }
    }
  }
}

TEST(SymbolStream, RansIsWithinOnePercentOfTheEntropyBound) {
  for (uint64_t seed : {1, 2, 3}) {
    const auto v = exponent_like(1 << 20, seed);
    StreamStats stats;
    encode(v, 8, 16384, &stats);
    ASSERT_EQ(stats.method, StreamMethod::kRans);
    // The coder is within 1% of the bound; the segments' states and lengths (68 bytes per
    // 16384 symbols, about 1.3% at these 2.6 bits per symbol: docs/format.md) come on top.
    const double framing_bits = 8.0 * static_cast<double>(rans_framing_bytes(v.size()));
    EXPECT_LT(static_cast<double>(stats.bytes) * 8 - framing_bits, stats.entropy_bits * 1.01);
  }
}

// Streams of more than one segment round-trip at every length around a segment boundary, in
// chunks that straddle boundaries, and each segment starts with its own states.
// A histogram taken chunk by chunk is the histogram of all the chunks, however they are cut,
// and take() starts the next one.
TEST(Histogram, SymbolCounterCountsWhatHistogramCounts) {
  std::mt19937_64 rng(23);
  SymbolCounter<64> counter;
  for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{100003}}) {
    std::vector<uint8_t> v(n);
    for (auto& s : v) s = static_cast<uint8_t>(rng() % 64);
    if (n > 10) std::fill(v.begin(), v.begin() + 10, uint8_t{63});  // a run of one symbol
    Histogram want;
    want.add(v.data(), n);
    for (size_t i = 0; i < n;) {
      const size_t piece = std::min<size_t>(n - i, 1 + rng() % 3000);
      counter.add(v.data() + i, piece);
      i += piece;
    }
    const Histogram got = counter.take();
    EXPECT_EQ(got.total, want.total) << n;
    EXPECT_EQ(got.count, want.count) << n;
  }
  EXPECT_EQ(counter.take().total, 0u);
}

// Byte symbols go through the kernels' vector window, placed from the counts so far and placed
// again every 2^16 symbols: the counts are a plain count's wherever the symbols cluster, when
// the cluster moves (the window must follow it), and for symbols the window never holds.
TEST(Histogram, ByteSymbolCounterCountsEverySymbolWhereverTheWindowIs) {
  std::mt19937_64 rng(41);
  SymbolCounter<256> counter;
  for (const unsigned spread : {4u, 40u, 256u}) {
    std::vector<uint8_t> v(300000);
    for (size_t i = 0; i < v.size(); ++i) {
      const unsigned centre = i < v.size() / 2 ? 120 : 60;  // the cluster moves halfway
      v[i] = static_cast<uint8_t>(spread == 256 ? rng() % 256 : centre + rng() % spread);
    }
    std::array<uint64_t, 256> want{};
    for (uint8_t s : v) ++want[s];
    for (size_t i = 0; i < v.size();) {
      const size_t piece = std::min<size_t>(v.size() - i, 1 + rng() % 5000);
      counter.add(v.data() + i, piece);
      i += piece;
    }
    const Histogram got = counter.take();
    EXPECT_EQ(got.total, v.size()) << spread;
    EXPECT_EQ(got.count, want) << spread;
    Histogram whole;
    whole.add(v.data(), v.size());
    EXPECT_EQ(whole.count, want) << spread;
  }
}

TEST(SymbolStream, MultiSegmentRansRoundTrips) {
  for (const size_t n : {kRansSegmentSymbols - 1, kRansSegmentSymbols, kRansSegmentSymbols + 1,
                         3 * kRansSegmentSymbols + 17}) {
    const auto v = exponent_like(n, n);
    StreamStats stats;
    const auto stream = encode(v, 8, 1000, &stats);
    ASSERT_EQ(stats.method, StreamMethod::kRans) << n;
    EXPECT_EQ(decode_all(stream, v.size(), 255, 777), v) << n;
    EXPECT_EQ(decode_all(stream, v.size(), 255, 16), v) << n;
    // Whole: pairs of segments go through the two-stream kernel.
    EXPECT_EQ(decode_all(stream, v.size(), 255, v.size()), v) << n;
  }
  // Any change to the table, the segment lengths or the first segment's states is an error,
  // read in chunks or whole.
  const auto v = exponent_like(3 * kRansSegmentSymbols, 5);
  const auto stream = encode(v, 8, 1000);
  for (size_t at = 0; at < 200; ++at) {
    auto bad = stream;
    bad[at] ^= 0x10;
    EXPECT_THROW(decode_all(bad, v.size(), 255, 4096), FormatError) << "byte " << at;
    EXPECT_THROW(decode_all(bad, v.size(), 255, v.size()), FormatError) << "byte " << at;
  }
}

// The encoder codes two whole segments at once where a chunk holds them and the room allows
// (2 * (2 * 16384 + 64) bytes above the packed limit: streams from about 6 segments of 6-bit
// symbols, 5 of 8-bit ones); the stream is byte for byte the one coded a segment at a time
// (chunks of 1000 symbols never hold two), near the packed limit too, where the pairs stop.
TEST(SymbolStream, SegmentsCodedInPairsAreTheBytesOfSegmentsCodedOneByOne) {
  std::mt19937_64 rng(22);
  for (const double skew : {0.5, 0.93, 0.985}) {
    std::vector<double> weights(64);
    for (unsigned s = 0; s < 64; ++s) weights[s] = std::pow(skew, s);
    std::discrete_distribution<unsigned> pick(weights.begin(), weights.end());
    for (const size_t n : {2 * kRansSegmentSymbols, 4 * kRansSegmentSymbols + 17,
                           9 * kRansSegmentSymbols - 16, 16 * kRansSegmentSymbols + 5}) {
      std::vector<uint8_t> v(n);
      for (auto& s : v) s = static_cast<uint8_t>(pick(rng));
      StreamStats whole_stats, chunked_stats;
      const auto whole = encode(v, 6, n, &whole_stats);
      const auto chunked = encode(v, 6, 1000, &chunked_stats);
      EXPECT_EQ(whole_stats.method, chunked_stats.method) << skew << " " << n;
      EXPECT_EQ(whole, chunked) << skew << " " << n;
      if (skew < 0.95) {
        EXPECT_EQ(whole_stats.method, StreamMethod::kRans) << skew << " " << n;
      }
      EXPECT_EQ(decode_all(whole, n, 63, n), v) << skew << " " << n;
    }
  }
  // Byte symbols beyond the 64-entry tables (exponents): the gathered-table kernels.
  for (const size_t n :
       {2 * kRansSegmentSymbols, 5 * kRansSegmentSymbols + 3, 8 * kRansSegmentSymbols}) {
    const auto v = exponent_like(n, n + 1);
    StreamStats whole_stats;
    const auto whole = encode(v, 8, n, &whole_stats);
    ASSERT_EQ(whole_stats.method, StreamMethod::kRans) << n;
    EXPECT_EQ(whole, encode(v, 8, 1000)) << n;
    EXPECT_EQ(decode_all(whole, n, 255, n), v) << n;
  }
}

// Whether a stream is coded with rANS depends only on its symbols (docs/architecture.md,
// "Deterministic encoding"): rANS exactly when its integer estimate is below the packed size and
// the whole rANS stream fits in the packed size, however the source is cut into chunks. Streams
// near the boundary are the point: small alphabets of mild skew, many lengths.
TEST(SymbolStream, RansOrPackedIsDecidedByTheSymbolsAloneNotByChunking) {
  std::mt19937_64 rng(21);
  int near_boundary = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const size_t n = 50 + rng() % 3000;
    const unsigned alphabet = 2 + static_cast<unsigned>(rng() % 30);
    const double skew = 0.2 + 0.1 * static_cast<double>(rng() % 10);
    std::vector<uint8_t> v(n);
    std::vector<double> weights(alphabet);
    for (unsigned s = 0; s < alphabet; ++s) weights[s] = std::pow(skew, s);
    std::discrete_distribution<unsigned> pick(weights.begin(), weights.end());
    for (auto& s : v) s = static_cast<uint8_t>(pick(rng));
    const unsigned bits = std::max(1u, static_cast<unsigned>(std::bit_width(alphabet - 1)));
    // The reference: rANS written with unlimited room.
    ArraySource whole(v);
    std::vector<uint8_t> scratch;
    const Histogram hist = histogram_of(whole, scratch);
    bool expect_rans = false;
    if (hist.distinct() > 1) {
      const uint64_t packed = kStreamHeaderBytes + (n * std::max(1u, static_cast<unsigned>(std::bit_width(hist.max_symbol()))) + 7) / 8;
      const RansModel model = RansModel::from_histogram(hist);
      std::vector<uint8_t> big(4 * n + 4096);
      std::vector<uint8_t> lengths(4 * rans_segment_count(n));
      RansEncoder encoder(model);
      encoder.begin(big.data() + big.size(), big.data(), n, lengths.data());
      ASSERT_TRUE(encoder.put_reverse(v.data(), n));
      const uint64_t rans_bytes = kStreamHeaderBytes + model.table_bytes() + 4 * (rans_segment_count(n) - 1) +
                                  static_cast<uint64_t>(big.data() + big.size() - encoder.bytes_begin());
      const uint64_t estimate = kStreamHeaderBytes + model.table_bytes() + rans_framing_bytes(n) +
                                (model.cost_q16(hist) + (uint64_t{8} << 16) - 1) / (uint64_t{8} << 16);
      expect_rans = estimate < packed && rans_bytes <= packed;
      near_boundary += rans_bytes + 8 > packed && rans_bytes <= packed + 8;
    }
    for (const size_t chunk : {size_t{1}, size_t{7}, size_t{256}, n}) {
      StreamStats stats;
      const auto stream = encode(v, bits, chunk, &stats);
      if (hist.distinct() > 1) {
        EXPECT_EQ(stats.method == StreamMethod::kRans, expect_rans) << "trial " << trial << " chunk " << chunk;
      }
      EXPECT_EQ(decode_all(stream, n, (1u << bits) - 1, 97), v);
    }
  }
  EXPECT_GT(near_boundary, 5) << "too few streams near the rANS/packed boundary to test it";
}

TEST(SymbolStream, NarrowSymbolsPackBelowEightBits) {
  std::vector<uint8_t> v(1001);
  std::mt19937_64 rng(4);
  for (auto& s : v) s = static_cast<uint8_t>(rng() % 32);  // uniform 5-bit: packing wins
  StreamStats stats;
  const auto stream = encode(v, 5, 100, &stats);
  EXPECT_EQ(stats.method, StreamMethod::kPacked);
  EXPECT_EQ(stream.size(), kStreamHeaderBytes + (1001 * 5 + 7) / 8);
  EXPECT_EQ(decode_all(stream, v.size(), 31, 77), v);
  EXPECT_THROW(decode_all(stream, v.size(), 30, 77), FormatError);  // symbol 31 not allowed
}

TEST(SymbolStream, RejectsMalformedStreams) {
  const auto v = exponent_like(5000, 9);
  const auto good = encode(v, 8, 5000);
  ASSERT_EQ(good[0], static_cast<uint8_t>(StreamMethod::kRans));
  // Every truncation fails.
  for (size_t len = 0; len < good.size(); ++len) {
    std::vector<uint8_t> cut(good.begin(), good.begin() + len);
    EXPECT_THROW(decode_all(cut, v.size(), 255, 5000), FormatError) << "len " << len;
  }
  // Unknown method; wrong symbol count; table that does not sum to 4096.
  auto bad = good;
  bad[0] = 9;
  EXPECT_THROW(decode_all(bad, v.size(), 255, 5000), FormatError);
  EXPECT_THROW(decode_all(good, v.size() + 1, 255, 5000), FormatError);
  EXPECT_THROW(decode_all(good, v.size() - 1, 255, 5000), FormatError);
  bad = good;
  bad[kStreamHeaderBytes + 2] ^= 0x01;  // first frequency
  EXPECT_THROW(decode_all(bad, v.size(), 255, 5000), FormatError);
  // Packed stream with the wrong body length, constant stream with a body.
  std::vector<uint8_t> packed = {0, 8, 3, 0, 0, 0, 0, 0, 0, 0, 1, 2};
  EXPECT_THROW(decode_all(packed, 3, 255, 3), FormatError);
  std::vector<uint8_t> constant = {1, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_THROW(decode_all(constant, 3, 255, 3), FormatError);
  // A huge claimed body length is rejected before anything is read from it.
  std::vector<uint8_t> huge = {0, 8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F};
  EXPECT_THROW(decode_all(huge, 3, 255, 3), FormatError);
}

TEST(SymbolStream, CorruptRansBytesNeverCrashAndUsuallyFail) {
  const auto v = exponent_like(20000, 11);
  const auto good = encode(v, 8, 20000);
  std::mt19937_64 rng(5);
  int detected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    auto bad = good;
    bad[kStreamHeaderBytes + rng() % (bad.size() - kStreamHeaderBytes)] ^= static_cast<uint8_t>(1u << (rng() % 8));
    try {
      if (decode_all(bad, v.size(), 255, 20000) != v) ++detected;
    } catch (const FormatError&) {
      ++detected;
    }
  }
  EXPECT_GT(detected, 250);  // the codec's content checksum catches the rest
}

}  // namespace
}  // namespace ciera::entropy
