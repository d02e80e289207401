// Per-unit costs of ZeRO-3, ZeRO++, SDP4Bit, stateless exponent coding and CIERA on a zoo model,
// and the iteration they add up to (docs/simulator.md, "Systems").
#include <algorithm>
#include <cmath>

#include "ciera/config.hpp"
#include "ciera/selection.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

constexpr double kGB = 1e9;

// What the engine sends for one shard type of a gather: each of the W ranks sends the expected
// delta frame of its 1/W of the values (ciera::expected_payload_bytes: header + sign-mantissa +
// bitmap + the smaller of block mode, q·S_e as in the paper's §3.2, and fine mode, which costs
// per changed value). An unknown element rate counts as every value changing (block mode).
double ciera_payload_bytes(uint64_t values, DType dtype, uint32_t block_values, int world,
                           double block_rate, double element_rate) {
  if (values == 0) return 0;
  CodecConfig codec;
  codec.dtype = dtype;
  codec.block_values = block_values;
  const uint64_t ranks = static_cast<uint64_t>(std::max(1, world));
  const uint64_t per_rank = (values + ranks - 1) / ranks;
  return static_cast<double>(ranks) *
         expected_payload_bytes(codec, dtype, per_rank, block_rate,
                                element_rate >= 0 ? element_rate : 1.0);
}

// ZeRO++ block quantisation: `bits` per value plus one FP32 scale per block (DeepSpeed's
// CUDAQuantizer, symmetric).
double quantized_bytes(uint64_t values, double bits, uint32_t block_values) {
  const double n = static_cast<double>(values);
  return n * bits / 8.0 + std::ceil(n / block_values) * 4.0;
}

// The groups a unit's collectives run on under the workload's topology (docs/simulator.md,
// "Topologies"), in GPUs. A group of at most one node's GPUs runs on the intra-node link.
struct Placement {
  int forward_ranks = 1;   // forward gathers: the shard group
  int backward_ranks = 1;  // backward gathers: the shard group, or the node (partial resharding)
  int shard_ranks = 1;     // reduce-scatter, and the model states' sharding
  int replicas = 1;        // HSDP: nodes that all-reduce each gradient shard
  int per_node = 1;
  bool crosses_nodes(int ranks) const { return ranks > per_node; }
  // The bytes a gather of `raw` bytes moves on a group of `ranks`: none on a group of one.
  static double moved(int ranks, double raw) { return ranks > 1 ? raw : 0.0; }
  bool backward_on_node() const { return backward_ranks < forward_ranks; }
};

Placement placement(const Cluster& cluster, int world, Topology topology) {
  Placement p;
  p.per_node = std::max(1, cluster.gpus_per_node);
  const int node = std::min(world, p.per_node);
  p.forward_ranks = p.backward_ranks = p.shard_ranks = world;
  if (topology == Topology::kFlat || world <= node) return p;
  require_whole_nodes(cluster, world);
  p.backward_ranks = node;
  if (topology == Topology::kHsdp) {
    p.forward_ranks = p.shard_ranks = node;
    p.replicas = world / node;
  }
  return p;
}

struct Context {
  const ModelShape& model;
  const Cluster& cluster;
  const Workload& work;
  double value_bytes;
  double tokens;
  Placement place;
};

double compute_seconds(const Context& c, double flops_per_token) {
  return flops_per_token * c.tokens / (c.cluster.peak_tflops * 1e12 * c.cluster.mfu);
}

// Allgather of `bytes` (output per rank) over a group of `ranks` GPUs: the world, or one node
// (allgather_seconds runs a group that fits in a node on the intra-node link).
double group_allgather_seconds(const Context& c, int ranks, double bytes) {
  return allgather_seconds(c.cluster, ranks, bytes, c.work.algorithm);
}

UnitCost baseline_cost(const Context& c, const GatherUnit& unit) {
  UnitCost cost;
  const Placement& p = c.place;
  cost.forward_s = compute_seconds(c, unit.forward_flops_per_token);
  cost.backward_s = cost.forward_s * (c.work.activation_checkpointing ? 3.0 : 2.0);
  const double raw = unit.gathered_values() * c.value_bytes;
  const double grads = unit.grad_values * c.value_bytes;
  cost.allgather_forward_bytes = Placement::moved(p.forward_ranks, raw);
  cost.allgather_backward_bytes = Placement::moved(p.backward_ranks, raw);
  cost.allgather_forward_s = group_allgather_seconds(c, p.forward_ranks, raw);
  cost.allgather_backward_s = group_allgather_seconds(c, p.backward_ranks, raw);
  cost.allgather_forward_inter_node = p.crosses_nodes(p.forward_ranks);
  cost.allgather_backward_inter_node = p.crosses_nodes(p.backward_ranks);
  cost.allgather_forward_link =
      gather_link(p.forward_ranks, cost.allgather_forward_inter_node, c.work.algorithm);
  cost.allgather_backward_link =
      gather_link(p.backward_ranks, cost.allgather_backward_inter_node, c.work.algorithm);
  cost.reduce_scatter_bytes = grads;
  cost.reduce_scatter_s = reduce_scatter_seconds(c.cluster, p.shard_ranks, grads, c.work.algorithm);
  if (p.replicas > 1 && grads > 0) {  // HSDP: each GPU all-reduces its 1/G of the gradients
    cost.allreduce_bytes = grads / p.shard_ranks;
    cost.allreduce_s = allreduce_seconds(p.replicas, grads, c.cluster.inter);
  }
  return cost;
}

UnitCost zeropp_cost(const Context& c, const GatherUnit& unit) {
  UnitCost cost = baseline_cost(c, unit);
  const Cluster& cl = c.cluster;
  const int w = c.work.world;
  const double raw = unit.gathered_values() * c.value_bytes;
  // qwZ: the forward gather carries int8 values over the whole world (one flat collective).
  const double int8_bytes = quantized_bytes(unit.gathered_values(), 8, c.work.zeropp_block_values);
  cost.allgather_forward_bytes = Placement::moved(w, int8_bytes);
  cost.allgather_forward_s = allgather_seconds(cl, w, int8_bytes, Algorithm::kRing);
  cost.allgather_forward_inter_node = c.place.crosses_nodes(w);
  cost.allgather_forward_link = gather_link(w, cost.allgather_forward_inter_node, Algorithm::kRing);
  cost.pre_forward_s = raw / w / (cl.quantize_GBps * kGB);
  cost.post_forward_s = raw / (cl.dequantize_GBps * kGB);
  // hpZ: the backward gather reads the full-precision secondary copy inside the node.
  const int node = std::min(w, cl.gpus_per_node);
  cost.allgather_backward_bytes = Placement::moved(node, raw);
  cost.allgather_backward_s = ring_seconds(node, raw, cl.intra);
  cost.allgather_backward_inter_node = false;
  cost.allgather_backward_link = gather_link(node, false, Algorithm::kRing);
  // qgZ: int4 gradients, hierarchical all-to-all (intra-node, then inter-node on 1/G of the data),
  // quantised before each step and dequantised after it.
  const double grads = unit.grad_values * c.value_bytes;
  const double int4_bytes = quantized_bytes(unit.grad_values, 4, c.work.zeropp_grad_block_values);
  cost.reduce_scatter_bytes = int4_bytes;
  double kernels = grads / (cl.quantize_GBps * kGB) + grads / (cl.dequantize_GBps * kGB);
  if (w > cl.gpus_per_node) kernels *= 1.0 + 1.0 / cl.gpus_per_node;
  cost.reduce_scatter_s =
      unit.grad_values
          ? reduce_scatter_seconds(cl, w, int4_bytes, Algorithm::kHierarchical) + kernels
          : 0.0;
  return cost;
}

// SDP4Bit's qWD: every gather carries the weights' differences at `codec.bits_per_value`, on the
// same collective as ZeRO-3's; gradients as ZeRO-3's. Only the quantised allgather: no hpZ-style
// secondary copy, no gradient quantisation (docs/simulator.md, "Systems"). As for ZeRO++'s int8
// weights, each rank quantises its own shard when the forward gather is issued, and every rank
// dequantises the whole gathered tensor, its own shard included (lossy: all ranks must compute
// with the same values). The backward gather re-sends the forward's quantised shard, so it has no
// quantise step of its own.
// A unit whose forward and backward gathers both carry every value at `codec.bits_per_value`
// (ZeRO-3's collectives otherwise); the caller adds its coding costs.
UnitCost coded_gathers_cost(const Context& c, const GatherUnit& unit, const GatherCodec& codec) {
  UnitCost cost = baseline_cost(c, unit);
  const int w = c.work.world;
  const double wire = unit.gathered_values() * codec.bits_per_value / 8.0;
  cost.allgather_forward_bytes = cost.allgather_backward_bytes = Placement::moved(w, wire);
  cost.allgather_forward_s = cost.allgather_backward_s =
      allgather_seconds(c.cluster, w, wire, c.work.algorithm);
  // Over the world, whatever the baseline's placement.
  cost.allgather_forward_inter_node = cost.allgather_backward_inter_node = c.place.crosses_nodes(w);
  cost.allgather_forward_link = cost.allgather_backward_link =
      gather_link(w, c.place.crosses_nodes(w), c.work.algorithm);
  return cost;
}

UnitCost sdp4bit_cost(const Context& c, const GatherUnit& unit, const GatherCodec& codec) {
  UnitCost cost = coded_gathers_cost(c, unit, codec);
  const int w = c.work.world;
  const double raw = unit.gathered_values() * c.value_bytes;
  cost.pre_forward_s = raw / w / (codec.encode_GBps * kGB);
  cost.post_forward_s = cost.post_backward_s = raw / (codec.decode_GBps * kGB);
  return cost;
}

// Stateless exponent coding (ZipCCL's idea): every gather codes every value of every shard type
// afresh, at `codec.bits_per_value`, with no selection and no cache. Encoding reads only the
// current values, which are final after the previous step, so like CIERA's it runs on the pre
// stream from iteration start (the schedule's pre_from_start); decoding the W-1 peer shards is on
// the critical path. Lossless, so a rank's own shard needs no decoding.
UnitCost stateless_cost(const Context& c, const GatherUnit& unit, const GatherCodec& codec) {
  UnitCost cost = coded_gathers_cost(c, unit, codec);
  const int w = c.work.world;
  const double raw = unit.gathered_values() * c.value_bytes;
  cost.pre_forward_s = cost.pre_backward_s = raw / w / (codec.encode_GBps * kGB);
  cost.post_forward_s = cost.post_backward_s = raw * (w - 1) / w / (codec.decode_GBps * kGB);
  return cost;
}

// One kind of CIERA gather of a unit: on which group, and whether the exponents changed since
// that group's engine last gathered the unit. The forward gather finds a step's changes. The
// backward gather on the same group finds none (the values are the forward's). On a group of its
// own (the node, partial resharding) the engine last saw the unit in the previous step's backward
// gather, so it finds a step's changes again: the engine as it is, one exponent cache per group
// (docs/simulator.md, "Topologies").
struct CieraGather {
  bool forward = true;
  int ranks = 1;
  bool exponents_changed = true;
};

// The kinds of gather of a unit, forward first, each with the selection that applies to it.
std::vector<CieraGather> ciera_gathers(const Placement& p) {
  return {{true, p.forward_ranks, true}, {false, p.backward_ranks, p.backward_on_node()}};
}

// Bytes of one gather of a unit under CIERA: the selected types' frames, the others raw.
double ciera_unit_bytes(const Context& c, const GatherUnit& unit, const ChangeRates& rates,
                        const std::array<bool, kShardTypeCount>& selected,
                        const CieraGather& gather) {
  double bytes = 0;
  for (const ShardGroup& s : unit.shards) {
    if (!selected[static_cast<int>(s.type)]) {
      bytes += s.values * c.value_bytes;
      continue;
    }
    const double q = gather.exponents_changed ? rates.block_rate(s.type) : 0.0;
    const double e = gather.exponents_changed ? rates.of(s.type).element : 0.0;
    bytes += ciera_payload_bytes(s.values, c.work.dtype, rates.block_values, gather.ranks, q, e);
  }
  return bytes;
}

double selected_raw_bytes(const Context& c, const GatherUnit& unit,
                          const std::array<bool, kShardTypeCount>& selected) {
  double bytes = 0;
  for (const ShardGroup& s : unit.shards)
    bytes += selected[static_cast<int>(s.type)] ? s.values * c.value_bytes : 0.0;
  return bytes;
}

// `selected` applies to the gathers of the shard group, `on_node` to backward gathers on the node.
UnitCost ciera_cost(const Context& c, const GatherUnit& unit, const ChangeRates& rates,
                    const std::array<bool, kShardTypeCount>& selected,
                    const std::array<bool, kShardTypeCount>& on_node) {
  UnitCost cost = baseline_cost(c, unit);
  const Cluster& cl = c.cluster;
  for (const CieraGather& g : ciera_gathers(c.place)) {
    const auto& chosen = g.forward || !c.place.backward_on_node() ? selected : on_node;
    const double bytes = ciera_unit_bytes(c, unit, rates, chosen, g);
    const double coded = selected_raw_bytes(c, unit, chosen);
    const double own_shard = coded / g.ranks;
    double pre = own_shard / (cl.encode_GBps * kGB);
    if (cl.detect_GBps > 0) pre += own_shard / (cl.detect_GBps * kGB);
    const double post = coded * (g.ranks - 1) / g.ranks / (cl.decode_GBps * kGB);
    (g.forward ? cost.allgather_forward_bytes : cost.allgather_backward_bytes) =
        Placement::moved(g.ranks, bytes);
    (g.forward ? cost.allgather_forward_s : cost.allgather_backward_s) =
        group_allgather_seconds(c, g.ranks, bytes);
    (g.forward ? cost.pre_forward_s : cost.pre_backward_s) = pre;
    (g.forward ? cost.post_forward_s : cost.post_backward_s) = post;
  }
  return cost;
}

// Benefit-driven selection (paper §3.2): compress a shard type when the collective time it saves
// exceeds its decode time, which stays on the critical path; detect and encode are overlapped.
// One decision per group of GPUs the engine runs on, over the gathers of that group: `forward`
// and `backward` say which of a unit's gathers it carries. Inside a node (fast links) the gain
// is thin and decoding may cost more than it saves; the decision says so per group.
std::array<bool, kShardTypeCount> select_types(const Context& c,
                                               const std::vector<GatherUnit>& units,
                                               const ChangeRates& rates, bool forward,
                                               bool backward) {
  std::array<bool, kShardTypeCount> selected{};
  std::vector<CieraGather> gathers;
  for (const CieraGather& g : ciera_gathers(c.place)) {
    if (g.forward ? forward : backward) gathers.push_back(g);
  }
  for (ShardType type : kAllShardTypes) {
    std::array<bool, kShardTypeCount> only{};
    only[static_cast<int>(type)] = true;
    double gain = 0;
    for (const GatherUnit& unit : units) {
      const double coded = selected_raw_bytes(c, unit, only);
      if (coded == 0) continue;
      const double raw = unit.gathered_values() * c.value_bytes;
      for (const CieraGather& g : gathers) {
        const int w = g.ranks;
        const double saved = coded - (ciera_unit_bytes(c, unit, rates, only, g) - (raw - coded));
        gain += group_allgather_seconds(c, w, raw) - group_allgather_seconds(c, w, raw - saved);
        gain -= coded * (w - 1) / w / (c.cluster.decode_GBps * kGB);
      }
    }
    selected[static_cast<int>(type)] = gain > 0;
  }
  return selected;
}

// BSC's rule counts decode alone, taking detect and encode as hidden by CCP. Where the schedule
// cannot hide them (kernels slow for the links), a selected type can lengthen the step: each type
// whose removal shortens the simulated step is dropped, one at a time, as the engine's adaptive
// switch would send it raw. So CIERA is never projected slower than its all-raw gathers
// (ZeRO-3's).
void drop_types_that_slow_the_step(const Context& c, const std::vector<GatherUnit>& units,
                                   const ChangeRates& rates, double optimizer_s,
                                   const ScheduleOptions& options, Projection& result) {
  const auto step_s = [&] {
    std::vector<UnitCost> costs;
    for (const GatherUnit& unit : units)
      costs.push_back(
          ciera_cost(c, unit, rates, result.selected, result.selected_backward_on_node));
    return simulate_iteration(costs, optimizer_s, options).total_s;
  };
  double best = step_s();
  for (bool dropped = true; dropped;) {
    dropped = false;
    for (auto* selection : {&result.selected, &result.selected_backward_on_node}) {
      for (bool& chosen : *selection) {
        if (!chosen) continue;
        chosen = false;
        const double without = step_s();
        if (without < best * (1 - 1e-9)) {
          best = without;
          dropped = true;
        } else {
          chosen = true;
        }
      }
    }
  }
}

}  // namespace

std::string_view system_name(System system) {
  switch (system) {
    case System::kZero3:
      return "ZeRO-3";
    case System::kZeroPP:
      return "ZeRO++";
    case System::kCiera:
      return "CIERA";
    case System::kSdp4Bit:
      return "SDP4Bit";
    case System::kStateless:
      return "stateless";
  }
  return "?";
}

Topology parse_topology(std::string_view name) {
  if (name == "flat") return Topology::kFlat;
  if (name == "partial") return Topology::kPartial;
  if (name == "hsdp") return Topology::kHsdp;
  throw ConfigError("unknown topology \"" + std::string(name) +
                    "\" (expected flat, partial or hsdp)");
}

std::string_view topology_name(Topology topology) {
  switch (topology) {
    case Topology::kFlat:
      return "flat";
    case Topology::kPartial:
      return "partial";
    case Topology::kHsdp:
      return "hsdp";
  }
  return "?";
}

Projection project(const ModelShape& model, const Cluster& cluster, const Workload& work,
                   const ChangeRates& rates, System system) {
  if (work.world < 1) throw ConfigError("the number of GPUs must be at least 1");
  if (work.seq_len < 1 || work.micro_batch < 1)
    throw ConfigError("--seq-len and --micro-batch must be at least 1");
  if (work.topology != Topology::kFlat && system != System::kZero3 && system != System::kCiera) {
    throw ConfigError("topology " + std::string(topology_name(work.topology)) +
                      " applies to ZeRO-3 and CIERA only, not " + std::string(system_name(system)));
  }
  const Context c{model,
                  cluster,
                  work,
                  static_cast<double>(dtype_info(work.dtype).value_bytes),
                  static_cast<double>(work.seq_len) * work.micro_batch,
                  placement(cluster, work.world, work.topology)};
  const std::vector<GatherUnit> units = model_units(model, work.layers, work.seq_len);
  Projection result;
  result.system = system;
  result.topology = work.topology;
  if (system == System::kCiera) {
    result.backward_on_node = c.place.backward_on_node();
    result.selected = select_types(c, units, rates, true, !result.backward_on_node);
    if (result.backward_on_node)
      result.selected_backward_on_node = select_types(c, units, rates, false, true);
  }
  GatherCodec codec;
  if (system == System::kSdp4Bit) codec = gather_codec(work.schemes.sdp4bit, cluster, work.dtype);
  if (system == System::kStateless)
    codec = gather_codec(work.schemes.stateless, cluster, work.dtype);

  ScheduleOptions options;
  options.prefetch_depth = work.prefetch_depth;
  options.pre_from_start = system == System::kCiera || system == System::kStateless;
  uint64_t params = 0;
  for (const GatherUnit& unit : units) params += unit.grad_values;
  // Each GPU steps the parameters of its shard: 1/W of them, HSDP's 1/G.
  const double optimizer_s = static_cast<double>(params) / c.place.shard_ranks *
                             work.optimizer_bytes_per_param / (cluster.hbm_GBps * kGB);
  if (system == System::kCiera)
    drop_types_that_slow_the_step(c, units, rates, optimizer_s, options, result);

  std::vector<UnitCost> costs;
  // On one GPU no gather or reduction runs, so no scheme codes anything: each costs as ZeRO-3
  // (charging the others their coding kernels made them look slower than no communication).
  const System costed = work.world == 1 ? System::kZero3 : system;
  for (const GatherUnit& unit : units) {
    switch (costed) {
      case System::kZero3:
        costs.push_back(baseline_cost(c, unit));
        break;
      case System::kZeroPP:
        costs.push_back(zeropp_cost(c, unit));
        break;
      case System::kCiera:
        costs.push_back(
            ciera_cost(c, unit, rates, result.selected, result.selected_backward_on_node));
        break;
      case System::kSdp4Bit:
        costs.push_back(sdp4bit_cost(c, unit, codec));
        break;
      case System::kStateless:
        costs.push_back(stateless_cost(c, unit, codec));
        break;
    }
  }
  result.state_bytes_per_gpu =
      static_cast<double>(params) * work.state_bytes_per_param / c.place.shard_ranks;
  // Kept besides, in 16-bit: partial resharding's 1/G of every unit from its forward to its
  // backward (at the end of the forward pass, all of them), ZeRO++'s hpZ secondary copy.
  const bool node_copy =
      system == System::kZeroPP ? work.world > c.place.per_node : c.place.backward_on_node();
  if (node_copy)
    result.state_bytes_per_gpu += static_cast<double>(params) * c.value_bytes / c.place.per_node;
  result.breakdown = simulate_iteration(costs, optimizer_s, options);
  return result;
}

}  // namespace ciera::sim
