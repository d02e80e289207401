// `ciera simulate`: iteration times of ZeRO-3, ZeRO++ and CIERA projected from an alpha-beta
// model of a cluster and the shapes of a zoo model (the paper's Tables 1-2), or predicted from a
// trace written by `ciera train --trace`, and checked against the trace's measurements
// (docs/simulator.md).
#include <CLI/CLI.hpp>
#include <cmath>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "sim/sim.hpp"
#include "commands.hpp"
#include "report.hpp"

namespace ciera::tools {
namespace {

using namespace ciera::sim;

struct Options {
  std::string model;
  std::vector<int> gpus = {8, 16, 32, 64, 128};
  std::vector<std::string> baselines = {"zero3", "zeropp"};
  std::string dtype = "auto";
  int seq_len = 1024;
  int micro_batch = 1;
  int layers = 0;
  int prefetch = 1;
  uint32_t block = 512;
  std::string cluster = "a100-hdr";
  std::string cluster_config;
  std::optional<double> gbit, latency_ms, mfu;
  std::optional<int> gpus_per_node;
  std::string algorithm = "ring";
  bool no_checkpointing = false;
  std::string rates_file;
  std::string trace_file;
  std::vector<std::string> validate;
  bool print_cluster_config = false;
  bool json = false;
};

std::string seconds_text(double s) { return fixed(s, s < 1 ? 4 : 3); }

nlohmann::json breakdown_json(const Breakdown& b) {
  return {{"total_s", b.total_s},
          {"compute_s", b.compute_s},
          {"exposed_allgather_s", b.exposed_allgather_s},
          {"exposed_reduce_scatter_s", b.exposed_reduce_scatter_s},
          {"exposed_codec_s", b.exposed_codec_s},
          {"optimizer_s", b.optimizer_s},
          {"allgather_busy_s", b.allgather_busy_s},
          {"reduce_scatter_busy_s", b.reduce_scatter_busy_s},
          {"allgather_bytes", b.allgather_bytes},
          {"reduce_scatter_bytes", b.reduce_scatter_bytes}};
}

std::vector<std::string> breakdown_cells(const Breakdown& b) {
  return {seconds_text(b.total_s),
          seconds_text(b.compute_s),
          seconds_text(b.exposed_allgather_s),
          seconds_text(b.exposed_reduce_scatter_s),
          seconds_text(b.exposed_codec_s),
          seconds_text(b.optimizer_s)};
}
const std::vector<std::string> kBreakdownHeader = {"total s",    "compute", "exposed AG",
                                                   "exposed RS", "codec",   "optimizer"};

Cluster resolve_cluster(const Options& o) {
  const std::string config = o.cluster_config.empty()
                                 ? builtin_cluster_config()
                                 : read_text_file(o.cluster_config, "cluster config");
  Cluster c = load_cluster(
      config, o.cluster,
      o.cluster_config.empty() ? "built-in cluster config" : "cluster config " + o.cluster_config);
  if (o.gbit) {
    if (*o.gbit <= 0) throw ConfigError("--gbit must be > 0");
    c.inter.GBps = *o.gbit / 8.0;
  }
  if (o.latency_ms) {
    if (*o.latency_ms < 0) throw ConfigError("--latency-ms must be >= 0");
    c.inter.latency_s = *o.latency_ms * 1e-3;
  }
  if (o.gpus_per_node) {
    if (*o.gpus_per_node < 1) throw ConfigError("--gpus-per-node must be at least 1");
    if (*o.gpus_per_node > 1 && c.intra.GBps <= 0) {
      throw ConfigError("cluster " + c.name + " has no intra-node link to put " +
                        std::to_string(*o.gpus_per_node) + " GPUs per node on");
    }
    c.gpus_per_node = *o.gpus_per_node;
  }
  if (o.mfu) {
    if (*o.mfu <= 0 || *o.mfu > 1) throw ConfigError("--mfu must be in (0, 1]");
    c.mfu = *o.mfu;
  }
  return c;
}

std::string describe_cluster(const Cluster& c) {
  std::string s = "cluster " + c.name + (c.description.empty() ? "" : " (" + c.description + ")") +
                  ":\n  " + std::to_string(c.gpus_per_node) + " GPU(s)/node";
  if (c.gpus_per_node > 1) {
    s += "; intra-node " + fixed(c.intra.GBps, 1) + " GB/s busbw, " +
         fixed(c.intra.latency_s * 1e6, 1) + " us/step";
  }
  s += "; inter-node " + fixed(c.inter.GBps, 3) + " GB/s busbw per node, " +
       fixed(c.inter.latency_s * 1e6, 1) + " us/step\n  GPU " + c.gpu + ": " +
       fixed(c.peak_tflops, 1) + " TFLOPS x MFU " + fixed(c.mfu, 2) + ", memory " +
       fixed(c.hbm_GBps, 0) + " GB/s; kernels GB/s of raw bytes: detect " +
       fixed(c.detect_GBps, 1) + ", encode " + fixed(c.encode_GBps, 1) + ", decode " +
       fixed(c.decode_GBps, 1) + ", quantize " + fixed(c.quantize_GBps, 1) + ", dequantize " +
       fixed(c.dequantize_GBps, 1);
  return s;
}

nlohmann::json cluster_json(const Cluster& c) {
  return {{"name", c.name},
          {"gpu", c.gpu},
          {"gpus_per_node", c.gpus_per_node},
          {"intra", {{"GBps", c.intra.GBps}, {"latency_s", c.intra.latency_s}}},
          {"inter", {{"GBps", c.inter.GBps}, {"latency_s", c.inter.latency_s}}},
          {"peak_tflops", c.peak_tflops},
          {"mfu", c.mfu},
          {"hbm_GBps", c.hbm_GBps},
          {"kernels_GBps",
           {{"detect", c.detect_GBps},
            {"encode", c.encode_GBps},
            {"decode", c.decode_GBps},
            {"quantize", c.quantize_GBps},
            {"dequantize", c.dequantize_GBps}}}};
}

std::string rates_text(const ChangeRates& rates) {
  // Group the types by the source of their rate, so the line says where each number came from.
  std::map<std::string, std::string> by_source;
  for (ShardType type : kAllShardTypes) {
    const TypeRate& r = rates.of(type);
    std::string item = std::string(to_string(type)) + " " + fixed(rates.block_rate(type), 3);
    if (r.block < 0 && r.element >= 0) {
      item += " (from element rate " + fixed(r.element, 5) + ")";
    } else if (r.element >= 0) {
      item += " (element " + fixed(r.element, 4) + ")";
    }
    std::string& list = by_source[r.source.empty() ? "default" : r.source];
    list += (list.empty() ? "" : ", ") + item;
  }
  std::string s;
  for (const auto& [source, list] : by_source) s += "    [" + source + "] " + list + "\n";
  return s;
}

nlohmann::json rates_json(const ChangeRates& rates) {
  nlohmann::json j = {{"block_values", rates.block_values}};
  for (ShardType type : kAllShardTypes) {
    const TypeRate& r = rates.of(type);
    j[std::string(to_string(type))] = {
        {"block_rate", rates.block_rate(type)},
        {"element_rate", r.element >= 0 ? nlohmann::json(r.element) : nlohmann::json()},
        {"source", r.source}};
  }
  return j;
}

std::string selected_text(const Projection& p) {
  std::string s;
  for (ShardType type : kAllShardTypes) {
    if (p.selected[static_cast<size_t>(type)])
      s += (s.empty() ? "" : ",") + std::string(to_string(type));
  }
  return s.empty() ? "none" : s;
}

// ---- Zoo projection ---------------------------------------------------------------------------

struct BaselineSpec {
  System system;
  DType dtype;
  std::string key;  // "zero3" | "zeropp"
};

int run_projection(const Options& o, const std::string& command) {
  const Cluster cluster = resolve_cluster(o);
  std::vector<const ModelShape*> models;
  if (o.model.empty() || o.model == "all") {
    for (const ModelShape& m : model_zoo()) models.push_back(&m);
  } else {
    models.push_back(&find_model(o.model));
  }
  if (o.gpus.empty()) throw ConfigError("--gpus needs at least one GPU count");
  for (int w : o.gpus) {
    if (w < 1) throw ConfigError("--gpus: " + std::to_string(w) + " is not a GPU count");
  }
  std::vector<BaselineSpec> baselines;
  for (const std::string& name : o.baselines) {
    // The paper's Table 1 compares with ZeRO-3 in BF16, Table 2 with ZeRO++ in FP16 (ZeRO++
    // requires FP16); "auto" follows it, an explicit --dtype applies to both.
    if (name == "zero3") {
      baselines.push_back(
          {System::kZero3, o.dtype == "auto" ? DType::kBF16 : parse_dtype(o.dtype), name});
    } else if (name == "zeropp") {
      baselines.push_back(
          {System::kZeroPP, o.dtype == "auto" ? DType::kFP16 : parse_dtype(o.dtype), name});
    } else {
      throw ConfigError("unknown --baseline \"" + name + "\" (expected zero3 or zeropp)");
    }
  }
  if (baselines.empty()) throw ConfigError("--baseline needs at least one of zero3, zeropp");

  Workload base;
  base.seq_len = o.seq_len;
  base.micro_batch = o.micro_batch;
  base.layers = o.layers;
  base.prefetch_depth = o.prefetch;
  base.activation_checkpointing = !o.no_checkpointing;
  base.algorithm = parse_algorithm(o.algorithm);

  std::optional<Trace> trace;
  if (!o.trace_file.empty()) trace = load_trace(o.trace_file);
  const std::string rates_text_json =
      o.rates_file.empty() ? "" : read_text_file(o.rates_file, "rates file");

  nlohmann::json j;
  j["command"] = command;
  j["kind"] = "projection";
  j["cluster"] = cluster_json(cluster);
  j["workload"] = {{"seq_len", o.seq_len},
                   {"micro_batch", o.micro_batch},
                   {"layers", o.layers == 0 ? nlohmann::json("all") : nlohmann::json(o.layers)},
                   {"prefetch_depth", o.prefetch},
                   {"activation_checkpointing", !o.no_checkpointing},
                   {"algorithm", o.algorithm},
                   {"optimizer_bytes_per_param", base.optimizer_bytes_per_param},
                   {"zeropp_block_values", base.zeropp_block_values}};
  nlohmann::json models_json = nlohmann::json::array();
  nlohmann::json results = nlohmann::json::array();
  nlohmann::json comparisons = nlohmann::json::array();

  std::string rates_report;
  std::vector<std::pair<std::string, Table>> speedup_tables;
  std::vector<std::pair<std::string, Table>> bound_tables;
  std::vector<std::string> gpu_header = {"model"};
  for (int w : o.gpus) gpu_header.push_back(std::to_string(w));
  for (const BaselineSpec& b : baselines) {
    const std::string title =
        "Speedup of CIERA over " + std::string(system_name(b.system)) + " (" +
        std::string(dtype_name(b.dtype)) + ", S=" + std::to_string(o.seq_len) + ", " +
        (o.layers ? std::to_string(o.layers) + " layers" : std::string("all layers")) + ")";
    speedup_tables.emplace_back(title, Table(gpu_header));
    bound_tables.emplace_back(
        "vs " + std::string(system_name(b.system)) +
            ": allgather byte ratio / allgather busy "
            "share of the baseline iteration / speedup bound from byte reduction alone",
        Table(gpu_header));
  }
  Table breakdown({"model", "GPUs", "dtype", "system", "total s", "compute", "exposed AG",
                   "exposed RS", "codec", "optimizer", "AG GB/iter", "CIERA compresses"});

  for (const ModelShape* model : models) {
    ChangeRates rates = paper_rates(*model);
    rates.block_values = o.block;
    if (trace) apply_trace_rates(rates, *trace);
    if (!rates_text_json.empty()) apply_rates_json(rates, rates_text_json, "rates " + o.rates_file);
    rates_report += "  " + model->display + " (" + fixed(parameter_count(*model) / 1e9, 2) +
                    "B params; " + model->source +
                    "), block change rates at B=" + std::to_string(rates.block_values) + ":\n" +
                    rates_text(rates);
    models_json.push_back({{"name", model->name},
                           {"display", model->display},
                           {"params", parameter_count(*model)},
                           {"source", model->source},
                           {"rates", rates_json(rates)}});

    std::map<std::pair<int, DType>, Projection> ciera_cache;
    for (size_t bi = 0; bi < baselines.size(); ++bi) {
      const BaselineSpec& spec = baselines[bi];
      std::vector<std::string> speedup_row = {model->display}, bound_row = {model->display};
      for (int w : o.gpus) {
        Workload work = base;
        work.world = w;
        work.dtype = spec.dtype;
        const Projection baseline = project(*model, cluster, work, rates, spec.system);
        auto cached = ciera_cache.find({w, spec.dtype});
        if (cached == ciera_cache.end()) {
          cached = ciera_cache
                       .emplace(std::pair{w, spec.dtype},
                                project(*model, cluster, work, rates, System::kCiera))
                       .first;
          const Projection& c = cached->second;
          std::vector<std::string> row = {model->display, std::to_string(w),
                                          std::string(dtype_name(spec.dtype)), "CIERA"};
          for (auto& cell : breakdown_cells(c.breakdown)) row.push_back(cell);
          row.push_back(fixed(c.breakdown.allgather_bytes / 1e9, 2));
          row.push_back(selected_text(c));
          breakdown.add(row);
          results.push_back({{"model", model->name},
                             {"gpus", w},
                             {"dtype", dtype_name(spec.dtype)},
                             {"system", "ciera"},
                             {"breakdown", breakdown_json(c.breakdown)},
                             {"selected", selected_text(c)}});
        }
        const Projection& ciera = cached->second;
        std::vector<std::string> row = {model->display, std::to_string(w),
                                        std::string(dtype_name(spec.dtype)),
                                        std::string(system_name(spec.system))};
        for (auto& cell : breakdown_cells(baseline.breakdown)) row.push_back(cell);
        row.push_back(fixed(baseline.breakdown.allgather_bytes / 1e9, 2));
        row.push_back("");
        breakdown.add(row);
        results.push_back({{"model", model->name},
                           {"gpus", w},
                           {"dtype", dtype_name(spec.dtype)},
                           {"system", spec.key},
                           {"breakdown", breakdown_json(baseline.breakdown)}});

        const double speedup = baseline.breakdown.total_s / ciera.breakdown.total_s;
        const double byte_ratio =
            baseline.breakdown.allgather_bytes / ciera.breakdown.allgather_bytes;
        // The allgathers' busy share, not their exposed share: shrinking work by x can shorten a
        // schedule by at most x, so this bound holds even where prefetch hides part of the gathers.
        const double share = baseline.breakdown.allgather_busy_s / baseline.breakdown.total_s;
        const double bound = byte_reduction_bound(share, byte_ratio);
        speedup_row.push_back(fixed(speedup, 2) + "x");
        bound_row.push_back(fixed(byte_ratio, 2) + " / " + fixed(100 * share, 0) + "% / " +
                            fixed(bound, 2) + "x");
        comparisons.push_back({{"baseline", spec.key},
                               {"dtype", dtype_name(spec.dtype)},
                               {"model", model->name},
                               {"gpus", w},
                               {"speedup", speedup},
                               {"allgather_byte_ratio", byte_ratio},
                               {"allgather_share", share},
                               {"byte_reduction_bound", bound}});
      }
      speedup_tables[bi].second.add(speedup_row);
      bound_tables[bi].second.add(bound_row);
    }
  }
  j["models"] = models_json;
  j["results"] = results;
  j["comparisons"] = comparisons;

  if (o.json) {
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::cout
      << "ciera simulate: projected from an alpha-beta model, not measured (docs/simulator.md)\n"
      << "command: " << command << "\n"
      << describe_cluster(cluster) << "\n"
      << "workload per GPU: sequence " << o.seq_len << " x micro-batch " << o.micro_batch << ", "
      << (o.layers ? std::to_string(o.layers) + " layers" : std::string("all layers"))
      << ", prefetch depth " << o.prefetch << ", "
      << (o.no_checkpointing ? "no activation checkpointing" : "activation checkpointing") << ", "
      << o.algorithm << " collectives, Adam step " << fixed(base.optimizer_bytes_per_param, 0)
      << " B/param at memory bandwidth; ZeRO++ int8/int4 blocks of " << base.zeropp_block_values
      << " values\n"
      << "change rates: block q (element c); CIERA payload = header + sign-mantissa + bitmap + the "
         "smaller of q x exponents (paper §3.2) and fine mode (1.5 B per changed value + 1 B per "
         "changed block), as the encoder:\n"
      << rates_report << "\n";
  for (auto& [title, table] : speedup_tables) std::cout << title << "\n" << table.render() << "\n";
  for (auto& [title, table] : bound_tables) std::cout << title << "\n" << table.render() << "\n";
  std::cout << "Breakdown per iteration (seconds; exposed = on the critical path)\n"
            << breakdown.render();
  return 0;
}

// ---- Trace-driven prediction -----------------------------------------------------------------

struct TraceResult {
  Trace trace;
  TracePrediction prediction;
};

double relative_error(double predicted, double measured) {
  return measured > 0 ? (predicted - measured) / measured : 0.0;
}

std::string percent_text(double error) {
  return (error >= 0 ? "+" : "") + fixed(100 * error, 1) + "%";
}

nlohmann::json trace_json(const TraceResult& r) {
  const Trace& t = r.trace;
  const TracePrediction& p = r.prediction;
  auto fit = [](const std::optional<CostCurve>& c) -> nlohmann::json {
    if (!c) return nullptr;
    return {{"alpha_s", c->alpha_s}, {"GBps", c->bytes_per_s / 1e9}};
  };
  nlohmann::json j = {
      {"trace", t.origin},
      {"config", t.describe()},
      {"schedule",
       {{"baseline", p.baseline_overlap ? "overlap" : "sequential"},
        {"ciera", p.ciera_overlap ? "overlap" : "sequential"},
        {"block_values", t.block_values}}},
      {"allgather_fit", fit(p.allgather)},
      {"reduce_scatter_fit", fit(p.reduce_scatter)},
      {"probe_allgather_fit", fit(p.probe_allgather)},
      {"probe_reduce_scatter_fit", fit(p.probe_reduce_scatter)},
      {"predicted", {{"baseline", breakdown_json(p.baseline)}, {"ciera", breakdown_json(p.ciera)}}},
      {"ciera_gather_terms_s",
       {{"comm", p.ciera_comm_s}, {"encode", p.ciera_encode_s}, {"decode", p.ciera_decode_s}}},
      {"predicted_speedup", p.baseline.total_s / p.ciera.total_s}};
  auto measured = [&](const std::optional<MeasuredRun>& m, const Breakdown& b,
                      double allgather) -> nlohmann::json {
    if (!m) return nullptr;
    return {{"iteration_s", m->iteration_s},
            {"allgather_s", m->allgather_s},
            {"predicted_iteration_s", b.total_s},
            {"predicted_allgather_s", allgather},
            {"error", relative_error(b.total_s, m->iteration_s)},
            {"allgather_error", relative_error(allgather, m->allgather_s)}};
  };
  j["measured"] = {
      {"baseline", measured(t.measured_baseline, p.baseline, p.baseline_allgather_s)},
      {"ciera", measured(t.measured_ciera, p.ciera, p.ciera_allgather_s)}};
  return j;
}

int run_trace(const Options& o, const std::string& command) {
  TraceResult r{load_trace(o.trace_file), {}};
  r.prediction = predict_trace(r.trace, o.prefetch);
  nlohmann::json j = trace_json(r);
  j["command"] = command;
  j["kind"] = "trace";
  if (o.json) {
    std::cout << j.dump() << std::endl;
    return 0;
  }
  const Trace& t = r.trace;
  const TracePrediction& p = r.prediction;
  double raw = 0, wire = 0;
  for (const TraceBucket& b : t.buckets) {
    raw += b.raw_bytes;
    wire += std::min(b.wire_bytes, b.raw_bytes);
  }
  std::cout << "ciera simulate: prediction from " << t.origin << " (" << t.describe() << ", "
            << t.buckets.size() << " buckets)\ncommand: " << command << "\n"
            << "allgather cost curve fitted to " << t.allgather_points.size()
            << " measured points: " << fixed(p.allgather.alpha_s * 1e3, 3) << " ms + bytes / "
            << fixed(p.allgather.bytes_per_s / 1e9, 4)
            << " GB/s\nreduce-scatter cost curve fitted to " << t.reduce_scatter_points.size()
            << " points: " << fixed(p.reduce_scatter.alpha_s * 1e3, 3) << " ms + bytes / "
            << fixed(p.reduce_scatter.bytes_per_s / 1e9, 4) << " GB/s\n"
            << "codec (of raw shard bytes): encode " << fixed(t.encode_GBps, 2)
            << " GB/s (detection included), decode " << fixed(t.decode_GBps, 2) << " GB/s\n"
            << "schedule: baseline " << (p.baseline_overlap ? "overlapped" : "sequential")
            << ", CIERA " << (p.ciera_overlap ? "overlapped" : "sequential")
            << " (overlapped: prefetch depth " << o.prefetch
            << "); reduce-scatters block; B = " << t.block_values << "\n";
  if (p.probe_allgather) {
    std::cout << "comm_probe (micro-benchmark, not used): allgather "
              << fixed(p.probe_allgather->alpha_s * 1e3, 3) << " ms + bytes / "
              << fixed(p.probe_allgather->bytes_per_s / 1e9, 4) << " GB/s\n";
  }
  std::cout << "CIERA gather terms per step: Comm(wire) " << seconds_text(p.ciera_comm_s)
            << " s, encode " << seconds_text(p.ciera_encode_s) << " s, decode "
            << seconds_text(p.ciera_decode_s) << " s\n\n";
  std::vector<std::string> header = {"predicted"};
  for (const auto& h : kBreakdownHeader) header.push_back(h);
  Table table(header);
  std::vector<std::string> row = {"baseline (raw)"};
  for (auto& cell : breakdown_cells(p.baseline)) row.push_back(cell);
  table.add(row);
  row = {"CIERA"};
  for (auto& cell : breakdown_cells(p.ciera)) row.push_back(cell);
  table.add(row);
  std::cout << table.render() << "predicted speedup "
            << fixed(p.baseline.total_s / p.ciera.total_s, 3) << "x; allgather byte ratio "
            << fixed(wire > 0 ? raw / wire : 1.0, 3) << "x";
  if (p.baseline_overlap == p.ciera_overlap) {  // else the schedule, not bytes, differs too
    std::cout << "; bound from bytes alone "
              << fixed(byte_reduction_bound(p.baseline.allgather_busy_s / p.baseline.total_s,
                                            wire > 0 ? raw / wire : 1.0),
                       3)
              << "x";
  }
  std::cout << "\n";
  for (const auto& [label, m, b, ag] :
       {std::tuple{"baseline", t.measured_baseline, p.baseline, p.baseline_allgather_s},
        std::tuple{"CIERA", t.measured_ciera, p.ciera, p.ciera_allgather_s}}) {
    if (!m) continue;
    std::cout << label << ": iteration measured " << seconds_text(m->iteration_s)
              << " s, predicted " << seconds_text(b.total_s) << " s, error "
              << percent_text(relative_error(b.total_s, m->iteration_s)) << "; allgather measured "
              << seconds_text(m->allgather_s) << " s, predicted " << seconds_text(ag) << " s, error "
              << percent_text(relative_error(ag, m->allgather_s)) << "\n";
  }
  return 0;
}

int run_validate(const Options& o, const std::string& command) {
  nlohmann::json j;
  j["command"] = command;
  j["kind"] = "validation";
  nlohmann::json rows = nlohmann::json::array();
  Table table({"trace", "config", "system", "schedule", "measured s", "predicted s", "error",
               "AG measured s", "AG predicted s", "AG error"});
  double worst = 0;
  for (const std::string& path : o.validate) {
    TraceResult r{load_trace(path), {}};
    r.prediction = predict_trace(r.trace, o.prefetch);
    rows.push_back(trace_json(r));
    const TracePrediction& p = r.prediction;
    const std::string file = path.substr(path.find_last_of('/') + 1);
    bool any = false;
    for (const auto& [label, m, b, ag, overlap] :
         {std::tuple{"baseline", r.trace.measured_baseline, p.baseline, p.baseline_allgather_s,
                     p.baseline_overlap},
          std::tuple{"CIERA", r.trace.measured_ciera, p.ciera, p.ciera_allgather_s,
                     p.ciera_overlap}}) {
      if (!m) continue;
      any = true;
      const double error = relative_error(b.total_s, m->iteration_s);
      worst = std::max(worst, std::abs(error));
      table.add({file, r.trace.describe(), label, overlap ? "overlap" : "sequential",
                 seconds_text(m->iteration_s), seconds_text(b.total_s), percent_text(error),
                 seconds_text(m->allgather_s), seconds_text(ag),
                 percent_text(relative_error(ag, m->allgather_s))});
    }
    if (!any) {
      table.add({file, r.trace.describe(), "-", "-", "not measured",
                 seconds_text(p.baseline.total_s), "-", "-", "-", "-"});
    }
  }
  j["traces"] = rows;
  j["worst_abs_error"] = worst;
  if (o.json) {
    std::cout << j.dump() << std::endl;
  } else {
    std::cout
        << "ciera simulate --validate: predicted iteration time against the traces' measurements\n"
        << "command: " << command << "\n\n"
        << table.render() << "worst |error| of iteration time: " << fixed(100 * worst, 1)
        << "%\n";
  }
  return 0;
}

int run(const Options& o, const std::string& command) {
  if (o.print_cluster_config) {
    std::cout << builtin_cluster_config();
    return 0;
  }
  if (!o.validate.empty()) return run_validate(o, command);
  if (!o.trace_file.empty() && o.model.empty()) return run_trace(o, command);
  return run_projection(o, command);
}

}  // namespace

void register_simulate(CLI::App& app, const std::string& command) {
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Project ZeRO-3 / ZeRO++ / CIERA iteration times (model zoo) or predict them from a trace");
  cmd->add_option("--model", o->model,
                  "zoo model, or all (default: all; with --trace alone: the traced run)");
  cmd->add_option("--gpus", o->gpus, "GPU counts, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--baseline", o->baselines, "zero3, zeropp (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--dtype", o->dtype,
                  "auto (bf16 vs zero3, fp16 vs zeropp, as the paper) | bf16 | fp16")
      ->capture_default_str();
  cmd->add_option("--seq-len", o->seq_len, "tokens per sequence")->capture_default_str();
  cmd->add_option("--micro-batch", o->micro_batch, "sequences per GPU per iteration")
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "transformer layers (0: all)")->capture_default_str();
  cmd->add_option("--prefetch", o->prefetch, "gathers in flight ahead of compute")
      ->capture_default_str();
  cmd->add_option("--block", o->block, "CIERA block size B in values")->capture_default_str();
  cmd->add_option("--cluster", o->cluster, "cluster preset: a100-hdr, h100-ndr, h200-ndr, linklab")
      ->capture_default_str();
  cmd->add_option("--cluster-config", o->cluster_config,
                  "cluster presets JSON (see --print-cluster-config)");
  cmd->add_option("--gbit", o->gbit, "inter-node link, Gbit/s line rate (overrides the preset)");
  cmd->add_option("--latency-ms", o->latency_ms,
                  "inter-node latency per ring step, ms (overrides the preset)");
  cmd->add_option("--gpus-per-node", o->gpus_per_node, "GPUs per node (overrides the preset)");
  cmd->add_option("--mfu", o->mfu, "model FLOPs utilisation (overrides the preset)");
  cmd->add_option("--algo", o->algorithm, "ZeRO-3/CIERA collectives: ring | hierarchical")
      ->capture_default_str();
  cmd->add_flag("--no-checkpointing", o->no_checkpointing,
                "backward without recomputing the forward");
  cmd->add_option("--rates", o->rates_file,
                  "measured change rates JSON (overrides paper/trace rates)");
  cmd->add_option("--trace", o->trace_file,
                  "trace (format v1): predict it, or with --model take its change rates");
  cmd->add_option("--validate", o->validate,
                  "traces to compare predicted with measured iteration times")
      ->expected(1, -1);
  cmd->add_flag("--print-cluster-config", o->print_cluster_config,
                "print the built-in cluster presets JSON");
  cmd->add_flag("--json", o->json, "print one JSON object on one line");
  cmd->callback([o, command]() { throw CommandExit(run(*o, command)); });
}

}  // namespace ciera::tools
