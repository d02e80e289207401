// The trace-driven simulator (docs/simulator.md): alpha-beta collectives, a ZeRO-3/FSDP schedule
// with prefetch, the shapes of six published MoE models, and the systems on top of them: ZeRO-3
// (raw), ZeRO++ (int8 weights, hierarchical partitioning, int4 gradients), SDP4Bit (4-bit weight
// differences), stateless exponent coding (ZipCCL's idea) and CIERA.
// Times are in seconds, sizes in bytes, bandwidths in GB/s (1e9 bytes per second).
//
// The API of the `ciera_sim` tool library (linked by the `ciera` tool and its tests), not of the
// core `ciera` library: it lives with the layer's sources and is not installed.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ciera/analysis.hpp"
#include "ciera/dtype.hpp"
#include "ciera/error.hpp"

namespace ciera::sim {

// ---- Shard types ---------------------------------------------------------------------------

// The categories are the analysis module's (ciera/analysis.hpp): the paper's five (§2.4) plus
// dense FFN and other.
using ciera::ShardType;
inline constexpr std::array<ShardType, kShardTypeCount> kAllShardTypes = {
    ShardType::kExpertFfn, ShardType::kAttention, ShardType::kRouter, ShardType::kNorm,
    ShardType::kEmbedding, ShardType::kDenseFfn,  ShardType::kOther};

// The inverse of ciera::to_string(ShardType); throws ConfigError naming the accepted names.
ShardType parse_shard_type(std::string_view name);

// ---- Cluster: links, GPU, kernel speeds ---------------------------------------------------

struct Link {
  double GBps = 0;       // achievable bus bandwidth (nccl-tests busbw), per GPU inside a node,
                         // per node between nodes
  double latency_s = 0;  // per ring step
};

struct Cluster {
  std::string name;
  std::string description;
  std::string gpu;  // name of the GPU preset
  int gpus_per_node = 1;
  Link intra;              // NVLink/NVSwitch; unused when gpus_per_node == 1
  Link inter;              // between nodes
  double peak_tflops = 0;  // dense BF16/FP16 peak of one GPU
  double hbm_GBps = 0;     // memory bandwidth of one GPU (optimizer step)
  double mfu = 0.4;        // model FLOPs utilisation of the compute
  // Kernel throughputs, all in GB/s of raw (16-bit) shard bytes processed.
  double detect_GBps = 0, encode_GBps = 0, decode_GBps = 0;  // CIERA
  double quantize_GBps = 0, dequantize_GBps = 0;             // ZeRO++
};

// The presets compiled in from src/sim/clusters.json (the one source of truth for their values).
std::string builtin_cluster_config();
std::vector<std::string> cluster_names(const std::string& config_json);
// Looks `name` up in a cluster config (same format as src/sim/clusters.json). `origin` names the
// file in error messages. Throws ConfigError for an unknown name or an invalid field.
Cluster load_cluster(const std::string& config_json, const std::string& name,
                     const std::string& origin = "built-in cluster config");
// ConfigError unless `world` GPUs fit in one node of `cluster` or fill whole nodes; `advice`
// (e.g. the options to change) is appended to its message.
void require_whole_nodes(const Cluster& cluster, int world, const std::string& advice = "");

// ---- Collectives (alpha-beta) -------------------------------------------------------------

enum class Algorithm { kRing, kHierarchical };
Algorithm parse_algorithm(std::string_view name);

// One ring over `ranks` peers on `link`: (n-1)·alpha + (n-1)/n · bytes / bandwidth, where
// `total_bytes` is the allgather output (or reduce-scatter input) of one rank.
double ring_seconds(int ranks, double total_bytes, const Link& link);
// Allgather of `total_bytes` (output per rank) over `world` GPUs. Ring: one flat ring whose slowest
// hop is the inter-node link once it spans nodes. Hierarchical: an inter-node allgather among the
// GPUs of equal local rank (all sharing their node's link), then an intra-node allgather.
double allgather_seconds(const Cluster& cluster, int world, double total_bytes,
                         Algorithm algorithm);
// Reduce-scatter has the same cost as allgather of the same bytes (reduction arithmetic ignored).
double reduce_scatter_seconds(const Cluster& cluster, int world, double total_bytes,
                              Algorithm algorithm);
// Ring all-reduce of `total_bytes` per rank over `ranks` peers on `link`: a reduce-scatter ring,
// then an allgather ring, 2 x ring_seconds. HSDP's replicate all-reduce runs G of them at once, one
// per local rank, each on 1/G of the gradients; they share their node's link, so together they
// cost one all-reduce of the whole gradient over the nodes (as the hierarchical allgather's rings).
double allreduce_seconds(int ranks, double total_bytes, const Link& link);

// seconds = alpha_s + bytes / bytes_per_s, fitted by least squares to measured points.
struct CostPoint {
  double bytes = 0;
  double seconds = 0;
};
struct CostCurve {
  double alpha_s = 0;
  double bytes_per_s = 0;
  int sizes = 0;  // distinct sizes fitted (one: through the origin, any other size extrapolated)
  double seconds(double bytes) const { return bytes > 0 ? alpha_s + bytes / bytes_per_s : 0.0; }
};
// Points of the same size (identical buckets) are averaged first, so each size weighs the same. A
// negative intercept is clamped to 0 (slope refitted through the origin); a single size is fitted
// through the origin. Throws ConfigError when there are no points or the curve does not increase
// with bytes. `what` names the curve.
CostCurve fit_cost_curve(const std::vector<CostPoint>& points, const std::string& what);

// ---- Model zoo ----------------------------------------------------------------------------

struct ModelShape {
  std::string name;     // command-line name, e.g. "olmoe-1b-7b"
  std::string display;  // as in the paper's tables, e.g. "OLMoE-1B-7B"
  std::string source;   // where the shapes come from
  int layers = 0;
  int dense_layers = 0;  // leading layers with a dense FFN instead of experts
  int64_t hidden = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  int routed_experts = 0, experts_per_token = 0;
  int64_t expert_intermediate = 0;
  int64_t shared_intermediate = 0;  // all shared experts together (0: none)
  int64_t dense_intermediate = 0;   // FFN width of the dense layers
  int64_t vocab = 0;
  bool tied_embeddings = false;
  bool qk_norm_weights = false;     // q/k norm weights over the projection widths (OLMoE)
  bool qkv_bias = false;            // Qwen2
  bool shared_expert_gate = false;  // Qwen2: a hidden x 1 sigmoid gate
  double published_params = 0;      // the published total, for checking the shapes
  bool published_without_embeddings = false;
};

const std::vector<ModelShape>& model_zoo();
// Throws ConfigError listing the known names.
const ModelShape& find_model(std::string_view name);

// The parameters of one gather unit (FSDP/ZeRO-3 fetches one module's parameters at a time):
// the embedding, each transformer layer, the head (final norm + LM head).
struct ShardGroup {
  ShardType type;
  uint64_t values = 0;
};
struct GatherUnit {
  std::string name;
  std::vector<ShardGroup> shards;  // gathered before the unit runs
  uint64_t grad_values = 0;        // reduce-scattered after its backward (0 for a tied head)
  double forward_flops_per_token = 0;
  uint64_t gathered_values() const;
};
// Throws ConfigError unless 0 <= layers <= model.layers (0: all layers).
void check_layers(const ModelShape& model, int layers);
// Units in forward execution order. `layers` = 0 means all layers.
std::vector<GatherUnit> model_units(const ModelShape& model, int layers, int seq_len);
// Unique parameters (a tied embedding counted once).
uint64_t parameter_count(const ModelShape& model, bool with_embeddings = true);

// ---- Change rates -------------------------------------------------------------------------

struct TypeRate {
  double element = -1;  // fraction of values whose exponent changes per step (-1: unknown)
  double block = -1;    // fraction of B-value blocks with at least one change (-1: unknown)
  // The B `block` was measured at, where it is not the projection's (the paper's Fig. 4: 512);
  // 0: at the projection's B. The paper gives no other B, so its rates are used as they are.
  uint32_t block_at = 0;
  // "paper Fig. 4", "assumed", "trace FILE", "rates FILE"; after "; ", where the element rate
  // came from if not from there ("rates FILE; element from trace FILE").
  std::string source;
};
struct ChangeRates {
  uint32_t block_values = 512;
  std::array<TypeRate, kShardTypeCount> by_type;
  const TypeRate& of(ShardType type) const { return by_type[static_cast<int>(type)]; }
  TypeRate& of(ShardType type) { return by_type[static_cast<int>(type)]; }
  // The block rate, or 1 - (1 - element)^B (uniform changes) when only the element rate is known.
  double block_rate(ShardType type) const;
};
// Block change rates at B = 512 read from the paper's Fig. 4, or marked "assumed" where the
// paper gives none (docs/simulator.md, "Change rates").
ChangeRates paper_rates(const ModelShape& model);
// Overrides the types a measured-rates JSON names: {"expert_ffn": 0.004, ...} (element rates),
// optionally {"block": {"expert_ffn": 0.21, ...}, "block_values": 512}: the block rates and the
// B they were measured at (default: the projection's, `rates.block_values`, which the file never
// changes). At another B a type's block rate is derived from the file's element rate for it;
// without one, ConfigError. A type given a block rate alone keeps its element rate, and its
// source says where that came from ("rates FILE; element 0.51% assumed ..."). A file that gives
// no rate is a ConfigError.
void apply_rates_json(ChangeRates& rates, const std::string& json_text, const std::string& origin);

// ---- Schedule -----------------------------------------------------------------------------

// The cost of one unit under one system. "pre" runs before its gather on a side stream (CIERA's
// detect + encode, ZeRO++'s quantise); "post" runs after it, before the unit's compute can start
// (CIERA's decode, ZeRO++'s dequantise).
struct UnitCost {
  double forward_s = 0, backward_s = 0;  // compute
  double allgather_forward_s = 0, allgather_backward_s = 0;
  double reduce_scatter_s = 0;  // gradient collective incl. its kernels
  double allreduce_s = 0;       // HSDP: the replicate all-reduce after the reduce-scatter
  double pre_forward_s = 0, pre_backward_s = 0;
  double post_forward_s = 0, post_backward_s = 0;
  double allgather_forward_bytes = 0, allgather_backward_bytes = 0, reduce_scatter_bytes = 0;
  double allreduce_bytes = 0;  // all-reduce input per rank
  // Whether the gather's group spans nodes (its bytes cross the inter-node link), for the
  // breakdown's inter-node share; the times above already say what each gather costs.
  bool allgather_forward_inter_node = false, allgather_backward_inter_node = false;
  // What each gather runs on (gather_link()): gathers of one link cost the same per byte, plus a
  // latency; the byte-reduction bound is taken per link.
  uint64_t allgather_forward_link = 0, allgather_backward_link = 0;
};

// A gather link: a group of `ranks` GPUs, spanning nodes or not, gathering with `algorithm`.
inline uint64_t gather_link(int ranks, bool crosses_nodes, Algorithm algorithm) {
  return (static_cast<uint64_t>(ranks) << 8) | (crosses_nodes ? 4u : 0u) |
         static_cast<uint64_t>(algorithm);
}

struct ScheduleOptions {
  int prefetch_depth = 1;       // gathers in flight ahead of the running unit
  bool pre_from_start = false;  // "pre" may start at iteration start (CIERA: parameters are final
                                // after the previous step), else only when the gather is issued
  bool blocking_reduce_scatter = false;  // compute waits for each reduce-scatter to finish (CPU
                                         // ranks: FSDP2's reduce-scatter is a synchronous call)
  bool prefetch_into_backward = true;    // the last forward units prefetch the first backward
                                         // gathers; false (FSDP2): the first backward gather is
                                         // issued when the backward pass reaches its unit
};

// total = compute + exposed allgather + exposed reduce-scatter + exposed codec + optimizer; the
// other fields split those terms or count work whether exposed or hidden ("busy").
struct Breakdown {
  double total_s = 0;
  double compute_s = 0;
  double exposed_allgather_s = 0;
  double exposed_reduce_scatter_s = 0;  // every gradient collective (HSDP's all-reduce included)
  double exposed_codec_s = 0;  // CIERA codec or ZeRO++ (de)quantisation on the critical path
  double optimizer_s = 0;
  double allgather_busy_s = 0;  // sum of allgather durations, hidden or not
  double reduce_scatter_busy_s = 0;
  double allgather_bytes = 0;  // per iteration, forward + backward
  double reduce_scatter_bytes = 0;
  // Splits of exposed_allgather_s: by the pass whose unit waited, and the part waited on gathers
  // whose group spans nodes.
  double exposed_allgather_forward_s = 0, exposed_allgather_backward_s = 0;
  double exposed_allgather_inter_node_s = 0;
  double allgather_inter_node_busy_s = 0;  // of allgather_busy_s
  double allgather_inter_node_bytes = 0;   // of allgather_bytes
  double exposed_allreduce_s = 0;          // of exposed_reduce_scatter_s: HSDP's all-reduce
  double allreduce_busy_s = 0;             // not in reduce_scatter_busy_s
  double allreduce_bytes = 0;              // all-reduce input per rank, per iteration
  // Per gather link (UnitCost::allgather_*_link) with bytes: its busy seconds and bytes.
  struct LinkLoad {
    double busy_s = 0, bytes = 0;
  };
  std::map<uint64_t, LinkLoad> allgather_links;
  double encode_busy_s = 0;  // "pre" work: CIERA's detect + encode, ZeRO++'s quantise, ...
  double decode_busy_s = 0;  // "post" work: CIERA's decode, ZeRO++'s dequantise, ...
};

// Forward over units in order, then backward in reverse; one collective channel served in issue
// order; the optimizer step after the last reduce-scatter. A gather with no work at all (pre,
// collective and post all 0: a unit not re-gathered in backward) is ready when issued.
Breakdown simulate_iteration(const std::vector<UnitCost>& units, double optimizer_s,
                             const ScheduleOptions& options);

// ---- Gather schemes measured by `ciera bench codec` ------------------------------------------

// Throughputs as `ciera bench codec` measured them (one thread, GB/s of raw shard bytes), with
// CIERA's (its "ciera-auto" row) from the same run. They carry over to a cluster as ratios to
// CIERA's (docs/benchmarks.md: on a noisy machine ratios carry over, absolute times do not).
struct BenchThroughputs {
  double encode_GBps = 0, decode_GBps = 0;
  double ciera_encode_GBps = 0, ciera_decode_GBps = 0;
};

// What the simulator knows of one gather scheme's codec (docs/simulator.md, "Gather schemes").
struct SchemeFigures {
  std::string name;            // the --baseline name: "sdp4bit", "stateless"
  std::string row;             // its row in `ciera bench codec --json`'s "comparisons"
  std::optional<DType> dtype;  // the dtype its bits/value were measured in; nullopt: any (the
                               // scheme's format fixes them)
  double bits_per_value = 0;   // everything it puts on the wire, per value
  // nullopt: not measured; the cluster's ZeRO++ (de)quantise throughputs stand in.
  std::optional<BenchThroughputs> measured;
  std::string source;  // where the figures come from, for the report
};

struct GatherSchemes {
  SchemeFigures sdp4bit, stateless;
};

// The built-in figures (one table in src/sim/schemes.cpp, each with the command that measured
// it), used unless `--codec-bench FILE` replaces them.
GatherSchemes default_gather_schemes();

// Replaces the figures of `names` ("sdp4bit", "stateless"; others are ignored) by their rows of
// a `ciera bench codec --json` output (`origin` names it in errors), scaled by its "ciera-auto"
// row. Throws ConfigError naming the file and the row when a row is missing or malformed.
void apply_codec_bench(GatherSchemes& schemes, const std::string& json_text,
                       const std::string& origin, const std::vector<std::string>& names);

// A scheme's codec on one cluster: bits/value, and encode/decode throughputs in GB/s of raw
// bytes, the cluster's CIERA throughputs times the measured ratios (or, not measured, the
// cluster's quantize/dequantize throughputs).
struct GatherCodec {
  double bits_per_value = 0;
  double encode_GBps = 0, decode_GBps = 0;
};
// Throws ConfigError when the figures' bits/value were measured in another dtype than `dtype`.
GatherCodec gather_codec(const SchemeFigures& figures, const Cluster& cluster, DType dtype);

// ---- Systems on the model zoo -------------------------------------------------------------

enum class System { kZero3, kZeroPP, kCiera, kSdp4Bit, kStateless };
std::string_view system_name(System system);

// Where the lossless systems (ZeRO-3/FSDP2 and CIERA) run their collectives on N nodes of G GPUs
// (docs/simulator.md, "Topologies"):
// * flat: every gather and reduce-scatter over all W GPUs;
// * partial: FSDP2's reshard_after_forward = G: forward gathers over W, backward gathers over the
//   node's G GPUs (the 1/G shards kept after forward), reduce-scatter over W;
// * hsdp: shard within the node, replicate across nodes: every gather and the reduce-scatter over
//   the node's G GPUs, then an all-reduce of the 1/G gradient shard over the N nodes.
// On one node all three are the same.
enum class Topology { kFlat, kPartial, kHsdp };
// Throws ConfigError naming the accepted names.
Topology parse_topology(std::string_view name);
std::string_view topology_name(Topology topology);  // "flat", "partial", "hsdp"

struct Workload {
  int world = 8;
  DType dtype = DType::kBF16;
  int seq_len = 1024;
  int micro_batch = 1;
  int layers = 0;  // 0: all
  int prefetch_depth = 1;
  bool activation_checkpointing = true;  // the paper enables it (§4.1): backward recomputes forward
  Algorithm algorithm = Algorithm::kRing;  // for every gather but ZeRO++'s
  uint32_t zeropp_block_values = 4096;     // ZeRO++ int8 weight quantisation group
  uint32_t zeropp_grad_block_values = 4096;
  double optimizer_bytes_per_param = 32;  // mixed-precision Adam traffic per parameter
  // Mixed-precision Adam's model states in memory per parameter (ZeRO's 2 + 2 + 12: 16-bit
  // parameter and gradient, FP32 master weight and two moments), sharded over the shard group.
  double state_bytes_per_param = 16;
  Topology topology = Topology::kFlat;  // ZeRO-3 and CIERA only; the others have their own
  GatherSchemes schemes = default_gather_schemes();  // SDP4Bit's and stateless coding's codecs
};

struct Projection {
  System system;
  Topology topology = Topology::kFlat;
  Breakdown breakdown;
  // CIERA only: which shard types benefit-driven selection compressed (paper §3.2) in the gathers
  // of the shard group, and (partial resharding across nodes) in the backward gathers on the node,
  // a group of its own whose gains and costs are its own.
  std::array<bool, kShardTypeCount> selected{};
  std::array<bool, kShardTypeCount> selected_backward_on_node{};
  bool backward_on_node = false;  // partial resharding across nodes: backward gathers on the node
  // Per GPU: the model states over the shard group, plus what the configuration keeps besides
  // (partial resharding's 1/G post-forward copy, ZeRO++'s hpZ secondary copy), in bytes. CIERA's
  // exponent caches and activations are not counted.
  double state_bytes_per_gpu = 0;
};

Projection project(const ModelShape& model, const Cluster& cluster, const Workload& workload,
                   const ChangeRates& rates, System system);

// 1 / (1 - share * (1 - 1/ratio)): the speedup if the allgathers, busy for `share` of the
// iteration, shrank by exactly the byte ratio and nothing else changed. With the busy (not the
// exposed) share it bounds any schedule: shortening work by x shortens the iteration by <= x.
double byte_reduction_bound(double allgather_share, double byte_ratio);
// The same bound for two schedules of one model, taken per gather link (Breakdown::
// allgather_links): each link's gathers shrinking by its own byte ratio. One ratio pooled over
// links would move one link's shrink onto another's time, which costs another price per byte
// (under partial resharding, forward gathers across nodes shrink while backward ones inside the
// node may not; a trace's post-forward group has a curve of its own), and could fall below the
// speedup it bounds. Within a link every byte costs the same time (plus a latency that does not
// shrink), so its pooled ratio bounds it. NaN (no bound from bytes) where the two gather on
// different links: the placement, not the bytes, differs (ZeRO++'s hpZ, CIERA under HSDP).
double byte_reduction_bound(const Breakdown& baseline, const Breakdown& coded);

// ---- Traces (docs/simulator.md, "Trace format v1") -----------------------------------------

struct TraceShard {
  std::string name;
  ShardType type = ShardType::kOther;
  uint64_t values = 0;
  double change_rate = 0;         // element rate
  double block_change_rate = -1;  // optional
};
struct TraceBucket {
  std::string name;
  double forward_s = 0, backward_s = 0;
  double raw_bytes = 0, wire_bytes = 0, grad_bytes = 0;
  // Gathers of this bucket per step (optional, default 2: forward and backward; the FSDP root is
  // gathered once, and so is every unit with reshard_after_forward 1; at most 1024). The first is
  // placed in the forward pass, the rest in the backward pass.
  double gathers_per_step = 2;
  // Optional: CIERA's mean bytes per backward gather on the post-forward group (all its payloads;
  // nullopt: raw_bytes, sent raw), and HSDP's all-reduce input per rank (0: none).
  std::optional<double> post_forward_wire_bytes;
  double allreduce_bytes = 0;
  std::vector<TraceShard> shards;
};
// "topology" (optional): how the traced ranks were placed and sharded. Absent: every rank its own
// node (the link lab), one shard group of all ranks, no post-forward group, no HSDP.
struct TraceTopology {
  int nodes = 0, ranks_per_node = 0;  // nodes x ranks_per_node = world_size
  // FSDP2's reshard_after_forward as an integer: 0 = the whole shard group (no post-forward
  // group); 1 = no resharding after forward (no backward gather); else the size of the group the
  // backward gathers run on.
  int reshard_after_forward = 0;
  bool hsdp = false;  // shard within a node, replicate (all-reduce) across nodes
  int shard_group(int world_size) const { return hsdp ? ranks_per_node : world_size; }
  // The backward gathers run on a smaller group than the forward ones (2 or more ranks).
  bool post_forward_group(int world_size) const {
    return reshard_after_forward > 1 && reshard_after_forward < shard_group(world_size);
  }
  // FSDP2 reads the integer 1 as False ("reshard_after_forward=1 (int) means resharding
  // parameters to world size 1, instead of reshard_after_forward=True (bool)", torch's
  // _get_post_forward_mesh_info): each rank keeps the whole unit from its forward to its backward,
  // so there is no post-forward group and no backward gather to charge, on any curve.
  bool keeps_gathered_after_forward(int world_size) const {
    return reshard_after_forward == 1 && shard_group(world_size) > 1;
  }
};
struct MeasuredRun {
  double iteration_s = 0;
  double allgather_s = 0;
};
struct Trace {
  std::string origin;
  std::string family;
  uint64_t params = 0;
  int world_size = 0;
  DType dtype = DType::kBF16;
  std::string link_kind;
  double link_gbit = 0, link_latency_ms = 0;
  double encode_GBps = 0, decode_GBps = 0, detect_GBps = 0;
  std::vector<CostPoint> allgather_points, reduce_scatter_points;
  // Optional: the in-situ curves of the backward gathers on the post-forward group (required with
  // one) and of HSDP's all-reduce (required when a bucket has allreduce_bytes > 0).
  std::vector<CostPoint> post_forward_allgather_points, allreduce_points;
  std::optional<TraceTopology> topology;
  // "comm_probe" (optional): a micro-benchmark of the same collectives outside the training;
  // reported, not used for the prediction.
  std::vector<CostPoint> probe_allgather_points, probe_reduce_scatter_points;
  // "schedule" (optional): overlap false (default) = every gather and reduce-scatter blocks the
  // training loop (FSDP2 on CPU ranks); true = gathers in flight while the previous unit computes
  // (CCP), reduce-scatters still blocking. ciera_overlap (default: overlap) for the CIERA run
  // alone, where it differs from the baseline's (`ciera train --ablation`: CIERA with CCP).
  bool overlap = false;
  bool ciera_overlap = false;
  uint32_t block_values = 512;  // CIERA's B in the traced run (block_change_rate is at this B)
  double optimizer_s = 0;
  std::vector<TraceBucket> buckets;
  std::optional<MeasuredRun> measured_baseline, measured_ciera;
  std::string describe() const;  // "olmoe W=4 bf16 linklab 1 Gbit/s"
};

// Throws ConfigError naming the missing or invalid field ("buckets[2].forward_s").
Trace parse_trace(const std::string& json_text, const std::string& origin);
Trace load_trace(const std::string& path);
// Value-weighted change rates per shard type of the trace's shards (types it lacks stay as given).
// Block rates are taken only when the trace's B equals rates.block_values (else they are derived
// from the element rates, as for a rates file without block rates).
void apply_trace_rates(ChangeRates& rates, const Trace& trace);

struct TracePrediction {
  Breakdown baseline, ciera;
  CostCurve allgather, reduce_scatter;
  std::optional<CostCurve> post_forward_allgather, allreduce;      // when the trace has them
  std::optional<CostCurve> probe_allgather, probe_reduce_scatter;  // from comm_probe, if fittable
  bool baseline_overlap = false, ciera_overlap = false;            // the schedules simulated
  // Comparable to MeasuredRun::allgather_s: the time the training loop spent in (sequential) or
  // waiting for (overlapped) gathers per step, codec included.
  double baseline_allgather_s = 0, ciera_allgather_s = 0;
  // CIERA's gather terms summed over a step's gathers (busy time, hidden or not): Comm(wire bytes)
  // (raw bytes for buckets sent raw), encode of the own shard, decode of the peer shards.
  double ciera_comm_s = 0, ciera_encode_s = 0, ciera_decode_s = 0;
};
// Forward gathers (the first of gathers_per_step) take comm.allgather; the backward ones take
// comm.allgather_post_forward when the trace has a post-forward group; each bucket's reduce-
// scatter is followed by its all-reduce on comm.allreduce when allreduce_bytes > 0.
// The traced run's schedule (Trace::overlap / ciera_overlap); `prefetch_depth` applies to the
// overlapped one. Sequential: iteration = sum over gathers (Comm + codec) + compute +
// reduce-scatters + optimizer.
TracePrediction predict_trace(const Trace& trace, int prefetch_depth = 1);

// Reads a whole file; throws ConfigError naming it when it cannot be read.
std::string read_text_file(const std::string& path, const std::string& what);

}  // namespace ciera::sim
