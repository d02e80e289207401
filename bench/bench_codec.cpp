// Micro-benchmarks of the codec's pieces (Google Benchmark), for profiling. Reported throughput
// is bytes of the BF16 shard per second; compare with BM_Memcpy of the same bytes.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "ciera/codec.hpp"
#include "common/checksum.hpp"
#include "format/planes.hpp"
#include "trajectory.hpp"

namespace {

constexpr uint64_t kValues = 16ull << 20;

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
  std::vector<std::byte> out(s.a.size());
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
  std::vector<std::byte> out(s.a.size());
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

void BM_EncodeSteady(benchmark::State& state) {
  const auto& s = steps();
  ciera::CodecConfig c;
  c.warmup_steps = 1;
  ciera::ShardEncoder encoder(c, kValues);
  std::vector<std::byte> payload(encoder.max_payload_bytes());
  encoder.encode(s.a, payload);
  bool flip = false;
  uint64_t bytes = 0;
  for (auto _ : state) {
    bytes += encoder.encode(flip ? s.a : s.b, payload).payload_bytes;
    flip = !flip;
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
  state.counters["bits_per_value"] = 8.0 * bytes / state.iterations() / kValues;
}
BENCHMARK(BM_EncodeSteady)->Unit(benchmark::kMillisecond);

void BM_DecodeSteady(benchmark::State& state) {
  const auto& s = steps();
  ciera::CodecConfig c;
  c.warmup_steps = 1;
  ciera::ShardEncoder encoder(c, kValues);
  ciera::ShardDecoder decoder(c, kValues);
  std::vector<std::byte> key(encoder.max_payload_bytes());
  key.resize(encoder.encode(s.a, key).payload_bytes);
  // Frames alternate b, a, b, a ...; each decodes against the state the previous one left.
  std::vector<std::vector<std::byte>> frames;
  for (int i = 0; i < 16; ++i) {
    std::vector<std::byte> p(encoder.max_payload_bytes());
    p.resize(encoder.encode(i % 2 ? s.a : s.b, p).payload_bytes);
    frames.push_back(std::move(p));
  }
  std::vector<std::byte> out(s.a.size());
  size_t i = 0;
  decoder.decode(key, out);
  for (auto _ : state) {
    if (i == frames.size()) {
      state.PauseTiming();
      // Replay the stream: the key frame restores the state frames[0] was encoded against.
      decoder.decode(key, out);
      i = 0;
      state.ResumeTiming();
    }
    decoder.decode(frames[i++], out);
  }
  state.SetBytesProcessed(state.iterations() * s.a.size());
}
BENCHMARK(BM_DecodeSteady)->Unit(benchmark::kMillisecond);

}  // namespace
