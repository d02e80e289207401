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

struct Context {
  const ModelShape& model;
  const Cluster& cluster;
  const Workload& work;
  double value_bytes;
  double tokens;
};

double compute_seconds(const Context& c, double flops_per_token) {
  return flops_per_token * c.tokens / (c.cluster.peak_tflops * 1e12 * c.cluster.mfu);
}

UnitCost baseline_cost(const Context& c, const GatherUnit& unit) {
  UnitCost cost;
  const int w = c.work.world;
  cost.forward_s = compute_seconds(c, unit.forward_flops_per_token);
  cost.backward_s = cost.forward_s * (c.work.activation_checkpointing ? 3.0 : 2.0);
  const double raw = unit.gathered_values() * c.value_bytes;
  const double grads = unit.grad_values * c.value_bytes;
  cost.allgather_forward_bytes = cost.allgather_backward_bytes = raw;
  cost.allgather_forward_s = cost.allgather_backward_s =
      allgather_seconds(c.cluster, w, raw, c.work.algorithm);
  cost.reduce_scatter_bytes = grads;
  cost.reduce_scatter_s = reduce_scatter_seconds(c.cluster, w, grads, c.work.algorithm);
  return cost;
}

UnitCost zeropp_cost(const Context& c, const GatherUnit& unit) {
  UnitCost cost = baseline_cost(c, unit);
  const Cluster& cl = c.cluster;
  const int w = c.work.world;
  const double raw = unit.gathered_values() * c.value_bytes;
  // qwZ: the forward gather carries int8 values over the whole world (one flat collective).
  const double int8_bytes = quantized_bytes(unit.gathered_values(), 8, c.work.zeropp_block_values);
  cost.allgather_forward_bytes = int8_bytes;
  cost.allgather_forward_s = allgather_seconds(cl, w, int8_bytes, Algorithm::kRing);
  cost.pre_forward_s = raw / w / (cl.quantize_GBps * kGB);
  cost.post_forward_s = raw / (cl.dequantize_GBps * kGB);
  // hpZ: the backward gather reads the full-precision secondary copy inside the node.
  cost.allgather_backward_s = ring_seconds(std::min(w, cl.gpus_per_node), raw, cl.intra);
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
  const double wire = unit.gathered_values() * codec.bits_per_value / 8.0;
  cost.allgather_forward_bytes = cost.allgather_backward_bytes = wire;
  cost.allgather_forward_s = cost.allgather_backward_s =
      allgather_seconds(c.cluster, c.work.world, wire, c.work.algorithm);
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

// Bytes of one unit's gathers under CIERA; `forward` gathers send the changed exponents, the
// backward gather of the same step finds none changed (values are unchanged since the forward).
double ciera_unit_bytes(const Context& c, const GatherUnit& unit, const ChangeRates& rates,
                        const std::array<bool, kShardTypeCount>& selected, bool forward) {
  double bytes = 0;
  for (const ShardGroup& s : unit.shards) {
    if (!selected[static_cast<int>(s.type)]) {
      bytes += s.values * c.value_bytes;
      continue;
    }
    // The backward gather of the same step finds no exponent changed since the forward one.
    const double q = forward ? rates.block_rate(s.type) : 0.0;
    const double e = forward ? rates.of(s.type).element : 0.0;
    bytes += ciera_payload_bytes(s.values, c.work.dtype, rates.block_values, c.work.world, q, e);
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

UnitCost ciera_cost(const Context& c, const GatherUnit& unit, const ChangeRates& rates,
                    const std::array<bool, kShardTypeCount>& selected) {
  UnitCost cost = baseline_cost(c, unit);
  const Cluster& cl = c.cluster;
  const int w = c.work.world;
  for (bool forward : {true, false}) {
    const double bytes = ciera_unit_bytes(c, unit, rates, selected, forward);
    (forward ? cost.allgather_forward_bytes : cost.allgather_backward_bytes) = bytes;
    (forward ? cost.allgather_forward_s : cost.allgather_backward_s) =
        allgather_seconds(cl, w, bytes, c.work.algorithm);
  }
  const double coded = selected_raw_bytes(c, unit, selected);
  const double own_shard = coded / w;
  double pre = own_shard / (cl.encode_GBps * kGB);
  if (cl.detect_GBps > 0) pre += own_shard / (cl.detect_GBps * kGB);
  cost.pre_forward_s = cost.pre_backward_s = pre;
  cost.post_forward_s = cost.post_backward_s = coded * (w - 1) / w / (cl.decode_GBps * kGB);
  return cost;
}

// Benefit-driven selection (paper §3.2): compress a shard type when the collective time it saves
// exceeds its decode time, which stays on the critical path; detect and encode are overlapped.
std::array<bool, kShardTypeCount> select_types(const Context& c,
                                               const std::vector<GatherUnit>& units,
                                               const ChangeRates& rates) {
  std::array<bool, kShardTypeCount> selected{};
  const int w = c.work.world;
  for (ShardType type : kAllShardTypes) {
    std::array<bool, kShardTypeCount> only{};
    only[static_cast<int>(type)] = true;
    double gain = 0;
    for (const GatherUnit& unit : units) {
      const double coded = selected_raw_bytes(c, unit, only);
      if (coded == 0) continue;
      const double raw = unit.gathered_values() * c.value_bytes;
      for (bool forward : {true, false}) {
        const double saved =
            coded - (ciera_unit_bytes(c, unit, rates, only, forward) - (raw - coded));
        gain += allgather_seconds(c.cluster, w, raw, c.work.algorithm) -
                allgather_seconds(c.cluster, w, raw - saved, c.work.algorithm);
        gain -= coded * (w - 1) / w / (c.cluster.decode_GBps * kGB);
      }
    }
    selected[static_cast<int>(type)] = gain > 0;
  }
  return selected;
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

Projection project(const ModelShape& model, const Cluster& cluster, const Workload& work,
                   const ChangeRates& rates, System system) {
  if (work.world < 1) throw ConfigError("the number of GPUs must be at least 1");
  if (work.seq_len < 1 || work.micro_batch < 1)
    throw ConfigError("--seq-len and --micro-batch must be at least 1");
  const Context c{model, cluster, work, static_cast<double>(dtype_info(work.dtype).value_bytes),
                  static_cast<double>(work.seq_len) * work.micro_batch};
  const std::vector<GatherUnit> units = model_units(model, work.layers, work.seq_len);
  Projection result;
  result.system = system;
  if (system == System::kCiera) result.selected = select_types(c, units, rates);
  GatherCodec codec;
  if (system == System::kSdp4Bit) codec = gather_codec(work.schemes.sdp4bit, cluster, work.dtype);
  if (system == System::kStateless)
    codec = gather_codec(work.schemes.stateless, cluster, work.dtype);

  std::vector<UnitCost> costs;
  uint64_t params = 0;
  for (const GatherUnit& unit : units) {
    params += unit.grad_values;
    switch (system) {
      case System::kZero3:
        costs.push_back(baseline_cost(c, unit));
        break;
      case System::kZeroPP:
        costs.push_back(zeropp_cost(c, unit));
        break;
      case System::kCiera:
        costs.push_back(ciera_cost(c, unit, rates, result.selected));
        break;
      case System::kSdp4Bit:
        costs.push_back(sdp4bit_cost(c, unit, codec));
        break;
      case System::kStateless:
        costs.push_back(stateless_cost(c, unit, codec));
        break;
    }
  }
  const double optimizer_s = static_cast<double>(params) / work.world *
                             work.optimizer_bytes_per_param / (cluster.hbm_GBps * kGB);
  ScheduleOptions options;
  options.prefetch_depth = work.prefetch_depth;
  options.pre_from_start = system == System::kCiera || system == System::kStateless;
  result.breakdown = simulate_iteration(costs, optimizer_s, options);
  return result;
}

}  // namespace ciera::sim
