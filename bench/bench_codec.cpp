// Micro-benchmarks of the codec's pieces (Google Benchmark), for profiling. Reported throughput
// is bytes of the BF16 shard per second; compare with BM_Memcpy of the same bytes.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "ciera/codec.hpp"
#include "common/checksum.hpp"
#include "common/huge_pages.hpp"
#include "format/content_checksum.hpp"
#include "format/planes.hpp"
#include "trajectory.hpp"

namespace {

constexpr uint64_t kValues = 16ull << 20;

// Buffers the measured calls write: the library's allocator (cache-line or huge-page aligned, as
// the engine's payload buffers), for memcpy's destination as much as for the codec's.
using Buffer = std::vector<std::byte, ciera::HugePageAllocator<std::byte>>;

// Two consecutive steady-state steps of the trajectory: alternating between them gives every
// frame a realistic set of changes.
struct Steps {
  std::vector<std::byte> a, b;
  Steps() {
    ciera::tools::TrajectoryOptions o;
    o.num_values = kValues;
    ciera::tools::AdamTrajectory t(o);
    for (int i = 0; i < 40; ++i) t.step();
    a.assign(t.values().begin(), t.values().end());
    t.step();
    b.assign(t.values().begin(), t.values().end());
  }
};
const Steps& steps() {
  static const Steps s;
  return s;
}

void BM_Memcpy(benchmark::State& state) {
  const auto& s = steps();
  Buffer out(s.a.size());
  for (auto _ : state) {
    std::memcpy(out.data(), s.a.data(), s.a.size());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);

void BM_Checksum(benchmark::State& state) {
  const auto& s = steps();
  for (auto _ : state) benchmark::DoNotOptimize(ciera::checksum64(s.a.data(), s.a.size()));
  state.SetBytesProcessed(state.iterations() * s.a.size());
}
BENCHMARK(BM_Checksum)->Unit(benchmark::kMillisecond);

void BM_SplitBf16(benchmark::State& state) {
  const auto& s = steps();
  std::vector<uint8_t> exps(kValues), sm(kValues);
  const auto& k = ciera::format::kernels();
  for (auto _ : state) {
    k.split_bf16(reinterpret_cast<const uint8_t*>(s.a.data()), kValues, exps.data(), sm.data());
    benchmark::DoNotOptimize(sm.data());
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
  state.SetLabel(k.target);
}
BENCHMARK(BM_SplitBf16)->Unit(benchmark::kMillisecond);

void BM_MergeBf16(benchmark::State& state) {
  const auto& s = steps();
  std::vector<uint8_t> exps(kValues), sm(kValues);
  Buffer out(s.a.size());
  const auto& k = ciera::format::kernels();
  k.split_bf16(reinterpret_cast<const uint8_t*>(s.a.data()), kValues, exps.data(), sm.data());
  for (auto _ : state) {
    k.merge_bf16(exps.data(), sm.data(), kValues, reinterpret_cast<uint8_t*>(out.data()));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
  state.SetLabel(k.target);
}
BENCHMARK(BM_MergeBf16)->Unit(benchmark::kMillisecond);

// state.range(0): content checksum on/off; state.range(1): frames alternate between two steps
// (realistic changes) or repeat one (no changes: the cost of the planes and checksum alone).
void BM_EncodeSteady(benchmark::State& state) {
  const auto& s = steps();
  ciera::CodecConfig c;
  c.warmup_steps = 1;
  c.content_checksum = state.range(0) != 0;
  const bool changing = state.range(1) != 0;
  ciera::ShardEncoder encoder(c, kValues);
  Buffer payload(encoder.max_payload_bytes());
  encoder.encode(s.a, payload);
  bool flip = false;
  uint64_t bytes = 0, changes = 0, symbols = 0;
  for (auto _ : state) {
    const ciera::FrameStats f = encoder.encode(flip || !changing ? s.a : s.b, payload);
    bytes += f.payload_bytes;
    changes += f.changed_values;
    symbols += f.coded_symbols;
    flip = !flip;
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
  state.counters["bits_per_value"] = 8.0 * bytes / state.iterations() / kValues;
  state.counters["changes"] = static_cast<double>(changes) / state.iterations();
  state.counters["coded_symbols"] = static_cast<double>(symbols) / state.iterations();
}
BENCHMARK(BM_EncodeSteady)->ArgsProduct({{1, 0}, {1, 0}})->ArgNames({"checksum", "changing"})->Unit(benchmark::kMillisecond);

void BM_DecodeSteady(benchmark::State& state) {
  const auto& s = steps();
  ciera::CodecConfig c;
  c.warmup_steps = 1;
  c.content_checksum = state.range(0) != 0;
  const bool changing = state.range(1) != 0;
  ciera::ShardEncoder encoder(c, kValues);
  ciera::ShardDecoder decoder(c, kValues);
  Buffer key(encoder.max_payload_bytes());
  key.resize(encoder.encode(s.a, key).payload_bytes);
  // Frames alternate b, a, b, a ...; each decodes against the state the previous one left.
  std::vector<Buffer> frames;
  for (int i = 0; i < 48; ++i) {
    Buffer p(encoder.max_payload_bytes());
    p.resize(encoder.encode(i % 2 || !changing ? s.a : s.b, p).payload_bytes);
    frames.push_back(std::move(p));
  }
  Buffer out(s.a.size());
  size_t i = 0;
  decoder.decode(key, out);
  for (auto _ : state) {
    if (i == frames.size()) {
      state.PauseTiming();
      // Replay the stream to a fresh receiver (a decoder refuses a frame it has decoded already,
      // docs/format.md "Streams"): the key frame gives it the state frames[0] was encoded against.
      decoder = ciera::ShardDecoder(c, kValues);
      decoder.decode(key, out);
      i = 0;
      state.ResumeTiming();
    }
    decoder.decode(frames[i++], out);
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
}
BENCHMARK(BM_DecodeSteady)->ArgsProduct({{1, 0}, {1, 0}})->ArgNames({"checksum", "changing"})->Unit(benchmark::kMillisecond);

}  // namespace

namespace {
// Merge then checksum each 16 KB chunk while it is in L1: what the decoder's pass costs.
void BM_MergeThenChecksumPerChunk(benchmark::State& state) {
  const auto& s = steps();
  std::vector<uint8_t> exps(kValues), sm(kValues);
  Buffer out(s.a.size());
  const auto& k = ciera::format::kernels();
  k.split_bf16(reinterpret_cast<const uint8_t*>(s.a.data()), kValues, exps.data(), sm.data());
  const size_t chunk = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    ciera::format::ContentChecksum sum(k);
    for (size_t first = 0; first < kValues; first += chunk) {
      uint8_t* o = reinterpret_cast<uint8_t*>(out.data()) + 2 * first;
      k.merge_bf16(exps.data() + first, sm.data() + first, chunk, o);
      sum.update(o, 2 * chunk);
    }
    benchmark::DoNotOptimize(sum.digest());
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
}
BENCHMARK(BM_MergeThenChecksumPerChunk)->Arg(1024)->Arg(8192)->Arg(65536)->Unit(benchmark::kMillisecond);
}  // namespace

#include "entropy/symbol_stream.hpp"
namespace {
// Entropy coding of a whole exponent plane (key frames, block mode), symbols per second.
void BM_RansExponentPlane(benchmark::State& state) {
  const auto& s = steps();
  std::vector<uint8_t> exps(kValues), sm(kValues);
  ciera::format::kernels().split_bf16(reinterpret_cast<const uint8_t*>(s.a.data()), kValues, exps.data(), sm.data());
  std::vector<uint8_t> scratch;
  const ciera::entropy::ArraySource source(exps);
  const auto hist = ciera::entropy::histogram_of(source, scratch);
  std::vector<uint8_t> stream(ciera::entropy::symbol_stream_bound(kValues, 8));
  const auto written = ciera::entropy::write_symbol_stream(source, hist, 8, stream.data(), stream.size(), scratch);
  std::vector<uint8_t> back(kValues);
  const bool decode = state.range(0) != 0;
  for (auto _ : state) {
    if (decode) {
      ciera::ByteReader in(stream.data(), written.bytes, "bench");
      ciera::entropy::SymbolStreamReader reader;
      reader.open(in, kValues, 255, "bench");
      reader.get(back.data(), kValues);
      reader.finish();
    } else {
      benchmark::DoNotOptimize(ciera::entropy::write_symbol_stream(source, hist, 8, stream.data(), stream.size(), scratch));
    }
  }
  state.SetItemsProcessed(state.iterations() * kValues);
}
BENCHMARK(BM_RansExponentPlane)->Arg(0)->Arg(1)->ArgName("decode")->Unit(benchmark::kMillisecond);
}  // namespace

namespace {
// A fine frame's change symbols: ~200K symbols over a few dozen values, read in 4 KB batches as
// the decoder does. Symbols per second.
void BM_RansChangeSymbols(benchmark::State& state) {
  constexpr size_t kSymbols = 200000;
  std::vector<uint8_t> symbols(kSymbols);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& s : symbols) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    s = static_cast<uint8_t>(std::min<int>(38, __builtin_ctzll(x | (1ull << 38)) * 3 + (x >> 60) % 3));
  }
  std::vector<uint8_t> scratch;
  const ciera::entropy::ArraySource source(symbols);
  const auto hist = ciera::entropy::histogram_of(source, scratch);
  std::vector<uint8_t> stream(ciera::entropy::symbol_stream_bound(kSymbols, 6));
  const auto written = ciera::entropy::write_symbol_stream(source, hist, 6, stream.data(), stream.size(), scratch);
  std::vector<uint8_t> back(4096);
  for (auto _ : state) {
    ciera::ByteReader in(stream.data(), written.bytes, "bench");
    ciera::entropy::SymbolStreamReader reader;
    reader.open(in, kSymbols, 63, "bench");
    for (size_t done = 0; done < kSymbols; done += 4096) reader.get(back.data(), std::min<size_t>(4096, kSymbols - done));
    reader.finish();
    benchmark::DoNotOptimize(back.data());
  }
  state.SetItemsProcessed(state.iterations() * kSymbols);
  state.counters["bits_per_symbol"] = 8.0 * written.bytes / kSymbols;
}
BENCHMARK(BM_RansChangeSymbols)->Unit(benchmark::kMicrosecond);
}  // namespace

#include "collectives/kernels.hpp"
#include "collectives/reduction.hpp"
#include "common/simd_targets.hpp"
namespace {
// The reduce-scatter's rank-order reduction (collectives/kernels.hpp) of four parts of 2^20
// values, as one round of a W = 4 reduce-scatter adds them, for every SIMD target this CPU runs
// (argument: the index in common::available_simd_targets(), fastest first). Bytes per second
// count the parts read.
void BM_ReduceRankOrder(benchmark::State& state) {
  constexpr uint64_t kPartValues = 1u << 20;
  const auto targets = ciera::common::available_simd_targets();
  if (static_cast<size_t>(state.range(1)) >= targets.size()) {
    state.SkipWithError("no such SIMD target on this CPU");
    return;
  }
  const auto& kernels = ciera::collectives::reduction_kernels_for(targets[state.range(1)]);
  const auto dtype = state.range(0) == 0 ? ciera::DType::kBF16 : ciera::DType::kFP32;
  const uint64_t bytes = kPartValues * ciera::dtype_info(dtype).value_bytes;
  const auto& s = steps();  // BF16 weights; as FP32 values, pairs of them (finite, varied)
  std::vector<std::vector<std::byte>> parts(4);
  for (size_t p = 0; p < parts.size(); ++p) {
    parts[p].assign(s.a.begin() + static_cast<std::ptrdiff_t>(p * bytes),
                    s.a.begin() + static_cast<std::ptrdiff_t>((p + 1) * bytes));
  }
  const std::byte* pointers[4] = {parts[0].data(), parts[1].data(), parts[2].data(),
                                  parts[3].data()};
  Buffer out(bytes);
  for (auto _ : state) {
    ciera::collectives::reduce_in_rank_order(kernels, dtype, ciera::ReduceOp::kAvg, pointers,
                                             out.data(), kPartValues);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * 4 * bytes);
  state.SetLabel(std::string(kernels.target) + (dtype == ciera::DType::kBF16 ? " bf16" : " fp32"));
}
BENCHMARK(BM_ReduceRankOrder)
    ->ArgsProduct({{0, 1}, {0, 1, 2, 3}})
    ->ArgNames({"fp32", "target"})
    ->Unit(benchmark::kMillisecond);
}  // namespace

namespace {
// One stateless frame (a key frame of its own, as the lossless collectives code every slice) of
// a 2^20-value slice, BF16 or FP32 (args: fp32, decode). Bytes per second of the slice.
void BM_StatelessFrame(benchmark::State& state) {
  constexpr uint64_t kSliceValues = 1u << 20;
  const auto dtype = state.range(0) == 0 ? ciera::DType::kBF16 : ciera::DType::kFP32;
  const bool decode = state.range(1) != 0;
  const uint64_t bytes = kSliceValues * ciera::dtype_info(dtype).value_bytes;
  const auto& s = steps();  // BF16 weights; as FP32 values, pairs of them (finite, varied)
  const std::span<const std::byte> slice(s.a.data(), bytes);
  ciera::CodecConfig c;
  c.dtype = dtype;
  Buffer payload(ciera::max_payload_bytes(dtype, kSliceValues, c.block_values));
  const ciera::FrameStats f = ciera::encode_stateless_frame(c, slice, payload);
  Buffer out(bytes);
  for (auto _ : state) {
    if (decode) {
      ciera::decode_stateless(c, {payload.data(), f.payload_bytes}, out);
      benchmark::DoNotOptimize(out.data());
    } else {
      benchmark::DoNotOptimize(ciera::encode_stateless_frame(c, slice, payload));
    }
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bits_per_value"] = 8.0 * f.payload_bytes / kSliceValues;
}
BENCHMARK(BM_StatelessFrame)
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->ArgNames({"fp32", "decode"})
    ->Unit(benchmark::kMillisecond);
}  // namespace

#include <cmath>
#include <random>

#include "collectives/slice_coding.hpp"
#include "common/floats.hpp"
namespace {
// A 2^20-value BF16 slice as a reduce-scatter's slice runs over a gradient buffer: four
// parameters' gradients back to back, each N(0, scale) with its own scale (1e-2, 1e-4, 1e-6,
// 1e-3), so that the slice's exponents spread over four clusters and each quarter's over one.
const std::vector<std::byte>& gradient_slice() {
  static const std::vector<std::byte> slice = [] {
    constexpr uint64_t kSliceValues = 1u << 20;
    std::vector<std::byte> out(kSliceValues * 2);
    std::mt19937_64 rng(7);
    const double scales[] = {1e-2, 1e-4, 1e-6, 1e-3};
    for (uint64_t i = 0; i < kSliceValues; ++i) {
      std::normal_distribution<float> normal(0.0f,
                                             static_cast<float>(scales[i * 4 / kSliceValues]));
      const uint16_t bits = ciera::float_to_bf16(normal(rng));
      std::memcpy(out.data() + 2 * i, &bits, 2);
    }
    return out;
  }();
  return slice;
}

// A 2^20-value BF16 slice coded as the lossless collectives code it: frames of `frame_values`
// values back to back (2^20: one frame, as BM_StatelessFrame; 2^17: the default), of the bench
// trajectory's weights (gradients:0) or of gradient_slice() (gradients:1); args frame_values,
// gradients, decode. Bytes per second of the slice.
void BM_CodedSlice(benchmark::State& state) {
  constexpr uint64_t kSliceValues = 1u << 20;
  const auto frame_values = static_cast<uint64_t>(state.range(0));
  const bool decode = state.range(2) != 0;
  ciera::CodecConfig c;
  c.dtype = ciera::DType::kBF16;
  const uint64_t bytes = kSliceValues * 2;
  const std::span<const std::byte> slice(
      state.range(1) != 0 ? gradient_slice().data() : steps().a.data(), bytes);
  Buffer payload(ciera::collectives::coded_slice_bound(c, kSliceValues, frame_values));
  const ciera::FrameStats f = ciera::collectives::encode_slice(c, frame_values, slice, payload);
  Buffer out(bytes);
  for (auto _ : state) {
    if (decode) {
      ciera::collectives::decode_slice(c, {payload.data(), f.payload_bytes}, out);
      benchmark::DoNotOptimize(out.data());
    } else {
      benchmark::DoNotOptimize(ciera::collectives::encode_slice(c, frame_values, slice, payload));
    }
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["bits_per_value"] = 8.0 * f.payload_bytes / kSliceValues;
}
BENCHMARK(BM_CodedSlice)
    ->ArgsProduct({{1 << 20, 1 << 18, 1 << 17}, {0, 1}, {0, 1}})
    ->ArgNames({"frame_values", "gradients", "decode"})
    ->Unit(benchmark::kMillisecond);
}  // namespace
