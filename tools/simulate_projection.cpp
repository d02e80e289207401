// `ciera simulate --model`: CIERA against ZeRO-3, ZeRO++, SDP4Bit and stateless exponent coding
// on the model zoo, computed for every model x baseline x GPU count, then rendered as the speedup,
// bound and breakdown tables or as one JSON object.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "exit_status.hpp"
#include "report.hpp"
#include "simulate.hpp"

namespace ciera::tools::simulate {
namespace {

using namespace ciera::sim;

Comparison compare(const Baseline& baseline, const ModelInput& model, int gpus,
                   const Projection& base, const Projection& ciera) {
  Comparison c{&baseline, &model, gpus, ciera.topology, 0, 0, 0, 0};
  c.speedup = base.breakdown.total_s / ciera.breakdown.total_s;
  // 1 where neither gathers a byte (a group of one GPU), as the trace report has it.
  c.byte_ratio = ciera.breakdown.allgather_bytes > 0
                     ? base.breakdown.allgather_bytes / ciera.breakdown.allgather_bytes
                     : 1.0;
  // The allgathers' busy share, not their exposed share: shrinking work by x can shorten a
  // schedule by at most x, so this bound holds even where prefetch hides part of the gathers.
  c.allgather_share = base.breakdown.allgather_busy_s / base.breakdown.total_s;
  c.bound = byte_reduction_bound(base.breakdown, ciera.breakdown);
  return c;
}

// ---- Rendering -------------------------------------------------------------------------------

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
    if (r.block >= 0 && r.block_at != 0 && r.block_at != rates.block_values) {
      item += " (at B=" + std::to_string(r.block_at) + ")";
    } else if (r.block < 0 && r.element >= 0) {
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
        // The B the block rate was measured at (the paper's 512 at another --block); null where
        // it is derived from the element rate.
        {"block_rate_measured_at",
         r.block >= 0 ? nlohmann::json(r.block_at ? r.block_at : rates.block_values)
                      : nlohmann::json()},
        {"source", r.source}};
  }
  return j;
}

// Said wherever a trace's change rates serve a projection in another dtype: the rates are
// measured in one dtype, and the dtypes round differently (BF16 keeps 7 mantissa bits, FP16 10)
// and FP16 makes small weights subnormal, so another dtype's rates are carried over unmeasured.
// Empty where every projection of the model is in the trace's dtype, or none of its rates is the
// trace's.
std::string rates_dtype_note(const ProjectionRequest& p, const ModelInput& m) {
  if (!m.trace_dtype) return "";
  std::vector<DType> others;
  for (const Baseline& b : p.baselines) {
    if (b.dtype != *m.trace_dtype &&
        std::find(others.begin(), others.end(), b.dtype) == others.end())
      others.push_back(b.dtype);
  }
  if (others.empty()) return "";
  std::string projected;
  for (DType d : others) projected += (projected.empty() ? "" : ", ") + std::string(dtype_name(d));
  return "the trace's change rates were measured in " + std::string(dtype_name(*m.trace_dtype)) +
         " and are applied unchanged to the " + projected +
         " projections (exponent change rates depend on the dtype; trace a run in that dtype to "
         "measure them)";
}

std::string types_text(const std::array<bool, kShardTypeCount>& selected) {
  std::string s;
  for (ShardType type : kAllShardTypes) {
    if (!selected[static_cast<size_t>(type)]) continue;
    if (!s.empty()) s += ',';
    s += to_string(type);
  }
  return s.empty() ? "none" : s;
}

std::string selected_text(const Projection& p) {
  if (!p.backward_on_node) return types_text(p.selected);
  return "forward " + types_text(p.selected) + "; backward on node " +
         types_text(p.selected_backward_on_node);
}

// Only the default (flat alone) leaves the topology out of the tables, as before --topology.
bool flat_only(const ProjectionRequest& p) {
  return p.topologies == std::vector<Topology>{Topology::kFlat};
}

// Where a run's collectives ran: ZeRO-3's and CIERA's topology, or the baseline's own design.
std::string placement_text(const Projection& p) {
  if (p.system == System::kZeroPP) return "hpZ";
  return std::string(topology_name(p.topology));
}

std::string system_text(const ProjectionRequest& request, const ProjectionRun& run) {
  std::string s(system_name(run.system));
  const bool placed = run.system == System::kZero3 || run.system == System::kCiera;
  return placed && !flat_only(request) ? s + " " + placement_text(run.projection) : s;
}

std::string gradient_collective_text(const Projection& p) {
  if (p.system == System::kZeroPP) return "qgZ int4 all-to-all";
  return p.breakdown.allreduce_bytes > 0 ? "RS in node + AR" : "reduce-scatter";
}

// The scheme figures a baseline is projected with (SDP4Bit, stateless coding), or nullptr.
const SchemeFigures* scheme_of(const Baseline& b, const Workload& w) {
  if (b.system == System::kSdp4Bit) return &w.schemes.sdp4bit;
  if (b.system == System::kStateless) return &w.schemes.stateless;
  return nullptr;
}

std::string scheme_text(const Baseline& b, const SchemeFigures& f, const Cluster& cluster) {
  const GatherCodec codec = gather_codec(f, cluster, b.dtype);
  std::string s = std::string(system_name(b.system)) + " (" + std::string(dtype_name(b.dtype)) +
                  "): " + fixed(f.bits_per_value, 4) + " bits/value on the wire; encode " +
                  fixed(codec.encode_GBps, 1) + ", decode " + fixed(codec.decode_GBps, 1) +
                  " GB/s of raw bytes on this cluster";
  if (f.measured) {
    const BenchThroughputs& m = *f.measured;
    s += " (measured " + fixed(m.encode_GBps, 2) + " / " + fixed(m.decode_GBps, 2) +
         " GB/s against CIERA's " + fixed(m.ciera_encode_GBps, 2) + " / " +
         fixed(m.ciera_decode_GBps, 2) + ", times the cluster's CIERA encode / decode)";
  } else {
    s += " (not measured: the cluster's quantize / dequantize)";
  }
  return s + "\n    [" + f.source + "]";
}

nlohmann::json scheme_json(const Baseline& b, const SchemeFigures& f, const Cluster& cluster) {
  const GatherCodec codec = gather_codec(f, cluster, b.dtype);
  nlohmann::json measured;  // null when not measured
  if (f.measured) {
    measured = {{"encode_GBps", f.measured->encode_GBps},
                {"decode_GBps", f.measured->decode_GBps},
                {"ciera_encode_GBps", f.measured->ciera_encode_GBps},
                {"ciera_decode_GBps", f.measured->ciera_decode_GBps}};
  }
  return {{"dtype", dtype_name(b.dtype)},
          {"bits_per_value", f.bits_per_value},
          {"encode_GBps", codec.encode_GBps},
          {"decode_GBps", codec.decode_GBps},
          {"measured", measured},
          {"source", f.source}};
}

std::string layers_text(const Workload& w) {
  return w.layers ? std::to_string(w.layers) + " layers" : std::string("all layers");
}

nlohmann::json projection_json(const Request& request, const ProjectionResult& result) {
  const ProjectionRequest& p = request.projection;
  const Workload& w = p.workload;
  nlohmann::json j;
  j["command"] = request.command;
  j["kind"] = "projection";
  j["cluster"] = cluster_json(p.cluster);
  j["workload"] = {{"seq_len", w.seq_len},
                   {"micro_batch", w.micro_batch},
                   {"layers", w.layers == 0 ? nlohmann::json("all") : nlohmann::json(w.layers)},
                   {"prefetch_depth", w.prefetch_depth},
                   {"activation_checkpointing", w.activation_checkpointing},
                   {"algorithm", p.algorithm},
                   {"optimizer_bytes_per_param", w.optimizer_bytes_per_param},
                   {"state_bytes_per_param", w.state_bytes_per_param},
                   {"zeropp_block_values", w.zeropp_block_values}};
  j["topologies"] = nlohmann::json::array();
  for (Topology t : p.topologies) j["topologies"].push_back(topology_name(t));
  for (const Baseline& b : p.baselines) {  // SDP4Bit's and stateless coding's codec figures
    if (const SchemeFigures* f = scheme_of(b, w))
      j["schemes"][b.key] = scheme_json(b, *f, p.cluster);
  }
  j["models"] = nlohmann::json::array();
  for (const ModelInput& m : p.models) {
    j["models"].push_back(
        {{"name", m.model->name},
         {"display", m.model->display},
         {"params", parameter_count(*m.model)},
         {"source", m.model->source},
         {"rates", rates_json(m.rates)},
         {"rates_measured_dtype",
          m.trace_dtype ? nlohmann::json(dtype_name(*m.trace_dtype)) : nlohmann::json()},
         {"rates_note", rates_dtype_note(p, m).empty() ? nlohmann::json()
                                                       : nlohmann::json(rates_dtype_note(p, m))}});
  }
  j["results"] = nlohmann::json::array();
  for (const ProjectionRun& run : result.runs) {
    nlohmann::json row = {{"model", run.model->model->name},
                          {"gpus", run.gpus},
                          {"dtype", dtype_name(run.dtype)},
                          {"system", run.key},
                          {"breakdown", breakdown_json(run.projection.breakdown)}};
    if (run.system == System::kCiera) {
      row["selected"] = types_text(run.projection.selected);
      if (run.projection.backward_on_node)
        row["selected_backward_on_node"] = types_text(run.projection.selected_backward_on_node);
    }
    row["topology"] = placement_text(run.projection);
    row["gradient_collective"] = gradient_collective_text(run.projection);
    row["state_bytes_per_gpu"] = run.projection.state_bytes_per_gpu;
    j["results"].push_back(row);
  }
  j["comparisons"] = nlohmann::json::array();
  for (const Comparison& c : result.comparisons) {
    j["comparisons"].push_back({{"baseline", c.baseline->key},
                                {"dtype", dtype_name(c.baseline->dtype)},
                                {"model", c.model->model->name},
                                {"gpus", c.gpus},
                                {"topology", topology_name(c.topology)},
                                {"speedup", c.speedup},
                                {"allgather_byte_ratio", c.byte_ratio},
                                {"allgather_share", c.allgather_share},
                                {"byte_reduction_bound", c.bound}});
  }
  return j;
}

void print_header(const Request& request, std::ostream& out) {
  const ProjectionRequest& p = request.projection;
  const Workload& w = p.workload;
  out << "ciera simulate: projected from an alpha-beta model, not measured (docs/simulator.md)\n"
      << "command: " << request.command << "\n"
      << describe_cluster(p.cluster) << "\n"
      << "workload per GPU: sequence " << w.seq_len << " x micro-batch " << w.micro_batch << ", "
      << layers_text(w) << ", prefetch depth " << w.prefetch_depth << ", "
      << (w.activation_checkpointing ? "activation checkpointing" : "no activation checkpointing")
      << ", " << p.algorithm << " collectives, Adam step "
      << fixed(w.optimizer_bytes_per_param, 0)
      << " B/param at memory bandwidth; ZeRO++ int8/int4 blocks of " << w.zeropp_block_values
      << " values\n";
  if (!flat_only(p)) {
    const int g = p.cluster.gpus_per_node;
    out << "ZeRO-3 and CIERA on each of:";
    for (Topology t : p.topologies) {
      out << " " << topology_name(t)
          << (t == Topology::kFlat      ? " (all collectives over the W GPUs)"
              : t == Topology::kPartial ? " (reshard_after_forward = " + std::to_string(g) +
                                              ": backward gathers in the node)"
                                        : " (shard over the node's " + std::to_string(g) +
                                              " GPUs, all-reduce across nodes)")
          << (t == p.topologies.back() ? "\n" : ";");
    }
  }
  for (const Baseline& b : p.baselines) {
    if (const SchemeFigures* f = scheme_of(b, w)) out << scheme_text(b, *f, p.cluster) << "\n";
  }
  out << "change rates: block q (element c); CIERA payload = header + sign-mantissa + bitmap + the "
         "smaller of q x exponents (paper §3.2) and fine mode (1.5 B per changed value + 1 B per "
         "changed block), as the encoder:\n";
  for (const ModelInput& m : p.models) {
    out << "  " << m.model->display << " (" << fixed(parameter_count(*m.model) / 1e9, 2)
        << "B params; " << m.model->source << "), block change rates at B="
        << m.rates.block_values << ":\n"
        << rates_text(m.rates);
    const std::string note = rates_dtype_note(p, m);
    if (!note.empty()) out << "    note: " << note << "\n";
  }
  out << "\n";
}

// Per baseline, a title and a table of one row per model and one column per GPU count, each
// cell made by `cell` from that configuration's comparison.
// With several topologies, one table per baseline and topology of CIERA's (ZeRO-3's too).
template <typename Title, typename Cell>
void print_per_baseline(const Request& request, const ProjectionResult& result, Title title,
                        Cell cell, std::ostream& out) {
  const ProjectionRequest& p = request.projection;
  std::vector<std::string> header = {"model"};
  for (int w : p.gpus) header.push_back(std::to_string(w));
  for (const Baseline& b : p.baselines) {
    for (Topology t : p.topologies) {
      Table table(header);
      for (const ModelInput& m : p.models) {
        std::vector<std::string> row = {m.model->display};
        for (const Comparison& c : result.comparisons) {
          if (c.baseline == &b && c.model == &m && c.topology == t) row.push_back(cell(c));
        }
        table.add(row);
      }
      std::string topology;
      if (!flat_only(p)) {
        topology = b.system == System::kZero3 ? " [both " + std::string(topology_name(t)) + "]"
                                              : " [CIERA " + std::string(topology_name(t)) + "]";
      }
      out << title(b) << topology << "\n" << table.render() << "\n";
    }
  }
}

void print_breakdown(const ProjectionRequest& request, const ProjectionResult& result,
                     std::ostream& out) {
  Table breakdown({"model", "GPUs", "dtype", "system", "total s", "compute", "exposed AG",
                   "exposed RS", "codec", "optimizer", "AG GB/iter", "CIERA compresses"});
  for (const ProjectionRun& run : result.runs) {
    std::vector<std::string> row = {run.model->model->display, std::to_string(run.gpus),
                                    std::string(dtype_name(run.dtype)), system_text(request, run)};
    for (auto& cell : breakdown_cells(run.projection.breakdown)) row.push_back(cell);
    row.push_back(fixed(run.projection.breakdown.allgather_bytes / 1e9, 2));
    row.push_back(run.system == System::kCiera ? selected_text(run.projection) : "");
    breakdown.add(row);
  }
  out << "Breakdown per iteration (seconds; exposed = on the critical path)\n"
      << breakdown.render();
}

// The breakdown's terms split further: which pass waited on its gathers, how much of that wait was
// on gathers across nodes, the gradient collective, the codec's busy time, and what each GPU holds.
void print_time_split(const ProjectionResult& result, std::ostream& out) {
  Table split({"model", "GPUs", "dtype", "system", "topology", "total s", "compute", "fwd AG",
               "bwd AG", "AG inter-node", "grads", "of which AR", "gradient collective", "codec",
               "encode busy", "decode busy", "optimizer", "AG GB inter/intra", "states GB/GPU"});
  for (const ProjectionRun& run : result.runs) {
    const Breakdown& b = run.projection.breakdown;
    split.add(
        {run.model->model->display, std::to_string(run.gpus), std::string(dtype_name(run.dtype)),
         std::string(system_name(run.system)), placement_text(run.projection),
         seconds_text(b.total_s), seconds_text(b.compute_s),
         seconds_text(b.exposed_allgather_forward_s), seconds_text(b.exposed_allgather_backward_s),
         seconds_text(b.exposed_allgather_inter_node_s), seconds_text(b.exposed_reduce_scatter_s),
         seconds_text(b.exposed_allreduce_s), gradient_collective_text(run.projection),
         seconds_text(b.exposed_codec_s), seconds_text(b.encode_busy_s),
         seconds_text(b.decode_busy_s), seconds_text(b.optimizer_s),
         fixed(b.allgather_inter_node_bytes / 1e9, 2) + " / " +
             fixed((b.allgather_bytes - b.allgather_inter_node_bytes) / 1e9, 2),
         fixed(run.projection.state_bytes_per_gpu / 1e9, 2)});
  }
  out << "\nWhere the time goes (seconds per iteration; fwd/bwd AG: exposed allgather by pass, "
         "AG inter-node: the part of it waited on gathers across nodes; grads: exposed gradient "
         "collectives, AR = HSDP's all-reduce; busy = hidden or not; states: parameters, "
         "gradients and Adam states per GPU, with partial resharding's and hpZ's node copy)\n"
      << split.render();
}

}  // namespace

ProjectionResult compute_projection(const ProjectionRequest& p) {
  ProjectionResult result;
  for (const ModelInput& m : p.models) {
    // CIERA's projection depends on the GPU count, dtype and topology, not on the baseline.
    std::map<std::tuple<int, DType, Topology>, size_t> ciera_run;
    for (const Baseline& b : p.baselines) {
      for (int w : p.gpus) {
        Workload work = p.workload;
        work.world = w;
        work.dtype = b.dtype;
        // ZeRO-3 runs on each topology, against CIERA on the same; another baseline runs once, as
        // its design places it, against CIERA on each topology.
        std::optional<size_t> own_placement;
        for (Topology t : p.topologies) {
          work.topology = t;
          auto cached = ciera_run.find({w, b.dtype, t});
          if (cached == ciera_run.end()) {
            result.runs.push_back({&m, w, b.dtype, System::kCiera, "ciera",
                                   project(*m.model, p.cluster, work, m.rates, System::kCiera)});
            cached = ciera_run.emplace(std::tuple{w, b.dtype, t}, result.runs.size() - 1).first;
          }
          size_t base = 0;
          if (b.system == System::kZero3 || !own_placement) {
            if (b.system != System::kZero3) work.topology = Topology::kFlat;
            result.runs.push_back({&m, w, b.dtype, b.system, b.key,
                                   project(*m.model, p.cluster, work, m.rates, b.system)});
            base = result.runs.size() - 1;
            if (b.system != System::kZero3) own_placement = base;
          } else {
            base = *own_placement;
          }
          result.comparisons.push_back(compare(b, m, w, result.runs[base].projection,
                                               result.runs[cached->second].projection));
        }
      }
    }
  }
  // Figures past double's range (a --gbit of 1e-320 passes "> 0") would print as nan or inf.
  for (const ProjectionRun& run : result.runs) {
    const double total = run.projection.breakdown.total_s;
    if (!(std::isfinite(total) && total > 0 && total < 1e18)) {  // 1e18 s: absurd, not a projection
      throw UsageError(std::string(system_name(run.system)) + " on " + std::to_string(run.gpus) +
                       " GPUs projects an iteration of " + extreme_seconds_text(total) +
                       ": a link, kernel or --mfu figure is too extreme for the model");
    }
  }
  return result;
}

void render_projection(const Request& request, const ProjectionResult& result,
                       std::ostream& out) {
  if (request.json) {
    out << json_text(projection_json(request, result)) << std::endl;
    return;
  }
  print_header(request, out);
  const Workload& w = request.projection.workload;
  print_per_baseline(
      request, result,
      [&](const Baseline& b) {
        return "Speedup of CIERA over " + std::string(system_name(b.system)) + " (" +
               std::string(dtype_name(b.dtype)) + ", S=" + std::to_string(w.seq_len) + ", " +
               layers_text(w) + ")";
      },
      [](const Comparison& c) { return fixed(c.speedup, 2) + "x"; }, out);
  print_per_baseline(
      request, result,
      [](const Baseline& b) {
        return "vs " + std::string(system_name(b.system)) +
               ": allgather byte ratio / allgather busy share of the baseline iteration / "
               "speedup bound from byte reduction alone";
      },
      [](const Comparison& c) {
        // n/a where the two gather on different groups: no bound from bytes (byte_reduction_bound).
        return fixed(c.byte_ratio, 2) + " / " + fixed(100 * c.allgather_share, 0) + "% / " +
               (std::isnan(c.bound) ? std::string("n/a") : fixed(c.bound, 2) + "x");
      },
      out);
  print_breakdown(request.projection, result, out);
  print_time_split(result, out);
}

}  // namespace ciera::tools::simulate
