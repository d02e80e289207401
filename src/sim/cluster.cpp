// Cluster presets: the built-in src/sim/clusters.json or a user's file of the same format.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sim/json_fields.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

using detail::Fields;
using detail::Json;

Json checked_config(const std::string& config_json, const std::string& origin) {
  Json config = detail::parse_json(config_json, origin);
  Fields top(config, "", origin);
  if (top.string("format") != "ciera-clusters") {
    top.fail("field \"format\"", "must be \"ciera-clusters\"");
  }
  if (top.count("version") != 1)
    top.fail("field \"version\"", "must be 1 (the only version this tool reads)");
  top.object("clusters");
  top.object("gpus");
  return config;
}

Link read_link(const Fields& link) {
  return {link.positive("GBps"), link.non_negative("latency_us") * 1e-6};
}

}  // namespace

std::string read_text_file(const std::string& path, const std::string& what) {
  // A folder opens as a stream on Linux and reads as empty: "not valid JSON" would name no cause.
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    throw ConfigError(what + " " + path + ": a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read " + what + " " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> cluster_names(const std::string& config_json) {
  const Json config = checked_config(config_json, "cluster config");
  std::vector<std::string> names;
  for (const auto& [name, value] : config.at("clusters").items()) names.push_back(name);
  return names;
}

Cluster load_cluster(const std::string& config_json, const std::string& name,
                     const std::string& origin) {
  const Json config = checked_config(config_json, origin);
  const Fields clusters(config.at("clusters"), "clusters", origin);
  if (!clusters.has(name.c_str())) {
    std::string known;
    for (const auto& [key, value] : config.at("clusters").items())
      known += (known.empty() ? "" : ", ") + key;
    throw ConfigError("unknown cluster preset \"" + name + "\" in " + origin + " (known: " + known +
                      ")");
  }
  const Fields spec = clusters.object(name.c_str());
  Cluster cluster;
  cluster.name = name;
  cluster.description = spec.has("description") ? spec.string("description") : "";
  cluster.gpu = spec.string("gpu");
  const Fields gpus(config.at("gpus"), "gpus", origin);
  if (!gpus.has(cluster.gpu.c_str())) {
    spec.fail("field \"" + spec.path_of("gpu") + "\"",
              "names GPU \"" + cluster.gpu + "\", which \"gpus\" lacks");
  }
  const Fields gpu = gpus.object(cluster.gpu.c_str());
  cluster.peak_tflops = gpu.positive("peak_tflops");
  cluster.hbm_GBps = gpu.positive("hbm_GBps");

  const uint64_t per_node = spec.count("gpus_per_node");
  if (per_node < 1 || per_node > 1024)
    spec.fail("field \"" + spec.path_of("gpus_per_node") + "\"", "must be 1..1024");
  cluster.gpus_per_node = static_cast<int>(per_node);
  if (cluster.gpus_per_node > 1) cluster.intra = read_link(spec.object("intra"));
  cluster.inter = read_link(spec.object("inter"));
  cluster.mfu = spec.has("mfu") ? spec.fraction("mfu") : 0.4;
  if (cluster.mfu <= 0) spec.fail("field \"" + spec.path_of("mfu") + "\"", "must be > 0");

  const Fields kernels = spec.object("kernels");
  cluster.detect_GBps = kernels.non_negative("detect_GBps");  // 0: part of encode
  cluster.encode_GBps = kernels.positive("encode_GBps");
  cluster.decode_GBps = kernels.positive("decode_GBps");
  cluster.quantize_GBps = kernels.positive("quantize_GBps");
  cluster.dequantize_GBps = kernels.positive("dequantize_GBps");
  return cluster;
}

void require_whole_nodes(const Cluster& cluster, int world, const std::string& advice) {
  const int per_node = std::max(1, cluster.gpus_per_node);
  if (world > per_node && world % per_node != 0) {
    throw ConfigError(std::to_string(world) + " GPUs do not fill whole nodes of " +
                      std::to_string(per_node) + " GPUs (cluster " + cluster.name + ")" + advice);
  }
}

}  // namespace ciera::sim
