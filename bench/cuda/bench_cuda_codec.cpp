// The GPU codec's benchmark (scripts/device-check.sh codec; docs/benchmarks.md), without the
// command-line tool's dependencies: for BF16 shards of 16M and 256M values, the device codec on
// the benchmark trajectory (device_codec_bench.hpp: every step checked against the CPU codec;
// nvCOMP's ANS beside it when built in) and each kernel on its own, each against cudaMemcpy
// device-to-device of the same bytes in the same run. Throughput = shard bytes / time (median,
// CUDA events on one stream).
//
//   ciera_cuda_bench [--values N[,N...]] [--reps R] [--json FILE]
//
// --reps is the number of steady-state steps of the codec run and of timed repetitions of each
// kernel (after 3 warmup key frames / one warm-up run). --json FILE is rewritten after each size
// (always a whole JSON document; "complete" says whether every size is in), so a run cut short
// keeps the sizes it finished, and a result that was not exact keeps its timings ("verified":
// false, "failure" saying what differed).
//
// Exit status (tools/exit_status.hpp): 0 every result verified; 1 the run failed (a CUDA or I/O
// error); 2 a command line or machine no run can use (a bad option, no usable GPU); 3 a result
// that was not exact (the JSON is written all the same).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/cuda.hpp"
#include "device_codec_bench.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "entropy/rans.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/planes.hpp"
// Header-only (ciera/error.hpp alone): the exit statuses every `ciera` command uses.
#include "../../tools/exit_status.hpp"
#include "../../tools/json_string.hpp"

namespace {

using ciera::tools::json_string;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

using ciera::bench::DeviceBuffer;

// BF16 weights of one step and the next: N(0, 0.02) moved by about 1e-3 of their size, as an
// optimiser step does after warm-up (few exponents change).
void trajectory(uint64_t n, std::vector<uint16_t>& a, std::vector<uint16_t>& b) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> weight(0.0f, 0.02f), step(0.0f, 1e-3f);
  a.resize(n);
  b.resize(n);
  auto bf16 = [](float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
  };
  for (uint64_t i = 0; i < n; ++i) {
    const float w = weight(rng);
    a[i] = bf16(w);
    b[i] = bf16(w * (1.0f + step(rng)));
  }
}

// Median seconds of `reps` runs of `op` on `stream`, after one warm-up run.
double time_op(const std::function<void()>& op, cudaStream_t stream, int reps) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  op();
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> seconds;
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(start, stream), "record");
    op();
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

struct Row {
  std::string op;
  double seconds = 0;
  double ratio = 0;  // compressed / original, where it applies
};

std::string json_rows(const std::vector<Row>& rows, uint64_t bytes, double memcpy_seconds) {
  std::string s = "[";
  for (size_t i = 0; i < rows.size(); ++i) {
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s\n      {\"op\": \"%s\", \"seconds\": %.9f, \"gb_per_s\": %.3f, "
                  "\"vs_memcpy_d2d\": %.4f%s}",
                  i ? "," : "", rows[i].op.c_str(), rows[i].seconds, bytes / rows[i].seconds / 1e9,
                  memcpy_seconds / rows[i].seconds,
                  rows[i].ratio > 0 ? (", \"ratio\": " + std::to_string(rows[i].ratio)).c_str() : "");
    s += line;
  }
  return s + "\n    ]";
}

// One size's report: its JSON object, and whether every result was exact (else `failure`).
struct SizeReport {
  std::string json;
  bool verified = true;
  std::string failure;
  void fail(const std::string& what) {
    verified = false;
    failure += (failure.empty() ? "" : "; ") + what;
  }
};

SizeReport bench_size(uint64_t n, int reps) {
  SizeReport report;
  std::vector<uint16_t> a, b;
  trajectory(n, a, b);
  const uint64_t bytes = 2 * n;
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  DeviceBuffer d_a(bytes), d_b(bytes), d_copy(bytes), d_out(bytes), d_exps(n), d_exps_b(n), d_sm(n);
  check(cudaMemcpy(d_a.p, a.data(), bytes, cudaMemcpyHostToDevice), "H2D");
  check(cudaMemcpy(d_b.p, b.data(), bytes, cudaMemcpyHostToDevice), "H2D");
  constexpr uint32_t kBlock = 512;
  const uint64_t blocks = (n + kBlock - 1) / kBlock;
  DeviceBuffer d_bitmap((blocks + 7) / 8);
  const uint64_t chunks = ciera::cuda::checksum_chunks(bytes);
  DeviceBuffer d_digests(8 * (chunks + 1)), d_scratch(8 * chunks + 1), d_sum(8);

  std::vector<Row> rows;
  const double memcpy_s = time_op([&] {
    check(cudaMemcpyAsync(d_copy.p, d_a.p, bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
  }, stream, reps);
  rows.push_back({"cudaMemcpy D2D", memcpy_s, 0});
  rows.push_back({"split", time_op([&] {
    ciera::cuda::split(ciera::DType::kBF16, d_a.p, n, d_exps.as<uint8_t>(), d_sm.as<uint8_t>(), stream);
  }, stream, reps), 0});
  ciera::cuda::split(ciera::DType::kBF16, d_b.p, n, d_exps_b.as<uint8_t>(), d_out.as<uint8_t>(), stream);
  rows.push_back({"merge", time_op([&] {
    ciera::cuda::merge(ciera::DType::kBF16, d_exps.as<uint8_t>(), d_sm.as<uint8_t>(), n, d_out.p, stream);
  }, stream, reps), 0});
  rows.push_back({"changed_blocks (B=512)", time_op([&] {
    ciera::cuda::changed_blocks(d_exps_b.as<uint8_t>(), d_exps.as<uint8_t>(), n, kBlock,
                                d_bitmap.as<uint8_t>(), stream);
  }, stream, reps), 0});
  rows.push_back({"content_checksum", time_op([&] {
    ciera::cuda::content_checksum(d_a.p, bytes, d_digests.as<uint64_t>(), d_scratch.as<uint8_t>(),
                                  d_sum.as<uint64_t>(), stream);
  }, stream, reps), 0});
  uint64_t sum = 0;
  check(cudaMemcpy(&sum, d_sum.p, 8, cudaMemcpyDeviceToHost), "D2H");
  if (sum != ciera::content_checksum64(a.data(), bytes))
    report.fail("GPU checksum differs from the CPU's");

  // A key frame's exponent stream, coded by the CPU codec, decoded on the GPU.
  std::vector<uint8_t> exps(n), sm(n);
  ciera::format::kernels().split_bf16(reinterpret_cast<const uint8_t*>(a.data()), n, exps.data(), sm.data());
  ciera::entropy::ArraySource source(exps);
  std::vector<uint8_t> scratch;
  const auto hist = ciera::entropy::histogram_of(source, scratch);
  std::vector<uint8_t> stream_bytes(ciera::entropy::symbol_stream_bound(n, 8));
  const auto stats = ciera::entropy::write_symbol_stream(source, hist, 8, stream_bytes.data(),
                                                        stream_bytes.size(), scratch);
  if (stats.method == ciera::entropy::StreamMethod::kRans) {
    ciera::ByteReader in(stream_bytes.data(), stats.bytes, "bench");
    in.u8();
    in.u8();
    const uint64_t body = in.u64();
    ciera::ByteReader br(in.cursor(), body, "bench");
    const auto model = ciera::entropy::RansModel::read_table(br, 255, "bench");
    const uint64_t count = ciera::entropy::rans_segment_count(n);
    const uint8_t* lengths = br.cursor();
    const uint8_t* first = lengths + 4 * (count - 1);
    std::vector<uint64_t> offsets{0};
    for (uint64_t j = 0; j + 1 < count; ++j) offsets.push_back(offsets.back() + ciera::load_le32(lengths + 4 * j));
    offsets.push_back(static_cast<uint64_t>(stream_bytes.data() + stats.bytes - first));
    std::vector<uint32_t> slots(ciera::entropy::kRansTotal);
    for (unsigned s = 0; s < 256; ++s) {
      for (uint32_t slot = model.start[s]; slot < model.start[s] + model.freq[s]; ++slot) {
        slots[slot] = ciera::entropy::rans_slot_entry(s, model.freq[s], model.start[s]);
      }
    }
    DeviceBuffer d_slots(4 * slots.size()), d_offsets(8 * offsets.size()), d_segments(offsets.back()),
        d_decoded(n), d_failed(4);
    check(cudaMemcpy(d_slots.p, slots.data(), d_slots.size, cudaMemcpyHostToDevice), "H2D");
    check(cudaMemcpy(d_offsets.p, offsets.data(), d_offsets.size, cudaMemcpyHostToDevice), "H2D");
    check(cudaMemcpy(d_segments.p, first, offsets.back(), cudaMemcpyHostToDevice), "H2D");
    check(cudaMemset(d_failed.p, 0, 4), "memset");
    Row row{"rans_decode (key-frame exponents)", 0,
            static_cast<double>(stats.bytes) / static_cast<double>(n)};
    row.seconds = time_op([&] {
      ciera::cuda::rans_decode(d_slots.as<uint32_t>(), d_segments.as<uint8_t>(), d_offsets.as<uint64_t>(),
                               n, d_decoded.as<uint8_t>(), d_failed.as<uint32_t>(), stream);
    }, stream, reps);
    std::vector<uint8_t> decoded(n);
    check(cudaMemcpy(decoded.data(), d_decoded.p, n, cudaMemcpyDeviceToHost), "D2H");
    if (decoded != exps) report.fail("GPU rANS decode differs from the CPU's symbols");
    rows.push_back(row);
  }
  cudaStreamDestroy(stream);

  // The device codec on the benchmark trajectory, checked against the CPU codec every step.
  ciera::bench::DeviceCodecRequest request;
  request.config.warmup_steps = 3;
  request.values = n;
  request.steps = 3 + static_cast<uint32_t>(reps);
  const auto codec = ciera::bench::measure_device_codec(request);
  const double memcpy_median = ciera::bench::median(codec.memcpy_s);
  std::string coders = "[";
  auto coder_json = [&](const ciera::bench::DeviceCoder& c) {
    char line[512];
    const double enc = ciera::bench::median(c.encode_s), dec = ciera::bench::median(c.decode_s);
    std::snprintf(line, sizeof line,
                  "{\"name\": \"%s\", \"bits_per_value\": %.4f, \"encode_gb_per_s\": %.3f, "
                  "\"decode_gb_per_s\": %.3f, \"encode_vs_memcpy_d2d\": %.4f, \"decode_vs_memcpy_d2d\": %.4f}",
                  c.name.c_str(), c.bits_per_value(n), bytes / enc / 1e9, bytes / dec / 1e9,
                  memcpy_median / enc, memcpy_median / dec);
    return std::string(line);
  };
  coders += coder_json(codec.ciera);
  for (const auto& peer : codec.peers) coders += ", " + coder_json(peer);
  coders += "]";
  char head[256];
  std::snprintf(head, sizeof head,
                "\"codec\": {\"steady_steps\": %zu, \"memcpy_d2d_gb_per_s\": %.3f, \"key_frame_bits_per_value\": %.4f, "
                "\"verified\": %s, \"nvcomp_built\": %s, ",
                codec.ciera.frames ? static_cast<size_t>(codec.ciera.frames) : size_t{0}, bytes / memcpy_median / 1e9,
                codec.key_frames.bits_per_value(n), codec.verified ? "true" : "false",
                codec.nvcomp_built ? "true" : "false");
  const std::string codec_json = std::string(head) + "\"failure\": " + json_string(codec.failure) +
                                 ", \"coders\": " + coders + "}";
  if (!codec.verified) report.fail("device codec not verified: " + codec.failure);
  report.json = "{\n    \"values\": " + std::to_string(n) +
                ", \"dtype\": \"bf16\", \"shard_bytes\": " + std::to_string(bytes) +
                ", \"verified\": " + (report.verified ? "true" : "false") +
                ", \"failure\": " + json_string(report.failure) + ",\n    " + codec_json +
                ",\n    \"kernels\": " + json_rows(rows, bytes, memcpy_s) + "\n  }";
  return report;
}

// The whole report so far: every size done, whether all were exact, and whether all are in.
std::string report_json(const std::string& gpu, int reps, const std::vector<std::string>& sizes,
                        bool verified, bool complete) {
  std::string json = "{\n  \"gpu\": " + json_string(gpu) +
                     ",\n  \"reps\": " + std::to_string(reps) +
                     ",\n  \"verified\": " + (verified ? "true" : "false") +
                     ",\n  \"complete\": " + (complete ? "true" : "false") + ",\n  \"sizes\": [";
  for (size_t i = 0; i < sizes.size(); ++i) json += (i ? ", " : "") + sizes[i];
  return json + "]\n}\n";
}

// Rewrites `path` whole (a temporary file renamed over it: a reader never sees half a report).
void write_report(const std::string& path, const std::string& json) {
  const std::string part = path + ".part";
  FILE* f = std::fopen(part.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + part);
  const bool written = std::fputs(json.c_str(), f) >= 0;
  if (std::fclose(f) != 0 || !written || std::rename(part.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot write " + path);
  }
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> sizes{uint64_t{1} << 24, uint64_t{1} << 28};
  int reps = 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--values" && i + 1 < argc) {
      sizes.clear();
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        sizes.push_back(std::stoull(list.substr(at, comma - at)));
        at = comma + 1;
      }
    } else if (arg == "--reps" && i + 1 < argc) {
      reps = std::stoi(argv[++i]);
    } else if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: ciera_cuda_bench [--values N[,N...]] [--reps R] [--json FILE]\n");
      return ciera::tools::kExitUsage;
    }
  }
  std::string why;
  if (!ciera::cuda::device_available(&why)) {  // this machine cannot run it: exit_status.hpp's 2
    std::fprintf(stderr, "ciera_cuda_bench: %s\n", why.c_str());
    return ciera::tools::kExitUsage;
  }
  bool verified = true;
  try {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "properties");
    const std::string gpu = prop.name;
    std::vector<std::string> done;
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::fprintf(stderr, "ciera_cuda_bench: %llu values...\n", static_cast<unsigned long long>(sizes[i]));
      const SizeReport report = bench_size(sizes[i], reps);
      done.push_back(report.json);
      if (!report.verified) {
        verified = false;
        std::fprintf(stderr, "ciera_cuda_bench: %llu values: NOT EXACT: %s\n",
                     static_cast<unsigned long long>(sizes[i]), report.failure.c_str());
      }
      if (!json_path.empty())
        write_report(json_path, report_json(gpu, reps, done, verified, i + 1 == sizes.size()));
    }
    std::fputs(report_json(gpu, reps, done, verified, true).c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ciera_cuda_bench: %s\n", e.what());
    return ciera::tools::kExitFailed;
  }
  return verified ? ciera::tools::kExitDone : ciera::tools::kExitNotExact;
}
