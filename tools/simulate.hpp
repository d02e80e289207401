// `ciera simulate` (docs/simulator.md) in its three steps: the options CLI11 fills in are parsed
// into a Request (every check, and every input file read, before any work), the Request is
// computed into a result, and the result is rendered as tables or one JSON object.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "sim/sim.hpp"

namespace ciera::tools::simulate {

// The command line as CLI11 binds it: raw values, not yet checked.
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
  std::vector<std::string> topologies = {"flat"};
  bool no_checkpointing = false;
  std::string rates_file;
  std::string codec_bench_file;
  std::string trace_file;
  std::vector<std::string> validate;
  bool print_cluster_config = false;
  bool json = false;
  std::vector<std::string> given;  // the options on the command line, by name ("--gbit")
};

// ---- Projection (--model) -------------------------------------------------------------------

struct Baseline {
  sim::System system;
  DType dtype;
  std::string key;  // "zero3" | "zeropp" | "sdp4bit" | "stateless", as in the JSON
};

// The --baseline names, in the order the help and the errors list them.
extern const std::vector<std::string> kBaselineNames;

// A zoo model with the change rates it is projected with (paper, trace, rates file).
struct ModelInput {
  const sim::ModelShape* model;
  sim::ChangeRates rates;
  // The dtype the trace (--trace) measured its change rates in, where some of `rates` are still
  // the trace's (a rates file may replace them all); projections in another dtype say so.
  std::optional<DType> trace_dtype;
};

struct ProjectionRequest {
  sim::Cluster cluster;
  sim::Workload workload;  // world and dtype are set per configuration; its schemes are the
                           // built-in ones or --codec-bench's
  std::string algorithm;   // as given, for the report
  // ZeRO-3's and CIERA's placements (--topology); the other baselines are projected once, as
  // their own design places them (ZeRO++'s hpZ, flat otherwise).
  std::vector<sim::Topology> topologies = {sim::Topology::kFlat};
  std::vector<int> gpus;
  std::vector<Baseline> baselines;
  std::vector<ModelInput> models;
};

// One system on one configuration: a row of the breakdown table and of "results".
struct ProjectionRun {
  const ModelInput* model;
  int gpus;
  DType dtype;
  sim::System system;
  std::string key;  // "ciera" or the baseline's key
  sim::Projection projection;
};

// CIERA on one topology against one baseline (ZeRO-3: on the same topology) on one
// configuration.
struct Comparison {
  const Baseline* baseline;
  const ModelInput* model;
  int gpus;
  sim::Topology topology;
  double speedup;
  double byte_ratio;
  double allgather_share;  // busy share of the baseline iteration
  double bound;            // speedup from byte reduction alone
};

struct ProjectionResult {
  std::vector<ProjectionRun> runs;  // in the order the tables list them
  std::vector<Comparison> comparisons;
};

// ---- Trace prediction (--trace) and validation (--validate) ----------------------------------

struct TraceInput {
  std::string path;
  sim::Trace trace;
};

struct TraceResult {
  const TraceInput* input;
  sim::TracePrediction prediction;
};

// ---- The request ----------------------------------------------------------------------------

enum class Mode { kPrintClusterConfig, kProjection, kTrace, kValidate };

struct Request {
  Mode mode = Mode::kProjection;
  std::string command;  // as typed, for the report
  bool json = false;
  int prefetch = 1;
  ProjectionRequest projection;
  std::vector<TraceInput> traces;  // --trace (with or without --model), or --validate's
};

// Checks every option and reads every input file (cluster config, rates, traces); throws
// ConfigError naming the option or the file and field.
Request parse(const Options& options, const std::string& command);

ProjectionResult compute_projection(const ProjectionRequest& request);
void render_projection(const Request& request, const ProjectionResult& result, std::ostream& out);

std::vector<TraceResult> compute_traces(const Request& request);
void render_trace(const Request& request, const TraceResult& result, std::ostream& out);
void render_validation(const Request& request, const std::vector<TraceResult>& results,
                       std::ostream& out);

// ---- Shared by the renderers ----------------------------------------------------------------

std::string seconds_text(double seconds);
// A time that may be absurd (1e62 s, nan) for an error message: "%.3g s".
std::string extreme_seconds_text(double seconds);
nlohmann::json breakdown_json(const sim::Breakdown& breakdown);
std::vector<std::string> breakdown_cells(const sim::Breakdown& breakdown);
extern const std::vector<std::string> kBreakdownHeader;

}  // namespace ciera::tools::simulate
