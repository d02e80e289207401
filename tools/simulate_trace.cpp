// `ciera simulate --trace FILE` and `--validate TRACE...`: baseline and CIERA iteration times
// predicted from traces of our own runs, and their error against the traces' measurements.
#include <array>
#include <cmath>
#include <iostream>
#include <tuple>
#include <utility>

#include "exit_status.hpp"
#include "report.hpp"
#include "simulate.hpp"

namespace ciera::tools::simulate {
namespace {

using namespace ciera::sim;

// `measured` is positive: the trace reader refuses any other.
double relative_error(double predicted, double measured) {
  return (predicted - measured) / measured;
}

std::string percent_text(double error) {
  // Appended, not `const char* + std::string`: GCC 12 warns (-Wrestrict) on that, falsely.
  std::string text = error >= 0 ? "+" : "";
  text += fixed(100 * error, 1);
  text += '%';
  return text;
}

nlohmann::json fit_json(const std::optional<CostCurve>& c) {
  if (!c) return nullptr;
  return {{"alpha_s", c->alpha_s}, {"GBps", c->bytes_per_s / 1e9}, {"sizes", c->sizes}};
}

nlohmann::json topology_json(const Trace& t) {
  if (!t.topology) return nullptr;
  const TraceTopology& g = *t.topology;
  return {{"nodes", g.nodes},
          {"ranks_per_node", g.ranks_per_node},
          {"reshard_after_forward", g.reshard_after_forward},
          {"hsdp", g.hsdp},
          {"shard_group", g.shard_group(t.world_size)},
          {"post_forward_group", g.post_forward_group(t.world_size)},
          {"backward_gathers", !g.keeps_gathered_after_forward(t.world_size)}};
}

std::string curve_text(const CostCurve& c) {
  return fixed(c.alpha_s * 1e3, 3) + " ms + bytes / " + fixed(c.bytes_per_s / 1e9, 4) + " GB/s";
}

nlohmann::json measured_json(const std::optional<MeasuredRun>& m, const Breakdown& b,
                             double allgather) {
  if (!m) return nullptr;
  return {{"iteration_s", m->iteration_s},
          {"allgather_s", m->allgather_s},
          {"predicted_iteration_s", b.total_s},
          {"predicted_allgather_s", allgather},
          {"error", relative_error(b.total_s, m->iteration_s)},
          {"allgather_error", relative_error(allgather, m->allgather_s)}};
}

nlohmann::json trace_json(const TraceResult& r) {
  const Trace& t = r.input->trace;
  const TracePrediction& p = r.prediction;
  nlohmann::json j = {
      {"trace", t.origin},
      {"config", t.describe()},
      {"schedule",
       {{"baseline", p.baseline_overlap ? "overlap" : "sequential"},
        {"ciera", p.ciera_overlap ? "overlap" : "sequential"},
        {"block_values", t.block_values}}},
      {"allgather_fit", fit_json(p.allgather)},
      {"reduce_scatter_fit", fit_json(p.reduce_scatter)},
      {"allgather_post_forward_fit", fit_json(p.post_forward_allgather)},
      {"allreduce_fit", fit_json(p.allreduce)},
      {"topology", topology_json(t)},
      {"probe_allgather_fit", fit_json(p.probe_allgather)},
      {"probe_reduce_scatter_fit", fit_json(p.probe_reduce_scatter)},
      {"predicted", {{"baseline", breakdown_json(p.baseline)}, {"ciera", breakdown_json(p.ciera)}}},
      {"ciera_gather_terms_s",
       {{"comm", p.ciera_comm_s}, {"encode", p.ciera_encode_s}, {"decode", p.ciera_decode_s}}},
      {"predicted_speedup", p.baseline.total_s / p.ciera.total_s}};
  // As the text report: the byte ratio, and the bound from bytes alone where the two schedules
  // and links are alike (null where not).
  j["allgather_byte_ratio"] =
      p.ciera.allgather_bytes > 0 ? p.baseline.allgather_bytes / p.ciera.allgather_bytes : 1.0;
  const double bound = byte_reduction_bound(p.baseline, p.ciera);
  j["byte_reduction_bound"] = p.baseline_overlap == p.ciera_overlap && !std::isnan(bound)
                                  ? nlohmann::json(bound)
                                  : nlohmann::json(nullptr);
  j["measured"] = {
      {"baseline", measured_json(t.measured_baseline, p.baseline, p.baseline_allgather_s)},
      {"ciera", measured_json(t.measured_ciera, p.ciera, p.ciera_allgather_s)}};
  return j;
}

// A system's measured run beside its prediction, for the text reports.
struct SystemCheck {
  const char* label;
  const std::optional<MeasuredRun>& measured;
  const Breakdown& predicted;
  double predicted_allgather_s;
  bool overlap;
};

std::array<SystemCheck, 2> system_checks(const TraceResult& r) {
  const Trace& t = r.input->trace;
  const TracePrediction& p = r.prediction;
  return {SystemCheck{"baseline", t.measured_baseline, p.baseline, p.baseline_allgather_s,
                      p.baseline_overlap},
          SystemCheck{"CIERA", t.measured_ciera, p.ciera, p.ciera_allgather_s, p.ciera_overlap}};
}

// The trace's placement and the curves that go with it; empty without a "topology" or curves.
std::string topology_text(const Trace& t, const TracePrediction& p) {
  std::string s;
  if (t.topology) {
    const TraceTopology& g = *t.topology;
    s += "topology: " + std::to_string(g.nodes) + " node(s) x " + std::to_string(g.ranks_per_node) +
         " ranks; shard group of " + std::to_string(g.shard_group(t.world_size)) + " ranks" +
         (g.hsdp ? " (HSDP: replicated across nodes)" : "") + "; " +
         (g.keeps_gathered_after_forward(t.world_size)
              ? std::string("no backward gathers (reshard_after_forward 1: FSDP2 keeps the "
                            "parameters gathered after forward)")
          : g.post_forward_group(t.world_size)
              ? "backward gathers on post-forward groups of " +
                    std::to_string(g.reshard_after_forward) + " ranks"
              : std::string("backward gathers on the shard group")) +
         "\n";
  }
  if (p.post_forward_allgather) {
    s += "post-forward allgather cost curve fitted to " +
         std::to_string(t.post_forward_allgather_points.size()) +
         " points: " + curve_text(*p.post_forward_allgather) + "\n";
  }
  if (p.allreduce) {
    s += "all-reduce cost curve fitted to " + std::to_string(t.allreduce_points.size()) +
         " points: " + curve_text(*p.allreduce) + "\n";
  }
  return s;
}

void print_trace_setup(const Request& request, const TraceResult& r, std::ostream& out) {
  const Trace& t = r.input->trace;
  const TracePrediction& p = r.prediction;
  out << "ciera simulate: prediction from " << t.origin << " (" << t.describe() << ", "
      << t.buckets.size() << " buckets)\ncommand: " << request.command << "\n"
      << "allgather cost curve fitted to " << t.allgather_points.size()
      << " measured points: " << fixed(p.allgather.alpha_s * 1e3, 3) << " ms + bytes / "
      << fixed(p.allgather.bytes_per_s / 1e9, 4) << " GB/s\nreduce-scatter cost curve fitted to "
      << t.reduce_scatter_points.size() << " points: " << fixed(p.reduce_scatter.alpha_s * 1e3, 3)
      << " ms + bytes / " << fixed(p.reduce_scatter.bytes_per_s / 1e9, 4) << " GB/s\n"
      << topology_text(t, p) << "codec (of raw shard bytes): encode " << fixed(t.encode_GBps, 2)
      << " GB/s (detection included), decode " << fixed(t.decode_GBps, 2) << " GB/s\n"
      << "schedule: baseline " << (p.baseline_overlap ? "overlapped" : "sequential") << ", CIERA "
      << (p.ciera_overlap ? "overlapped" : "sequential") << " (overlapped: prefetch depth "
      << request.prefetch << "); reduce-scatters block; B = " << t.block_values << "\n";
  for (const auto& [name, curve] :
       {std::pair{"allgather", &p.allgather}, {"reduce-scatter", &p.reduce_scatter}}) {
    if (curve->sizes == 1) {
      out << "note: the " << name << " points are of one size: its curve goes through the origin "
          << "and every other size is extrapolated at that rate\n";
    }
  }
  if (p.probe_allgather) {
    out << "comm_probe (micro-benchmark, not used): allgather "
        << fixed(p.probe_allgather->alpha_s * 1e3, 3) << " ms + bytes / "
        << fixed(p.probe_allgather->bytes_per_s / 1e9, 4) << " GB/s\n";
  }
  out << "CIERA gather terms per step: Comm(wire) " << seconds_text(p.ciera_comm_s) << " s, encode "
      << seconds_text(p.ciera_encode_s) << " s, decode " << seconds_text(p.ciera_decode_s)
      << " s\n";
  if (t.topology) {  // where the exposed gathers and gradient collectives went
    for (const auto& [label, b] : {std::pair{"baseline", &p.baseline}, {"CIERA", &p.ciera}}) {
      out << label << ": exposed allgather forward " << seconds_text(b->exposed_allgather_forward_s)
          << " s, backward " << seconds_text(b->exposed_allgather_backward_s) << " s (across nodes "
          << seconds_text(b->exposed_allgather_inter_node_s) << " s); exposed gradient collectives "
          << seconds_text(b->exposed_reduce_scatter_s) << " s (all-reduce "
          << seconds_text(b->exposed_allreduce_s) << " s)\n";
    }
  }
  out << "\n";
}

void print_trace_prediction(const TraceResult& r, std::ostream& out) {
  const TracePrediction& p = r.prediction;
  std::vector<std::string> header = {"predicted"};
  for (const auto& h : kBreakdownHeader) header.push_back(h);
  Table table(header);
  std::vector<std::string> row = {"baseline (raw)"};
  for (auto& cell : breakdown_cells(p.baseline)) row.push_back(cell);
  table.add(row);
  row = {"CIERA"};
  for (auto& cell : breakdown_cells(p.ciera)) row.push_back(cell);
  table.add(row);
  // Over a step's gathers (gathers_per_step of each bucket, the backward ones at their post-forward
  // size), each coded one at its wire bytes or, if not smaller, raw: as the prediction sends them.
  const double byte_ratio =
      p.ciera.allgather_bytes > 0 ? p.baseline.allgather_bytes / p.ciera.allgather_bytes : 1.0;
  out << table.render() << "predicted speedup " << fixed(p.baseline.total_s / p.ciera.total_s, 3)
      << "x; allgather byte ratio " << fixed(byte_ratio, 3) << "x";
  const double bound = byte_reduction_bound(p.baseline, p.ciera);
  if (p.baseline_overlap == p.ciera_overlap && !std::isnan(bound)) {  // else the schedule or the
    out << "; bound from bytes alone " << fixed(bound, 3) << "x";  // groups differ, not bytes alone
  }
  out << "\n";
  for (const SystemCheck& s : system_checks(r)) {
    if (!s.measured) continue;
    const MeasuredRun& m = *s.measured;
    out << s.label << ": iteration measured " << seconds_text(m.iteration_s) << " s, predicted "
        << seconds_text(s.predicted.total_s) << " s, error "
        << percent_text(relative_error(s.predicted.total_s, m.iteration_s))
        << "; allgather measured " << seconds_text(m.allgather_s) << " s, predicted "
        << seconds_text(s.predicted_allgather_s) << " s, error "
        << percent_text(relative_error(s.predicted_allgather_s, m.allgather_s)) << "\n";
  }
}

// The largest |error| of predicted against measured iteration time over all traces.
double worst_error(const std::vector<TraceResult>& results) {
  double worst = 0;
  for (const TraceResult& r : results) {
    for (const SystemCheck& s : system_checks(r)) {
      if (s.measured)
        worst = std::max(worst, std::abs(relative_error(s.predicted.total_s,
                                                        s.measured->iteration_s)));
    }
  }
  return worst;
}

Table validation_table(const std::vector<TraceResult>& results) {
  Table table({"trace", "config", "system", "schedule", "measured s", "predicted s", "error",
               "AG measured s", "AG predicted s", "AG error"});
  for (const TraceResult& r : results) {
    const std::string& path = r.input->path;
    const std::string file = path.substr(path.find_last_of('/') + 1);
    const std::string config = r.input->trace.describe();
    bool any = false;
    for (const SystemCheck& s : system_checks(r)) {
      if (!s.measured) continue;
      any = true;
      const MeasuredRun& m = *s.measured;
      table.add({file, config, s.label, s.overlap ? "overlap" : "sequential",
                 seconds_text(m.iteration_s), seconds_text(s.predicted.total_s),
                 percent_text(relative_error(s.predicted.total_s, m.iteration_s)),
                 seconds_text(m.allgather_s), seconds_text(s.predicted_allgather_s),
                 percent_text(relative_error(s.predicted_allgather_s, m.allgather_s))});
    }
    if (!any) {
      table.add({file, config, "-", "-", "not measured",
                 seconds_text(r.prediction.baseline.total_s), "-", "-", "-", "-"});
    }
  }
  return table;
}

}  // namespace

std::vector<TraceResult> compute_traces(const Request& request) {
  std::vector<TraceResult> results;
  for (const TraceInput& input : request.traces) {
    results.push_back({&input, predict_trace(input.trace, request.prefetch)});
    // As the projection checks its own: a trace of nothing (every time and byte 0) predicted a
    // speedup of nan; figures past double's range would print as inf.
    const TracePrediction& p = results.back().prediction;
    for (const auto& [system, total] :
         {std::pair{"baseline", p.baseline.total_s}, std::pair{"CIERA", p.ciera.total_s}}) {
      if (!(std::isfinite(total) && total > 0 && total < 1e18)) {
        throw UsageError(input.trace.origin + ": predicts a " + system + " iteration of " +
                         extreme_seconds_text(total) +
                         ": the trace's times, bytes or throughputs leave nothing to simulate, "
                         "or are too extreme");
      }
    }
  }
  return results;
}

void render_trace(const Request& request, const TraceResult& result, std::ostream& out) {
  if (request.json) {
    nlohmann::json j = trace_json(result);
    j["command"] = request.command;
    j["kind"] = "trace";
    out << json_text(j) << std::endl;
    return;
  }
  print_trace_setup(request, result, out);
  print_trace_prediction(result, out);
}

void render_validation(const Request& request, const std::vector<TraceResult>& results,
                       std::ostream& out) {
  const double worst = worst_error(results);
  if (request.json) {
    nlohmann::json j;
    j["command"] = request.command;
    j["kind"] = "validation";
    j["traces"] = nlohmann::json::array();
    for (const TraceResult& r : results) j["traces"].push_back(trace_json(r));
    j["worst_abs_error"] = worst;
    out << json_text(j) << std::endl;
    return;
  }
  out << "ciera simulate --validate: predicted iteration time against the traces' measurements\n"
      << "command: " << request.command << "\n\n"
      << validation_table(results).render()
      << "worst |error| of iteration time: " << fixed(100 * worst, 1) << "%\n";
}

}  // namespace ciera::tools::simulate
