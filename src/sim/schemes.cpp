// The codecs of the gather schemes CIERA is compared with beyond ZeRO-3 and ZeRO++: their
// built-in figures, their rows of a `ciera bench codec --json` output, and how either carries
// over to a cluster (docs/simulator.md, "Gather schemes").
#include <algorithm>

#include "sim/json_fields.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

using detail::Fields;
using detail::Json;

// The built-in figures: the one place they live. Each names the command that measured it.
// `ciera simulate --codec-bench FILE` replaces them with the rows of a newer run.
GatherSchemes builtin_schemes() {
  GatherSchemes s;
  // SDP4Bit's qWD (Jia et al., NeurIPS 2024): every weight difference as a 4-bit integer plus one
  // FP32 scale per group of 2048 values, 4 + 32/2048 bits per value whatever the dtype.
  s.sdp4bit.name = "sdp4bit";
  s.sdp4bit.row = "sdp4bit";
  s.sdp4bit.bits_per_value = 4.0 + 32.0 / 2048;
  // Throughputs: the cluster's ZeRO++ quantize/dequantize kernels (src/sim/clusters.json), as for
  // ZeRO++'s int8 weights, on purpose. Our quantiser is scalar reference code on the CPU: 0.10
  // GB/s encode, 0.21 decode against ciera-auto's 4.60 / 4.29 in one run of `ciera bench codec
  // --json` (docs/benchmarks.md, "Every alternative side by side (issue 18)"); scaling that ratio
  // onto a GPU cluster would charge SDP4Bit for our CPU code, not for its fused GPU kernels.
  // `--codec-bench FILE` with an "sdp4bit" row does apply the measured ratio (for --cluster
  // linklab, where it is what runs).
  s.sdp4bit.measured = std::nullopt;
  s.sdp4bit.source = "analytic 4 + 32/2048 bits/value; throughputs: the cluster's ZeRO++ "
                     "(de)quantise kernels";
  // Stateless exponent coding (ZipCCL's idea): `build/release/tools/ciera bench codec` (its
  // defaults: 16M BF16 values, B = 512, Adam trajectory), docs/benchmarks.md, "Wire format 5
  // (issue 15), 2026-11-30", the full run after the A/B: row "stateless" 10.543 bits/value,
  // encode 0.60, decode 1.27 GB/s; row "ciera-auto" encode 6.09, decode 9.55 GB/s.
  s.stateless.name = "stateless";
  s.stateless.row = "stateless";
  s.stateless.dtype = DType::kBF16;
  s.stateless.bits_per_value = 10.543;
  s.stateless.measured = BenchThroughputs{0.60, 1.27, 6.09, 9.55};
  s.stateless.source = "ciera bench codec (BF16, one thread), docs/benchmarks.md, "
                       "\"Wire format 5 (issue 15)\"";
  return s;
}

std::string row_names(const Json& rows) {
  std::string names;
  for (const Json& row : rows) {
    const std::string name = row.is_object() && row.contains("name") && row.at("name").is_string()
                                 ? row.at("name").get<std::string>()
                                 : json_excerpt(row, 40);
    names += (names.empty() ? "" : ", ") + name;
  }
  return names.empty() ? "none" : names;
}

// The row named `name` of "comparisons", read as a Fields whose errors name the file and the row;
// throws ConfigError when there is none.
Fields find_row(const Fields& top, const std::string& name, const std::string& needed_by) {
  const Json& rows = top.array("comparisons");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Json& row = rows[i];
    if (row.is_object() && row.contains("name") && row.at("name") == name) {
      return Fields(row, "comparisons[" + std::to_string(i) + "]",
                    top.origin() + ", row \"" + name + "\"");
    }
  }
  throw ConfigError(top.origin() + ": no row \"" + name + "\" in \"comparisons\" (needed " +
                    needed_by + "; rows: " + row_names(rows) + "). Write the file with `ciera " +
                    (name == "ciera-auto" ? "bench codec --json` at its default --mode auto"
                                          : "bench codec --json`, without --no-compare"));
}

}  // namespace

GatherSchemes default_gather_schemes() {
  static const GatherSchemes schemes = builtin_schemes();
  return schemes;
}

void apply_codec_bench(GatherSchemes& schemes, const std::string& json_text,
                       const std::string& origin, const std::vector<std::string>& names) {
  const Json bench = detail::parse_json(json_text, origin);
  const Fields top(bench, "", origin);
  const Fields config = top.object("config");
  DType dtype = DType::kBF16;
  try {
    dtype = parse_dtype(config.string("dtype"));
  } catch (const ConfigError& e) {
    config.fail("field \"config.dtype\"", std::string("is invalid: ") + e.what());
  }
  for (SchemeFigures* scheme : {&schemes.sdp4bit, &schemes.stateless}) {
    if (std::find(names.begin(), names.end(), scheme->name) == names.end()) continue;
    const std::string needed_by = "by --baseline " + scheme->name;
    // CIERA's throughputs in the same run are the yardstick the scheme's are scaled by.
    const Fields ciera = find_row(top, "ciera-auto", needed_by + " as the yardstick");
    const Fields row = find_row(top, scheme->row, needed_by);
    // A lossless coder that did not decode to its input measured nothing worth projecting.
    if (scheme->name == "stateless" && row.has("verified") && !row.boolean("verified"))
      row.fail("field \"" + row.path_of("verified") + "\"", "is false: the row did not verify");
    scheme->bits_per_value = row.positive("bits_per_value");
    scheme->measured = BenchThroughputs{row.positive("encode_GBps"), row.positive("decode_GBps"),
                                        ciera.positive("encode_GBps"),
                                        ciera.positive("decode_GBps")};
    // SDP4Bit's bits are set by its format; stateless coding's depend on the dtype's exponent.
    if (scheme->name == "stateless") scheme->dtype = dtype;
    scheme->source =
        origin + ", row \"" + scheme->row + "\" (" + std::string(dtype_name(dtype)) + ")";
  }
}

GatherCodec gather_codec(const SchemeFigures& figures, const Cluster& cluster, DType dtype) {
  if (figures.dtype && *figures.dtype != dtype) {
    throw ConfigError("--baseline " + figures.name + ": its bits/value were measured in " +
                      std::string(dtype_name(*figures.dtype)) + " (" + figures.source +
                      "), not " + std::string(dtype_name(dtype)) +
                      "; pass --codec-bench with a `ciera bench codec --dtype " +
                      std::string(dtype_name(dtype)) + " --json` output");
  }
  GatherCodec codec;
  codec.bits_per_value = figures.bits_per_value;
  if (figures.measured) {
    const BenchThroughputs& m = *figures.measured;
    codec.encode_GBps = cluster.encode_GBps * m.encode_GBps / m.ciera_encode_GBps;
    codec.decode_GBps = cluster.decode_GBps * m.decode_GBps / m.ciera_decode_GBps;
  } else {
    codec.encode_GBps = cluster.quantize_GBps;
    codec.decode_GBps = cluster.dequantize_GBps;
  }
  return codec;
}

}  // namespace ciera::sim
