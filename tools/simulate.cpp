// `ciera simulate`: iteration times of CIERA and the schemes it is compared with (ZeRO-3, ZeRO++,
// SDP4Bit, stateless exponent coding) projected from an alpha-beta model of a cluster and the
// shapes of a zoo model (the paper's Tables 1-2), or predicted from a trace written by
// `ciera train --trace`, and checked against the trace's measurements (docs/simulator.md). This
// file holds the options, their checks and the dispatch; the projection and the trace modes
// compute and render in simulate_projection.cpp and simulate_trace.cpp.
#include "simulate.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>

#include "ciera/config.hpp"
#include "commands.hpp"
#include "report.hpp"

namespace ciera::tools {
namespace simulate {
namespace {

using namespace ciera::sim;

std::string baseline_list(const std::string& last_word) {
  std::string list;
  for (size_t i = 0; i < kBaselineNames.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == kBaselineNames.size() ? " " + last_word + " " : ", ") +
            kBaselineNames[i];
  }
  return list;
}

// --topology: at least one, each once.
std::vector<Topology> parse_topologies(const std::vector<std::string>& names) {
  if (names.empty()) throw ConfigError("--topology needs at least one of flat, partial or hsdp");
  std::vector<Topology> topologies;
  for (const std::string& name : names) {
    Topology topology;
    try {
      topology = parse_topology(name);
    } catch (const ConfigError&) {
      throw ConfigError("unknown --topology \"" + name + "\" (expected flat, partial or hsdp)");
    }
    if (std::find(topologies.begin(), topologies.end(), topology) != topologies.end())
      throw ConfigError("--topology: " + name + " is given twice");
    topologies.push_back(topology);
  }
  return topologies;
}

// The checks that need no input file, whatever the mode.
void check_values(const Options& o) {
  if (o.gpus.empty()) throw ConfigError("--gpus needs at least one GPU count");
  for (int w : o.gpus) {
    if (w < 1) throw ConfigError("--gpus: " + std::to_string(w) + " is not a GPU count");
    // As a trace's world_size: projected at 1.00x with no communication before.
    if (w == 1)
      throw ConfigError("--gpus must be in 2..2^20 (1048576): one GPU runs no collective (got 1)");
    // A trace's world is at most 2^20 ranks too.
    if (w > (1 << 20))
      throw ConfigError("--gpus: " + std::to_string(w) + " is more than 2^20 (1048576) GPUs");
  }
  if (o.baselines.empty())
    throw ConfigError("--baseline needs at least one of " + baseline_list("or"));
  for (size_t i = 0; i < o.baselines.size(); ++i) {
    const std::string& name = o.baselines[i];
    if (std::find(kBaselineNames.begin(), kBaselineNames.end(), name) == kBaselineNames.end()) {
      throw ConfigError("unknown --baseline \"" + name + "\" (expected " + baseline_list("or") +
                        ")");
    }
    if (std::find(o.baselines.begin(), o.baselines.begin() + static_cast<std::ptrdiff_t>(i),
                  name) != o.baselines.begin() + static_cast<std::ptrdiff_t>(i))
      throw ConfigError("--baseline: " + name + " is given twice");
  }
  if (o.dtype != "auto" && parse_dtype(o.dtype) == DType::kFP32) {
    // The zoo's states, optimizer and baselines are those of 16-bit parameters (paper §4).
    throw ConfigError("--dtype must be auto, bf16 or fp16 (projections are of 16-bit parameters)");
  }
  if (o.seq_len < 1)
    throw ConfigError("--seq-len must be at least 1 (got " + std::to_string(o.seq_len) + ")");
  if (o.micro_batch < 1) {
    throw ConfigError("--micro-batch must be at least 1 (got " + std::to_string(o.micro_batch) +
                      ")");
  }
  if (o.layers < 0) {
    throw ConfigError("--layers must be at least 0 (0: all layers; got " +
                      std::to_string(o.layers) + ")");
  }
  if (o.prefetch < 0)
    throw ConfigError("--prefetch must be at least 0 (got " + std::to_string(o.prefetch) + ")");
  require_block_option(o.block);
  // 1 kbit/s .. 1 Pbit/s: beyond either the projected times overflow to infinity or vanish.
  if (o.gbit && !(*o.gbit >= 1e-6 && *o.gbit <= 1e6))
    throw ConfigError("--gbit must be in 1e-6..1e6 (Gbit/s)");
  // Up to 1000 s a step: beyond, the projected times overflow or swamp everything else.
  if (o.latency_ms && !(std::isfinite(*o.latency_ms) && *o.latency_ms >= 0 && *o.latency_ms <= 1e6))
    throw ConfigError("--latency-ms must be in 0..1e6 (ms)");
  // As a cluster config's gpus_per_node.
  if (o.gpus_per_node && !(*o.gpus_per_node >= 1 && *o.gpus_per_node <= 1024))
    throw ConfigError("--gpus-per-node must be in 1..1024");
  if (o.mfu && !(*o.mfu > 0 && *o.mfu <= 1)) throw ConfigError("--mfu must be in (0, 1]");
  parse_algorithm(o.algorithm);
  parse_topologies(o.topologies);
  for (size_t i = 0; i < o.gpus.size(); ++i) {
    if (std::find(o.gpus.begin(), o.gpus.begin() + static_cast<std::ptrdiff_t>(i), o.gpus[i]) !=
        o.gpus.begin() + static_cast<std::ptrdiff_t>(i))
      throw ConfigError("--gpus: " + std::to_string(o.gpus[i]) + " is given twice");
  }
  if (!o.validate.empty() && !o.trace_file.empty())
    throw ConfigError("--validate and --trace: give one (--validate takes every trace)");
  const bool predicts_traces = !o.validate.empty() || (!o.trace_file.empty() && o.model.empty());
  if (predicts_traces && o.topologies != std::vector<std::string>{"flat"}) {
    throw ConfigError(
        "--topology applies to projections (--model); a trace's placement is its \"topology\" "
        "field");
  }
  // A trace is predicted from its own measurements: an option of the projection would be ignored.
  static const std::vector<std::string> projection_only = {
      "--gpus",       "--baseline",      "--dtype",   "--seq-len",        "--micro-batch",
      "--layers",     "--block",         "--cluster", "--cluster-config", "--gbit",
      "--latency-ms", "--gpus-per-node", "--mfu",     "--algo",           "--no-checkpointing",
      "--rates",      "--codec-bench"};
  if (!o.validate.empty() && !o.model.empty())
    throw ConfigError("--validate and --model: give one (--validate predicts the traced runs)");
  for (const std::string& name : o.given) {
    const bool applies_to_traces =
        std::find(projection_only.begin(), projection_only.end(), name) == projection_only.end();
    if (predicts_traces && !applies_to_traces) {
      throw ConfigError(name + " applies to projections (--model); " +
                        (o.validate.empty() ? "--trace alone" : "--validate") +
                        " predicts from the trace's own measurements and setup");
    }
  }
}

Cluster resolve_cluster(const Options& o) {
  const std::string config = o.cluster_config.empty()
                                 ? builtin_cluster_config()
                                 : read_text_file(o.cluster_config, "cluster config");
  Cluster c = load_cluster(
      config, o.cluster,
      o.cluster_config.empty() ? "built-in cluster config" : "cluster config " + o.cluster_config);
  if (o.gbit) c.inter.GBps = *o.gbit / 8.0;
  if (o.latency_ms) c.inter.latency_s = *o.latency_ms * 1e-3;
  if (o.gpus_per_node) {
    if (*o.gpus_per_node > 1 && c.intra.GBps <= 0) {
      throw ConfigError("cluster " + c.name + " has no intra-node link to put " +
                        std::to_string(*o.gpus_per_node) + " GPUs per node on");
    }
    c.gpus_per_node = *o.gpus_per_node;
  }
  if (o.mfu) c.mfu = *o.mfu;
  return c;
}

// Reads a trace and fits its cost curves as the prediction will, so that a trace that cannot be
// predicted is rejected before any work.
TraceInput load_trace_input(const std::string& path) {
  TraceInput input{path, load_trace(path)};
  const Trace& t = input.trace;
  fit_cost_curve(t.allgather_points, t.origin + ": comm.allgather");
  fit_cost_curve(t.reduce_scatter_points, t.origin + ": comm.reduce_scatter");
  if (!t.post_forward_allgather_points.empty()) {
    fit_cost_curve(t.post_forward_allgather_points, t.origin + ": comm.allgather_post_forward");
  }
  if (!t.allreduce_points.empty())
    fit_cost_curve(t.allreduce_points, t.origin + ": comm.allreduce");
  return input;
}

std::vector<Baseline> resolve_baselines(const Options& o) {
  std::vector<Baseline> baselines;
  for (const std::string& name : o.baselines) {
    // The paper's Table 1 compares with ZeRO-3 in BF16, Table 2 with ZeRO++ in FP16 (ZeRO++
    // requires FP16); "auto" follows it, and takes BF16 for SDP4Bit and stateless coding, whose
    // figures are BF16's (ZipCCL codes BF16 exponents). An explicit --dtype applies to all.
    System system = System::kZero3;
    if (name == "zeropp") system = System::kZeroPP;
    if (name == "sdp4bit") system = System::kSdp4Bit;
    if (name == "stateless") system = System::kStateless;
    const DType automatic = system == System::kZeroPP ? DType::kFP16 : DType::kBF16;
    baselines.push_back({system, o.dtype == "auto" ? automatic : parse_dtype(o.dtype), name});
  }
  return baselines;
}

// The built-in figures of SDP4Bit and stateless coding, or --codec-bench's rows for the
// baselines asked for; each is resolved on the cluster in every dtype it is projected in, so that
// figures measured in another dtype are refused before any work.
GatherSchemes resolve_schemes(const Options& o, const std::vector<Baseline>& baselines,
                              const Cluster& cluster) {
  GatherSchemes schemes = default_gather_schemes();
  if (!o.codec_bench_file.empty()) {
    // Its rows are only SDP4Bit's and stateless coding's figures: without those baselines it
    // would be read for nothing, and silently.
    require(std::any_of(baselines.begin(), baselines.end(),
                        [](const Baseline& b) {
                          return b.system == System::kSdp4Bit || b.system == System::kStateless;
                        }),
            "--codec-bench gives the figures of the sdp4bit and stateless baselines: ask for one "
            "of them with --baseline, or leave --codec-bench out");
    apply_codec_bench(schemes, read_text_file(o.codec_bench_file, "codec bench"),
                      "codec bench " + o.codec_bench_file, o.baselines);
  }
  for (const Baseline& b : baselines) {
    if (b.system == System::kSdp4Bit) gather_codec(schemes.sdp4bit, cluster, b.dtype);
    if (b.system == System::kStateless) gather_codec(schemes.stateless, cluster, b.dtype);
  }
  return schemes;
}

// The models and the change rates each is projected with: the paper's, then the trace's, then
// the rates file's, in increasing precedence (docs/simulator.md, "Change rates").
std::vector<ModelInput> resolve_models(const Options& o, const std::optional<Trace>& trace) {
  std::vector<const ModelShape*> models;
  if (o.model.empty() || o.model == "all") {
    for (const ModelShape& m : model_zoo()) models.push_back(&m);
  } else {
    models.push_back(&find_model(o.model));
  }
  const std::string rates_json =
      o.rates_file.empty() ? "" : read_text_file(o.rates_file, "rates file");
  std::vector<ModelInput> inputs;
  for (const ModelShape* model : models) {
    check_layers(*model, o.layers);
    ChangeRates rates = paper_rates(*model);
    rates.block_values = o.block;
    if (trace) apply_trace_rates(rates, *trace);
    if (!rates_json.empty()) apply_rates_json(rates, rates_json, "rates " + o.rates_file);
    std::optional<DType> trace_dtype;
    if (trace && std::any_of(kAllShardTypes.begin(), kAllShardTypes.end(), [&](ShardType type) {
          return rates.of(type).source == trace->origin;
        }))
      trace_dtype = trace->dtype;
    inputs.push_back({model, rates, trace_dtype});
  }
  return inputs;
}

ProjectionRequest parse_projection(const Options& o) {
  ProjectionRequest p;
  p.cluster = resolve_cluster(o);
  p.algorithm = o.algorithm;
  p.gpus = o.gpus;
  // The projection refuses these too; here, before any work, with the options to change.
  const std::string per_node = std::to_string(std::max(1, p.cluster.gpus_per_node));
  for (int w : o.gpus) {
    require_whole_nodes(p.cluster, w,
                        ": give --gpus in multiples of " + per_node + ", or set --gpus-per-node");
  }
  p.baselines = resolve_baselines(o);
  p.workload.schemes = resolve_schemes(o, p.baselines, p.cluster);
  p.workload.seq_len = o.seq_len;
  p.workload.micro_batch = o.micro_batch;
  p.workload.layers = o.layers;
  p.workload.prefetch_depth = o.prefetch;
  p.workload.activation_checkpointing = !o.no_checkpointing;
  p.workload.algorithm = parse_algorithm(o.algorithm);
  p.topologies = parse_topologies(o.topologies);
  std::optional<Trace> trace;
  if (!o.trace_file.empty()) trace = load_trace(o.trace_file);
  p.models = resolve_models(o, trace);
  return p;
}

int run(const Request& request) {
  switch (request.mode) {
    case Mode::kPrintClusterConfig:
      std::cout << builtin_cluster_config();
      break;
    case Mode::kValidate:
      render_validation(request, compute_traces(request), std::cout);
      break;
    case Mode::kTrace:
      render_trace(request, compute_traces(request).front(), std::cout);
      break;
    case Mode::kProjection:
      render_projection(request, compute_projection(request.projection), std::cout);
      break;
  }
  return 0;
}

}  // namespace

const std::vector<std::string> kBaselineNames = {"zero3", "zeropp", "sdp4bit", "stateless"};

Request parse(const Options& o, const std::string& command) {
  check_values(o);
  Request r;
  r.command = command;
  r.json = o.json;
  r.prefetch = o.prefetch;
  if (o.print_cluster_config) {
    r.mode = Mode::kPrintClusterConfig;
  } else if (!o.validate.empty()) {
    r.mode = Mode::kValidate;
    for (const std::string& path : o.validate) r.traces.push_back(load_trace_input(path));
    // Nothing measured would validate as a worst error of 0%: a check that cannot fail.
    require(std::any_of(r.traces.begin(), r.traces.end(),
                        [](const TraceInput& t) {
                          return t.trace.measured_baseline || t.trace.measured_ciera;
                        }),
            "--validate: no trace given has a measurement (\"measured\"), so there is nothing "
            "to compare the predictions with; --trace FILE predicts a run without one");
  } else if (!o.trace_file.empty() && o.model.empty()) {
    r.mode = Mode::kTrace;
    r.traces.push_back(load_trace_input(o.trace_file));
  } else {
    r.mode = Mode::kProjection;
    r.projection = parse_projection(o);
  }
  return r;
}

std::string seconds_text(double s) { return fixed(s, s < 1 ? 4 : 3); }

std::string extreme_seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g s", s);
  return text;
}

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
          {"reduce_scatter_bytes", b.reduce_scatter_bytes},
          {"exposed_allgather_forward_s", b.exposed_allgather_forward_s},
          {"exposed_allgather_backward_s", b.exposed_allgather_backward_s},
          {"exposed_allgather_inter_node_s", b.exposed_allgather_inter_node_s},
          {"allgather_inter_node_busy_s", b.allgather_inter_node_busy_s},
          {"allgather_inter_node_bytes", b.allgather_inter_node_bytes},
          {"exposed_allreduce_s", b.exposed_allreduce_s},
          {"allreduce_busy_s", b.allreduce_busy_s},
          {"allreduce_bytes", b.allreduce_bytes},
          {"encode_busy_s", b.encode_busy_s},
          {"decode_busy_s", b.decode_busy_s}};
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

}  // namespace simulate

void register_simulate(CLI::App& app, const std::string& command) {
  auto o = std::make_shared<simulate::Options>();
  CLI::App* cmd = app.add_subcommand(
      "simulate",
      "Project CIERA's iteration times against ZeRO-3 / ZeRO++ / SDP4Bit / stateless coding "
      "(model zoo) or predict them from a trace");
  cmd->add_option("--model", o->model,
                  "zoo model, or all (default: all; with --trace alone: the traced run)");
  cmd->add_option("--gpus", o->gpus, "GPU counts, comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--baseline", o->baselines, "zero3, zeropp, sdp4bit, stateless (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--dtype", o->dtype,
                  "auto (fp16 vs zeropp, as the paper; bf16 vs the others) | bf16 | fp16")
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
  cmd->add_option("--topology", o->topologies,
                  "ZeRO-3's and CIERA's placements, comma-separated: flat | partial "
                  "(reshard_after_forward = GPUs per node) | hsdp (shard in a node, replicate "
                  "across nodes)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_flag("--no-checkpointing", o->no_checkpointing,
                "backward without recomputing the forward");
  cmd->add_option("--rates", o->rates_file,
                  "measured change rates JSON (overrides paper/trace rates)");
  cmd->add_option("--codec-bench", o->codec_bench_file,
                  "`ciera bench codec --json` output: sdp4bit's and stateless's bits/value and "
                  "throughputs (rows \"sdp4bit\", \"stateless\", scaled by \"ciera-auto\")");
  cmd->add_option("--trace", o->trace_file,
                  "trace (format v1): predict it, or with --model take its change rates");
  cmd->add_option("--validate", o->validate,
                  "traces to compare predicted with measured iteration times")
      ->expected(1, -1);
  cmd->add_flag("--print-cluster-config", o->print_cluster_config,
                "print the built-in cluster presets JSON");
  cmd->add_flag("--json", o->json, "print one JSON object on one line");
  cmd->callback([o, command, cmd]() {
    for (const CLI::Option* option : cmd->get_options()) {
      if (option->count() > 0 && !option->get_lnames().empty())
        o->given.push_back("--" + option->get_lnames().front());
    }
    const simulate::Request request = parse_step([&] { return simulate::parse(*o, command); });
    throw CommandExit(simulate::run(request));
  });
}

}  // namespace ciera::tools
