#include "bench_codec_cuda.hpp"

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "ciera/cuda.hpp"
#include "device_codec_bench.hpp"
#include "exit_status.hpp"
#include "report.hpp"

namespace ciera::tools {

int run_bench_codec_cuda(const DeviceBenchOptions& o) {
  std::string why;
  require(cuda::device_available(&why), why);  // a machine without the GPU: refused, status 2
  bench::DeviceCodecRequest request;
  request.config = o.config;
  request.values = o.values;
  request.steps = o.steps;
  request.learning_rate = o.learning_rate;
  request.seed = o.seed;
  request.nvcomp_every = o.sample_every;
  if (!o.quiet) {
    request.progress = [](uint32_t step, uint32_t steps) {
      std::fprintf(stderr, "\rstep %u/%u", step + 1, steps);
      if (step + 1 == steps) std::fputc('\n', stderr);
    };
  }
  const bench::DeviceCodecResult r = bench::measure_device_codec(request);
  const double bytes = static_cast<double>(r.shard_bytes);
  const double memcpy_s = bench::median(r.memcpy_s);
  nlohmann::json coders = nlohmann::json::array();
  std::vector<const bench::DeviceCoder*> rows{&r.ciera};
  for (const auto& peer : r.peers) rows.push_back(&peer);
  for (const bench::DeviceCoder* c : rows) {
    const double enc = bench::median(c->encode_s), dec = bench::median(c->decode_s);
    coders.push_back({{"name", c->name},
                      {"bits_per_value", c->bits_per_value(r.values)},
                      {"encode_gb_per_s", enc > 0 ? bytes / enc / 1e9 : 0},
                      {"decode_gb_per_s", dec > 0 ? bytes / dec / 1e9 : 0},
                      {"encode_vs_memcpy_d2d", enc > 0 ? memcpy_s / enc : 0},
                      {"decode_vs_memcpy_d2d", dec > 0 ? memcpy_s / dec : 0}});
  }
  const nlohmann::json j = {{"command", "ciera bench codec --device cuda"},
                            {"gpu", r.gpu},
                            {"values", r.values},
                            {"dtype", std::string(dtype_name(o.config.dtype))},
                            {"block_values", o.config.block_values},
                            {"steady_steps", r.ciera.frames},
                            {"memcpy_d2d_gb_per_s", memcpy_s > 0 ? bytes / memcpy_s / 1e9 : 0},
                            {"key_frame_bits_per_value", r.key_frames.bits_per_value(r.values)},
                            {"nvcomp_built", r.nvcomp_built},
                            {"coders", coders},
                            {"verified", r.verified},
                            {"failure", r.failure}};
  if (o.json) {
    std::cout << json_text(j, 2) << std::endl;
  } else {
    std::cout << r.gpu << ": " << r.values << " " << dtype_name(o.config.dtype) << " values, B = "
              << o.config.block_values << ", " << r.ciera.frames << " steady steps\n";
    std::printf("%-42s %10s %12s %12s %8s %8s\n", "codec", "bits/value", "encode GB/s", "decode GB/s",
                "enc/cpy", "dec/cpy");
    for (const auto& c : coders) {
      std::printf("%-42s %10.3f %12.1f %12.1f %8.2f %8.2f\n", c["name"].get<std::string>().c_str(),
                  c["bits_per_value"].get<double>(), c["encode_gb_per_s"].get<double>(),
                  c["decode_gb_per_s"].get<double>(), c["encode_vs_memcpy_d2d"].get<double>(),
                  c["decode_vs_memcpy_d2d"].get<double>());
    }
    std::printf("cudaMemcpy D2D of the same bytes: %.1f GB/s%s\n", j["memcpy_d2d_gb_per_s"].get<double>(),
                r.nvcomp_built ? "" : "; nvCOMP not built in (configure with CIERA_NVCOMP_DIR)");
    std::cout << "every payload equal to the CPU encoder's and every shard back bit for bit: ";
    if (r.verified) {
      std::cout << "yes\n";
    } else {
      std::cout << "NO: " << r.failure << "\n";
    }
  }
  return r.verified ? kExitDone : kExitNotExact;
}

}  // namespace ciera::tools
