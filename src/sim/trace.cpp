// Trace format v1 (docs/simulator.md): the reader, which rejects anything else by naming the
// missing or invalid field, and the prediction of baseline and CIERA iteration times from it.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "ciera/codec.hpp"
#include "sim/json_fields.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

using detail::Fields;
using detail::Json;

std::vector<CostPoint> read_points(const Fields& comm, const char* key) {
  const Json& array = comm.array(key);
  if (array.empty())
    comm.fail("field \"" + comm.path_of(key) + "\"", "must hold at least one measured point");
  std::vector<CostPoint> points;
  for (size_t i = 0; i < array.size(); ++i) {
    const Fields point = comm.element(array, key, i);
    points.push_back({point.non_negative("bytes"), point.non_negative("seconds")});
  }
  return points;
}

// Like read_points, but the array may be missing or empty (comm_probe is descriptive).
std::vector<CostPoint> read_optional_points(const Fields& comm, const char* key) {
  if (!comm.has(key)) return {};
  const Json& array = comm.array(key);
  std::vector<CostPoint> points;
  for (size_t i = 0; i < array.size(); ++i) {
    const Fields point = comm.element(array, key, i);
    points.push_back({point.non_negative("bytes"), point.non_negative("seconds")});
  }
  return points;
}

// Positive: the error of a prediction is relative to these, and a step of no time measured none.
MeasuredRun read_measured(const Fields& run) {
  const MeasuredRun m{run.positive("iteration_s"), run.positive("allgather_s")};
  // The time a step waited for its gathers is part of the step.
  if (m.allgather_s > m.iteration_s) {
    run.fail("field \"" + run.path_of("allgather_s") + "\"",
             "(" + std::to_string(m.allgather_s) + " s) is more than iteration_s (" +
                 std::to_string(m.iteration_s) + " s), which holds it");
  }
  return m;
}

void read_schedule(const Fields& schedule, Trace& trace) {
  if (schedule.has("overlap")) trace.overlap = schedule.boolean("overlap");
  trace.ciera_overlap =
      schedule.has("ciera_overlap") ? schedule.boolean("ciera_overlap") : trace.overlap;
  if (schedule.has("block_values")) trace.block_values = schedule.block_values("block_values");
}

TraceShard read_shard(const Fields& s) {
  TraceShard shard;
  shard.name = s.string("name");
  try {
    shard.type = parse_shard_type(s.string("type"));
  } catch (const ConfigError& e) {
    s.fail("field \"" + s.path_of("type") + "\"", std::string("is invalid: ") + e.what());
  }
  shard.values = s.count("values");
  shard.change_rate = s.fraction("change_rate");
  // Not checked against change_rate: with a partial last block a block rate may be the lower
  // (513 values at B = 512, all of block 0 changed: 0.5 of blocks, 0.998 of values).
  if (s.has("block_change_rate")) shard.block_change_rate = s.fraction("block_change_rate");
  return shard;
}

// "topology": nodes x ranks_per_node must be the world; reshard_after_forward must divide the
// shard group (FSDP2 asks the same of its integer), which HSDP makes the node.
TraceTopology read_topology(const Fields& t, int world_size) {
  TraceTopology topology;
  const uint64_t nodes = t.count("nodes"), ranks_per_node = t.count("ranks_per_node");
  if (nodes < 1 || nodes > (1u << 20))
    t.fail("field \"" + t.path_of("nodes") + "\"", "must be in 1..2^20 (1048576)");
  if (ranks_per_node < 1 || ranks_per_node > (1u << 20))
    t.fail("field \"" + t.path_of("ranks_per_node") + "\"", "must be in 1..2^20 (1048576)");
  if (nodes * ranks_per_node != static_cast<uint64_t>(world_size)) {
    t.fail("field \"" + t.path_of("nodes") + "\"",
           "x ranks_per_node must be world_size (got " + std::to_string(nodes) + " x " +
               std::to_string(ranks_per_node) + ", world_size " + std::to_string(world_size) + ")");
  }
  topology.nodes = static_cast<int>(nodes);
  topology.ranks_per_node = static_cast<int>(ranks_per_node);
  if (t.has("hsdp")) topology.hsdp = t.boolean("hsdp");
  // HSDP shards inside each node: a node of one rank leaves a shard group that gathers nothing.
  if (topology.hsdp && topology.ranks_per_node < 2) {
    t.fail("field \"" + t.path_of("hsdp") + "\"",
           "is true with one rank per node: the shard group (the node) would be one rank, which "
           "gathers nothing");
  }
  if (t.has("reshard_after_forward")) {
    const uint64_t group = t.count("reshard_after_forward");
    const int shard = topology.shard_group(world_size);
    if (group > 0 && (group > static_cast<uint64_t>(shard) || shard % group != 0)) {
      t.fail("field \"" + t.path_of("reshard_after_forward") + "\"",
             "must be 0 or divide the shard group of " + std::to_string(shard) + " ranks (got " +
                 std::to_string(group) + ")");
    }
    topology.reshard_after_forward = static_cast<int>(group);
  }
  return topology;
}

// A byte count for a message: the integer where it is one, else as JSON would print it.
std::string bytes_text(double bytes) {
  if (bytes >= 0 && bytes <= Fields::kLargest && bytes == std::floor(bytes))
    return std::to_string(static_cast<uint64_t>(bytes));
  return detail::describe_json(Json(bytes));
}

// Bytes of the header of one rank's envelope, the unit the engine sends for one gather of one
// bucket: 24 fixed bytes and one 8-byte length per parameter (docs/format.md, "Engine protocol",
// step 2; envelope_header_bytes in src/engine/envelope.hpp, a layer the simulator does not see).
double envelope_header_bytes(size_t params) { return 24.0 + 8.0 * static_cast<double>(params); }

// Room for one rank's control records in a gather's mean bytes (GatherStats::control_bytes;
// docs/format.md, "Engine protocol", steps 1 and 4, and what a gather costs on the wire): its
// round's 1040-byte control record and 8 x 128 bytes of verdicts (RoundControl and RoundVerdicts
// in src/engine/control.hpp, a layer the simulator does not see), and a key-frame round's second
// of each. Not a maximum for every gather: one that resynchronises and then fails a verdict takes
// a third record, and one left out of a round while a peer was not ready is charged a share of
// that round too; but the bound is applied to a mean over the steps after warmup, where such
// gathers are rare.
constexpr double kControlBytesPerRank = 2 * (1040.0 + 1024.0);

// The most a gather of `bucket` on a group of `ranks` can put on the wire, all ranks' envelopes
// and control records together (`ciera train --trace` counts both, as its own wire figures do):
// each rank's header, then each of its shards as raw bytes or the codec's largest payload
// (max_payload_bytes, docs/format.md "Size bound"), whichever is larger, as the engine sizes an
// envelope (envelope_bound), then its control records. FSDP2 pads every parameter to a multiple
// of the group, so a shard's `values` (all ranks') split evenly; the ceiling keeps this a bound
// where they do not.
double wire_bytes_bound(const TraceBucket& bucket, DType dtype, uint32_t block_values, int ranks) {
  const double value_bytes = dtype_info(dtype).value_bytes;
  double per_rank = envelope_header_bytes(bucket.shards.size()) + kControlBytesPerRank;
  for (const TraceShard& shard : bucket.shards) {
    const uint64_t n = (shard.values + static_cast<uint64_t>(ranks) - 1) / ranks;
    // Beyond kMaxShardValues the codec has no bound; such a shard travels raw (and a raw_bytes
    // that large is refused anyway).
    const double coded =
        n <= kMaxShardValues ? static_cast<double>(max_payload_bytes(dtype, n, block_values)) : 0.0;
    per_rank += std::max(static_cast<double>(n) * value_bytes, coded);
  }
  return per_rank * ranks;
}

// How often a bucket may be gathered per step. FSDP2 gathers a unit at most twice a step (forward,
// and again in backward after resharding); gradient accumulation multiplies that by the
// micro-batches. 1024 is far past any such run, and keeps a mistyped count (1e18) from being
// predicted as 1e18 gathers.
constexpr double kMaxGathersPerStep = 1024;

// `trace` holds what was read before the buckets (dtype, topology, schedule): a bucket's bytes are
// checked against its shards, its wire bytes against the engine's bound on each group.
TraceBucket read_bucket(const Fields& b, const Trace& trace) {
  TraceBucket bucket;
  bucket.name = b.string("name");
  bucket.forward_s = b.non_negative("forward_s");
  bucket.backward_s = b.non_negative("backward_s");
  bucket.raw_bytes = b.non_negative("raw_bytes");
  bucket.wire_bytes = b.non_negative("wire_bytes");
  bucket.grad_bytes = b.non_negative("grad_bytes");
  // reshard_after_forward 1: FSDP2 keeps the unit gathered from its forward to its backward, so
  // a step gathers it once (TraceTopology::keeps_gathered_after_forward).
  const bool gathered_once =
      trace.topology && trace.topology->keeps_gathered_after_forward(trace.world_size);
  if (gathered_once) bucket.gathers_per_step = 1;
  if (b.has("gathers_per_step")) {
    bucket.gathers_per_step = b.non_negative("gathers_per_step");
    if (bucket.gathers_per_step > kMaxGathersPerStep) {
      b.fail("field \"" + b.path_of("gathers_per_step") + "\"",
             "must be at most 1024 gathers per step (got " +
                 detail::describe_json(b.required("gathers_per_step")) + ")");
    }
    if (gathered_once && bucket.gathers_per_step > 1) {
      b.fail(
          "field \"" + b.path_of("gathers_per_step") + "\"",
          "must be at most 1 with topology.reshard_after_forward 1 (got " +
              detail::describe_json(b.required("gathers_per_step")) +
              "): FSDP2 keeps the parameters gathered after forward, so no backward gather runs");
    }
  }
  if (b.has("post_forward_wire_bytes"))
    bucket.post_forward_wire_bytes = b.non_negative("post_forward_wire_bytes");
  if (b.has("allreduce_bytes")) bucket.allreduce_bytes = b.non_negative("allreduce_bytes");
  // A coded gather sends at least its headers: none of a bucket that has bytes is a wrong trace
  // (it would predict a gather that costs nothing).
  if (bucket.raw_bytes > 0 && bucket.wire_bytes == 0)
    b.fail("field \"" + b.path_of("wire_bytes") + "\"", "must be above 0 where raw_bytes is");
  if (bucket.raw_bytes > 0 && bucket.post_forward_wire_bytes == 0.0) {
    b.fail("field \"" + b.path_of("post_forward_wire_bytes") + "\"",
           "must be above 0 where raw_bytes is");
  }
  const Json& shards = b.array("shards");
  for (size_t k = 0; k < shards.size(); ++k)
    bucket.shards.push_back(read_shard(b.element(shards, "shards", k)));

  // raw_bytes is the gathered output: every shard's values at the dtype's width. Another number
  // is a trace whose bytes and values describe different buckets (a prediction from its bytes
  // and projections from its rates would disagree without a word).
  const uint32_t value_bytes = dtype_info(trace.dtype).value_bytes;
  double values = 0;
  for (const TraceShard& shard : bucket.shards) values += static_cast<double>(shard.values);
  const double expected = values * value_bytes;
  if (std::abs(bucket.raw_bytes - expected) > std::max(0.5, 1e-12 * expected)) {
    b.fail("field \"" + b.path_of("raw_bytes") + "\"",
           "must be the shards' values x " + std::to_string(value_bytes) + " bytes per " +
               std::string(dtype_name(trace.dtype)) + " value: " + bytes_text(expected) +
               " bytes (" + bytes_text(values) + " values), but it is " +
               bytes_text(bucket.raw_bytes));
  }
  // Wire bytes at or a little above raw_bytes mean the engine sent the bucket raw (headers and
  // incompressible frames); more than the engine can send at all is a wrong trace, which the
  // prediction would have read as "sent raw" without a word.
  auto check_wire = [&](const char* key, double wire, int ranks, const char* group) {
    const double bound = wire_bytes_bound(bucket, trace.dtype, trace.block_values, ranks);
    if (wire > bound) {
      b.fail("field \"" + b.path_of(key) + "\"",
             "is " + bytes_text(wire) +
                 " bytes, more than a gather of this bucket can send: at most " +
                 bytes_text(bound) + " bytes on the " + group + " of " + std::to_string(ranks) +
                 " ranks (raw_bytes " + bytes_text(bucket.raw_bytes) +
                 " plus the codec's worst-case frame overhead, max_payload_bytes, the "
                 "envelope headers and the control records; docs/format.md, \"Size bound\")");
    }
  };
  const int shard_ranks =
      trace.topology ? trace.topology->shard_group(trace.world_size) : trace.world_size;
  check_wire("wire_bytes", bucket.wire_bytes, shard_ranks, "shard group");
  if (bucket.post_forward_wire_bytes && trace.topology &&
      trace.topology->post_forward_group(trace.world_size)) {
    check_wire("post_forward_wire_bytes", *bucket.post_forward_wire_bytes,
               trace.topology->reshard_after_forward, "post-forward group");
  }
  return bucket;
}

// The post-forward group's fields go with a post-forward group, the all-reduce curve with the
// buckets' all-reduces: a curve that the prediction would need and lacks, or one given where the
// topology says it is not used, is an error naming it.
void check_groups(const Trace& trace, const Fields& comm) {
  const bool regroup = trace.topology && trace.topology->post_forward_group(trace.world_size);
  const std::string why =
      trace.topology
          ? "topology.reshard_after_forward is " +
                std::to_string(trace.topology->reshard_after_forward) + " with a shard group of " +
                std::to_string(trace.topology->shard_group(trace.world_size)) + " ranks" +
                (trace.topology->keeps_gathered_after_forward(trace.world_size)
                     ? ", which FSDP2 reads as no resharding after forward: no backward gather"
                     : "")
          : "the trace has no \"topology\"";
  const std::string curve = "field \"" + comm.path_of("allgather_post_forward") + "\"";
  if (regroup && trace.post_forward_allgather_points.empty()) {
    throw ConfigError(trace.origin + ": missing " + curve +
                      " (the backward gathers run on the post-forward group: " + why + ")");
  }
  if (!regroup && !trace.post_forward_allgather_points.empty())
    comm.fail(curve, "is given, but no gather runs on a post-forward group (" + why + ")");
  for (size_t i = 0; i < trace.buckets.size(); ++i) {
    const TraceBucket& b = trace.buckets[i];
    const std::string path = "buckets[" + std::to_string(i) + "]";
    if (b.post_forward_wire_bytes && !regroup) {
      throw ConfigError(trace.origin + ": field \"" + path +
                        ".post_forward_wire_bytes\" is given, but no gather runs on a post-forward "
                        "group (" +
                        why + ")");
    }
    // Only HSDP all-reduces the gradient shards across nodes.
    if (b.allreduce_bytes > 0 && !(trace.topology && trace.topology->hsdp)) {
      throw ConfigError(trace.origin + ": field \"" + path +
                        ".allreduce_bytes\" is above 0, but the trace is not HSDP (topology.hsdp): "
                        "no all-reduce runs");
    }
    if (b.allreduce_bytes > 0 && trace.allreduce_points.empty()) {
      throw ConfigError(trace.origin + ": missing field \"comm.allreduce\" (needed by \"" + path +
                        ".allreduce_bytes\" > 0)");
    }
  }
}

}  // namespace

Trace parse_trace(const std::string& json_text, const std::string& origin) {
  const Json json = detail::parse_json(json_text, origin);
  const Fields top(json, "", origin);
  if (top.string("format") != "ciera-trace")
    top.fail("field \"format\"", "must be \"ciera-trace\"");
  if (!top.required("version").is_number_integer() || top.count("version") != 1) {
    top.fail("field \"version\"", "must be 1 (got " +
                                      detail::describe_json(top.required("version")) +
                                      "; this tool reads trace format v1 only)");
  }
  Trace trace;
  trace.origin = origin;
  const Fields model = top.object("model");
  trace.family = model.string("family");
  trace.params = model.count("params");
  const uint64_t world = top.count("world_size");
  // One rank gathers nothing: its trace has no collective to predict (the projections agree).
  if (world < 2 || world > (1u << 20))
    top.fail("field \"world_size\"", "must be in 2..2^20 (1048576): one rank runs no collective");
  trace.world_size = static_cast<int>(world);
  try {
    trace.dtype = parse_dtype(top.string("dtype"));
  } catch (const ConfigError& e) {
    top.fail("field \"dtype\"", std::string("is invalid: ") + e.what());
  }

  const Fields link = top.object("link");
  trace.link_kind = link.string("kind");
  trace.link_gbit = link.non_negative("gbit");
  trace.link_latency_ms = link.non_negative("latency_ms");

  const Fields codec = top.object("codec");
  trace.encode_GBps = codec.positive("encode_GBps");
  trace.decode_GBps = codec.positive("decode_GBps");
  trace.detect_GBps = codec.non_negative("detect_GBps");

  const Fields comm = top.object("comm");
  trace.allgather_points = read_points(comm, "allgather");
  trace.reduce_scatter_points = read_points(comm, "reduce_scatter");
  if (comm.has("allgather_post_forward"))
    trace.post_forward_allgather_points = read_points(comm, "allgather_post_forward");
  if (comm.has("allreduce")) trace.allreduce_points = read_points(comm, "allreduce");
  // Optional (absent: every rank its own node, one shard group, no HSDP).
  if (top.has("topology")) trace.topology = read_topology(top.object("topology"), trace.world_size);
  if (top.has("comm_probe")) {
    const Fields probe = top.object("comm_probe");
    trace.probe_allgather_points = read_optional_points(probe, "allgather");
    trace.probe_reduce_scatter_points = read_optional_points(probe, "reduce_scatter");
  }
  trace.optimizer_s = top.non_negative("optimizer_s");

  // Optional (absent in the first v1 traces): sequential schedule, B = 512.
  if (top.has("schedule")) read_schedule(top.object("schedule"), trace);

  const Json& buckets = top.array("buckets");
  if (buckets.empty()) top.fail("field \"buckets\"", "must hold at least one bucket");
  for (size_t i = 0; i < buckets.size(); ++i)
    trace.buckets.push_back(read_bucket(top.element(buckets, "buckets", i), trace));
  check_groups(trace, comm);

  if (top.has("measured")) {
    const Fields measured = top.object("measured");
    if (measured.has("baseline"))
      trace.measured_baseline = read_measured(measured.object("baseline"));
    if (measured.has("ciera")) trace.measured_ciera = read_measured(measured.object("ciera"));
  }
  return trace;
}

Trace load_trace(const std::string& path) {
  return parse_trace(read_text_file(path, "trace"), "trace " + path);
}

std::string Trace::describe() const {
  std::ostringstream out;
  out << family << " W=" << world_size << " " << dtype_name(dtype) << " " << link_kind;
  if (link_gbit > 0) {
    out << " " << link_gbit << " Gbit/s";
  } else {
    out << " unshaped";
  }
  if (topology) {
    out << " " << topology->nodes << "x" << topology->ranks_per_node;
    if (topology->hsdp) out << " hsdp";
    if (topology->post_forward_group(world_size))
      out << " reshard " << topology->reshard_after_forward;
    if (topology->keeps_gathered_after_forward(world_size)) out << " no reshard";
  }
  return out.str();
}

void apply_trace_rates(ChangeRates& rates, const Trace& trace) {
  std::array<double, kShardTypeCount> values{}, changed{}, blocks_weighted{}, block_values{};
  for (const TraceBucket& bucket : trace.buckets) {
    for (const TraceShard& shard : bucket.shards) {
      const int t = static_cast<int>(shard.type);
      values[t] += static_cast<double>(shard.values);
      changed[t] += shard.change_rate * static_cast<double>(shard.values);
      if (shard.block_change_rate >= 0) {
        blocks_weighted[t] += shard.block_change_rate * static_cast<double>(shard.values);
        block_values[t] += static_cast<double>(shard.values);
      }
    }
  }
  for (ShardType type : kAllShardTypes) {
    const int t = static_cast<int>(type);
    if (values[t] <= 0) continue;
    TypeRate& rate = rates.of(type);
    rate.element = changed[t] / values[t];
    const bool same_block = trace.block_values == rates.block_values;
    rate.block = block_values[t] > 0 && same_block ? blocks_weighted[t] / block_values[t] : -1.0;
    rate.block_at = 0;
    rate.source = trace.origin;
  }
}

TracePrediction predict_trace(const Trace& trace, int prefetch_depth) {
  TracePrediction p;
  p.allgather = fit_cost_curve(trace.allgather_points, trace.origin + ": comm.allgather");
  p.reduce_scatter =
      fit_cost_curve(trace.reduce_scatter_points, trace.origin + ": comm.reduce_scatter");
  const bool regroup = trace.topology && trace.topology->post_forward_group(trace.world_size);
  if (regroup) {
    p.post_forward_allgather = fit_cost_curve(trace.post_forward_allgather_points,
                                              trace.origin + ": comm.allgather_post_forward");
  }
  if (!trace.allreduce_points.empty())
    p.allreduce = fit_cost_curve(trace.allreduce_points, trace.origin + ": comm.allreduce");
  // The micro-benchmark is only reported; one that cannot be fitted is left out.
  try {
    if (!trace.probe_allgather_points.empty())
      p.probe_allgather = fit_cost_curve(trace.probe_allgather_points, "comm_probe.allgather");
    if (!trace.probe_reduce_scatter_points.empty()) {
      p.probe_reduce_scatter =
          fit_cost_curve(trace.probe_reduce_scatter_points, "comm_probe.reduce_scatter");
    }
  } catch (const ConfigError&) {
  }
  p.baseline_overlap = trace.overlap;
  p.ciera_overlap = trace.ciera_overlap;
  // Without a topology every rank is its own node (the link lab): every group spans nodes.
  const int shard =
      trace.topology ? trace.topology->shard_group(trace.world_size) : trace.world_size;
  const int per_node = trace.topology ? trace.topology->ranks_per_node : 1;
  const int backward_ranks = regroup ? trace.topology->reshard_after_forward : shard;
  const CostCurve& backward_curve = regroup ? *p.post_forward_allgather : p.allgather;
  std::vector<UnitCost> baseline, ciera;
  for (const TraceBucket& b : trace.buckets) {
    // The first gather of a step serves the forward pass, any others the backward pass.
    const double in_forward = std::min(1.0, b.gathers_per_step);
    const double in_backward = std::max(0.0, b.gathers_per_step - 1.0);
    UnitCost raw;
    raw.forward_s = b.forward_s;
    raw.backward_s = b.backward_s;
    const double raw_s = p.allgather.seconds(b.raw_bytes);
    raw.allgather_forward_bytes = in_forward * b.raw_bytes;
    raw.allgather_backward_bytes = in_backward * b.raw_bytes;
    raw.allgather_forward_s = in_forward * raw_s;
    raw.allgather_backward_s = in_backward * backward_curve.seconds(b.raw_bytes);
    raw.allgather_forward_inter_node = shard > per_node;
    raw.allgather_backward_inter_node = backward_ranks > per_node;
    // Two links: the shard group's curve, and the post-forward group's (regroup) of its own.
    raw.allgather_forward_link = 1;
    raw.allgather_backward_link = regroup ? 2 : 1;
    raw.reduce_scatter_bytes = b.grad_bytes;
    raw.reduce_scatter_s = p.reduce_scatter.seconds(b.grad_bytes);
    if (b.allreduce_bytes > 0) {  // HSDP: after the reduce-scatter, on the same channel
      raw.allreduce_bytes = b.allreduce_bytes;
      raw.allreduce_s = p.allreduce->seconds(b.allreduce_bytes);
    }
    baseline.push_back(raw);

    // One CIERA gather of `wire` bytes on a group of `ranks` (its curve): each rank encodes its own
    // shard (the engine's encode includes change detection) and decodes its peers' shards. A
    // bucket that is not smaller than raw was sent raw.
    struct Gather {
      double bytes, comm_s, encode_s = 0, decode_s = 0;
    };
    auto gather = [&](const CostCurve& curve, double wire, double ranks) {
      if (wire >= b.raw_bytes) return Gather{b.raw_bytes, curve.seconds(b.raw_bytes)};
      return Gather{wire, curve.seconds(wire), b.raw_bytes / ranks / (trace.encode_GBps * 1e9),
                    b.raw_bytes * (ranks - 1) / ranks / (trace.decode_GBps * 1e9)};
    };
    const Gather forward = gather(p.allgather, b.wire_bytes, shard);
    const Gather backward =
        regroup ? gather(backward_curve, b.post_forward_wire_bytes.value_or(b.raw_bytes),
                         backward_ranks)
                : forward;
    UnitCost coded = raw;
    coded.allgather_forward_bytes = in_forward * forward.bytes;
    coded.allgather_backward_bytes = in_backward * backward.bytes;
    coded.allgather_forward_s = in_forward * forward.comm_s;
    coded.allgather_backward_s = in_backward * backward.comm_s;
    coded.pre_forward_s = in_forward * forward.encode_s;
    coded.pre_backward_s = in_backward * backward.encode_s;
    coded.post_forward_s = in_forward * forward.decode_s;
    coded.post_backward_s = in_backward * backward.decode_s;
    if (regroup) {
      p.ciera_comm_s += in_forward * forward.comm_s + in_backward * backward.comm_s;
      p.ciera_encode_s += in_forward * forward.encode_s + in_backward * backward.encode_s;
      p.ciera_decode_s += in_forward * forward.decode_s + in_backward * backward.decode_s;
    } else {  // every gather on one group
      p.ciera_comm_s += b.gathers_per_step * forward.comm_s;
      p.ciera_encode_s += b.gathers_per_step * forward.encode_s;
      p.ciera_decode_s += b.gathers_per_step * forward.decode_s;
    }
    ciera.push_back(coded);
  }
  // Sequential: no gather in flight ahead of compute, each codec step in turn (encode starts when
  // the gather is called). Overlapped (CCP): FSDP2's prefetch, one unit ahead in each pass (the
  // first backward gather is not prefetched: the unit was resharded after its forward and is
  // gathered again when the backward reaches it); encode when the gather is issued. On CPU ranks
  // a reduce-scatter blocks the training loop either way.
  auto options = [&](bool overlap) {
    ScheduleOptions o;
    o.prefetch_depth = overlap ? prefetch_depth : 0;
    o.pre_from_start = false;
    o.blocking_reduce_scatter = true;
    o.prefetch_into_backward = false;  // FSDP2: a unit's backward gather follows its reshard
    return o;
  };
  p.baseline = simulate_iteration(baseline, trace.optimizer_s, options(trace.overlap));
  p.ciera = simulate_iteration(ciera, trace.optimizer_s, options(trace.ciera_overlap));
  p.baseline_allgather_s = p.baseline.exposed_allgather_s + p.baseline.exposed_codec_s;
  p.ciera_allgather_s = p.ciera.exposed_allgather_s + p.ciera.exposed_codec_s;
  return p;
}

}  // namespace ciera::sim
