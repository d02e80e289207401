// The simulator: collective formulas and the schedule on hand-computed cases, ZeRO++, SDP4Bit,
// stateless coding and CIERA byte counts, the lossless topologies (flat, partial resharding,
// HSDP) in projections and traces, the codec figures of `ciera bench codec --json`, the model zoo
// against published parameter counts, and input errors that name their problem.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "ciera/codec.hpp"
#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

// Expects `f` to throw ConfigError whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const ConfigError& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message: " << e.what() << "\nwanted: " << part;
    }
  }
}

Cluster two_tier_cluster() {
  Cluster c;
  c.name = "test";
  c.gpus_per_node = 4;
  c.intra = {100, 1e-6};
  c.inter = {10, 1e-5};
  c.peak_tflops = 100;
  c.hbm_GBps = 1000;
  c.mfu = 0.5;
  c.detect_GBps = 0;
  c.encode_GBps = c.decode_GBps = c.quantize_GBps = c.dequantize_GBps = 1000;
  return c;
}

// ---- Collectives ------------------------------------------------------------------------------

TEST(SimCollectives, RingIsStepsTimesAlphaPlusFractionOverBandwidth) {
  // 4 ranks, 1 GB gathered, 10 GB/s, 10 us: 3 x 10 us + 3/4 x 1e9 / 1e10 s.
  EXPECT_NEAR(ring_seconds(4, 1e9, {10, 1e-5}), 3e-5 + 0.075, 1e-12);
  EXPECT_EQ(ring_seconds(1, 1e9, {10, 1e-5}), 0.0);
  EXPECT_EQ(ring_seconds(4, 0, {10, 1e-5}), 0.0);
}

TEST(SimCollectives, RingInsideOneNodeUsesTheIntraLink) {
  const Cluster c = two_tier_cluster();
  EXPECT_NEAR(allgather_seconds(c, 4, 1e9, Algorithm::kRing), 3e-6 + 0.75 * 1e9 / 1e11, 1e-12);
}

TEST(SimCollectives, RingAcrossNodesIsPacedByTheInterNodeLink) {
  const Cluster c = two_tier_cluster();
  EXPECT_NEAR(allgather_seconds(c, 8, 1e9, Algorithm::kRing), 7 * 1e-5 + 7.0 / 8 * 1e9 / 1e10,
              1e-12);
}

TEST(SimCollectives, HierarchicalIsInterNodeRingOverNodesThenIntraNodeRing) {
  const Cluster c = two_tier_cluster();
  const double inter = 1 * 1e-5 + 0.5 * 1e9 / 1e10;   // 2 nodes
  const double intra = 3 * 1e-6 + 0.75 * 1e9 / 1e11;  // 4 GPUs per node
  EXPECT_NEAR(allgather_seconds(c, 8, 1e9, Algorithm::kHierarchical), inter + intra, 1e-12);
  EXPECT_NEAR(reduce_scatter_seconds(c, 8, 1e9, Algorithm::kHierarchical), inter + intra, 1e-12);
}

TEST(SimCollectives, AllReduceIsAReduceScatterRingThenAnAllgatherRing) {
  EXPECT_NEAR(allreduce_seconds(2, 1e9, {10, 1e-5}), 2 * (1e-5 + 0.5 * 1e9 / 1e10), 1e-12);
  EXPECT_EQ(allreduce_seconds(1, 1e9, {10, 1e-5}), 0.0);
}

TEST(SimCollectives, PartialNodesAreRejected) {
  const Cluster c = two_tier_cluster();
  expect_error([&] { allgather_seconds(c, 6, 1e9, Algorithm::kRing); }, {"6 GPUs", "nodes of 4"});
}

TEST(SimCollectives, CostCurveFitRecoversAlphaAndBandwidth) {
  const CostCurve curve = fit_cost_curve({{1e6, 0.011}, {2e6, 0.021}, {4e6, 0.041}}, "ag");
  EXPECT_NEAR(curve.alpha_s, 0.001, 1e-9);
  EXPECT_NEAR(curve.bytes_per_s, 1e8, 1e-3);
  // A negative intercept is clamped: refit through the origin.
  const CostCurve clamped = fit_cost_curve({{1e6, 0.009}, {2e6, 0.021}}, "ag");
  EXPECT_EQ(clamped.alpha_s, 0.0);
  EXPECT_GT(clamped.bytes_per_s, 0.0);
  expect_error([] { fit_cost_curve({}, "comm.allgather"); },
               {"comm.allgather", "no measured points"});
  expect_error(
      [] {
        fit_cost_curve({{1e6, 0.2}, {2e6, 0.1}}, "comm.allgather");
      },
      {"does not increase"});
}

TEST(SimCollectives, CostCurveFitAveragesRepeatedSizes) {
  // Three identical buckets at 1 MB (mean 2 s) count as one point: the line through (1, 2),
  // (2, 3), (3, 5) in MB and s has slope 1.5 s/MB and intercept 1/3 s. Weighting the three
  // repeats separately would pull the fit towards 1 MB.
  const CostCurve curve =
      fit_cost_curve({{1e6, 1.5}, {1e6, 2.5}, {1e6, 2.0}, {2e6, 3.0}, {3e6, 5.0}}, "ag");
  EXPECT_NEAR(curve.alpha_s, 1.0 / 3, 1e-9);
  EXPECT_NEAR(curve.bytes_per_s, 1e6 / 1.5, 1e-3);
  // Two identical buckets and nothing else: one size, fitted through the origin.
  const CostCurve one = fit_cost_curve({{1e6, 0.4}, {1e6, 0.6}}, "ag");
  EXPECT_EQ(one.alpha_s, 0.0);
  EXPECT_NEAR(one.bytes_per_s, 2e6, 1e-3);
}

TEST(SimCollectives, ByteReductionBound) {
  EXPECT_NEAR(byte_reduction_bound(0.5, 2.0), 1.0 / 0.75, 1e-12);
  EXPECT_NEAR(byte_reduction_bound(1.0, 2.0), 2.0, 1e-12);
  EXPECT_NEAR(byte_reduction_bound(0.0, 2.0), 1.0, 1e-12);
  EXPECT_NEAR(byte_reduction_bound(0.6, 1.0), 1.0, 1e-12);
}

// Per gather group: the inter-node gathers' ratio on their busy time, the rest's on theirs. Here
// the inter-node gathers (1 s) halve their bytes and the in-node ones (0.1 s) keep theirs: at most
// 0.5 s saved, 4 / 3.5. The pooled ratio (200 / 150 bytes) on all 1.1 s saves 0.275 s: 4 / 3.725,
// below what a schedule can reach.
TEST(SimCollectives, ByteReductionBoundIsTakenPerGatherGroup) {
  const uint64_t across = gather_link(16, true, Algorithm::kRing),
                 inside = gather_link(8, false, Algorithm::kRing);
  Breakdown base, coded;
  base.total_s = 4;
  base.allgather_busy_s = 1.1;
  base.allgather_bytes = 200;
  base.allgather_links = {{across, {1.0, 100}}, {inside, {0.1, 100}}};
  coded.allgather_bytes = 150;
  coded.allgather_links = {{across, {0.5, 50}}, {inside, {0.1, 100}}};
  EXPECT_NEAR(byte_reduction_bound(base, coded), 4 / 3.5, 1e-12);
  EXPECT_NEAR(byte_reduction_bound(base.allgather_busy_s / base.total_s, 200.0 / 150), 4 / 3.725,
              1e-12);  // pooled: below the bound per group
  // One group alone is the pooled bound.
  base.allgather_links = {{across, {1.1, 200}}};
  coded.allgather_links = {{across, {0.8, 150}}};
  EXPECT_NEAR(byte_reduction_bound(base, coded),
              byte_reduction_bound(base.allgather_busy_s / base.total_s, 200.0 / 150), 1e-12);
  // Two groups that both span nodes are two links (a trace's shard and post-forward groups, each
  // with its curve): pooled, the bound fell below the speedup (an audit's trace).
  const uint64_t two = gather_link(2, true, Algorithm::kRing);
  base.allgather_links = {{across, {1.0, 100}}, {two, {0.1, 100}}};
  coded.allgather_links = {{across, {0.5, 50}}, {two, {0.1, 100}}};
  EXPECT_NEAR(byte_reduction_bound(base, coded), 4 / 3.5, 1e-12);
  // Gathers on other links than the baseline's: no bound from bytes.
  coded.allgather_links = {{across, {0.5, 50}}, {inside, {0.1, 100}}};
  EXPECT_TRUE(std::isnan(byte_reduction_bound(base, coded)));
}

// Against ZeRO-3 (no codec time of its own) the bound holds for every model, cluster, topology,
// dtype and size the tool projects.
TEST(SimTopology, NoProjectedSpeedupOverZero3ExceedsTheByteReductionBound) {
  const std::string config = builtin_cluster_config();
  int checked = 0;
  for (const ModelShape& m : model_zoo()) {
    const ChangeRates rates = paper_rates(m);
    for (const std::string& name : cluster_names(config)) {
      const Cluster c = load_cluster(config, name);
      for (Topology topology : {Topology::kFlat, Topology::kPartial, Topology::kHsdp}) {
        for (DType dtype : {DType::kBF16, DType::kFP16}) {
          for (int gpus : {8, 16, 32, 64, 128}) {
            if (gpus % c.gpus_per_node != 0) continue;
            Workload w;
            w.world = gpus;
            w.dtype = dtype;
            w.topology = topology;
            const Projection zero3 = project(m, c, w, rates, System::kZero3);
            const Projection ciera = project(m, c, w, rates, System::kCiera);
            const double speedup = zero3.breakdown.total_s / ciera.breakdown.total_s;
            EXPECT_LE(speedup, byte_reduction_bound(zero3.breakdown, ciera.breakdown) + 1e-9)
                << m.name << " " << name << " " << topology_name(topology) << " "
                << dtype_name(dtype) << " " << gpus << " GPUs";
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

// ---- Schedule -------------------------------------------------------------------------------

UnitCost simple_unit() {
  UnitCost u;
  u.forward_s = 1;
  u.backward_s = 2;
  u.allgather_forward_s = u.allgather_backward_s = 0.5;
  u.reduce_scatter_s = 0.25;
  return u;
}

TEST(SimSchedule, NoPrefetchSerialisesGathersAndCompute) {
  // Gathers 0.5 each before every unit; the second backward gather waits for the first
  // reduce-scatter on the channel (5.5 -> 5.75); the last reduce-scatter ends at 8.5.
  ScheduleOptions options;
  options.prefetch_depth = 0;
  const Breakdown b = simulate_iteration({simple_unit(), simple_unit()}, 0.1, options);
  EXPECT_NEAR(b.total_s, 8.6, 1e-12);
  EXPECT_NEAR(b.compute_s, 6.0, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 2.0, 1e-12);
  EXPECT_NEAR(b.exposed_reduce_scatter_s, 0.5, 1e-12);  // 0.25 before the gather, 0.25 at the end
  EXPECT_NEAR(b.optimizer_s, 0.1, 1e-12);
  EXPECT_NEAR(b.allgather_busy_s, 2.0, 1e-12);
}

TEST(SimSchedule, PrefetchHidesAllButTheFirstGather) {
  const Breakdown b = simulate_iteration({simple_unit(), simple_unit()}, 0.1, ScheduleOptions{});
  EXPECT_NEAR(b.total_s, 6.85, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 0.5, 1e-12);
  EXPECT_NEAR(b.exposed_reduce_scatter_s, 0.25, 1e-12);
  EXPECT_NEAR(b.exposed_codec_s, 0.0, 1e-12);
  EXPECT_NEAR(b.compute_s + b.exposed_allgather_s + b.exposed_reduce_scatter_s + b.optimizer_s,
              b.total_s, 1e-12);
}

TEST(SimSchedule, EncodeRunsAheadAndDecodeIsOnTheCriticalPath) {
  // One unit: encode 0.5 from iteration start, gather 1, decode 0.2. Forward waits 1.7 (0.5 encode,
  // 1.0 wire, 0.2 decode); the backward gather was prefetched under the forward compute, so only
  // its decode (0.2) is exposed.
  UnitCost u;
  u.forward_s = u.backward_s = 1;
  u.allgather_forward_s = u.allgather_backward_s = 1;
  u.pre_forward_s = u.pre_backward_s = 0.5;
  u.post_forward_s = u.post_backward_s = 0.2;
  ScheduleOptions options;
  options.pre_from_start = true;
  const Breakdown b = simulate_iteration({u}, 0, options);
  EXPECT_NEAR(b.total_s, 3.9, 1e-12);
  EXPECT_NEAR(b.exposed_codec_s, 0.9, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 1.0, 1e-12);
  EXPECT_NEAR(b.compute_s, 2.0, 1e-12);
}

TEST(SimSchedule, SequentialScheduleIsTheSumOfEveryStep) {
  // CPU ranks: no prefetch, reduce-scatters block. Gathers 4 x 0.5, compute 2 x (1 + 2),
  // reduce-scatters 2 x 0.25, optimizer 0.1: 2 + 6 + 0.5 + 0.1.
  ScheduleOptions options;
  options.prefetch_depth = 0;
  options.blocking_reduce_scatter = true;
  const Breakdown b = simulate_iteration({simple_unit(), simple_unit()}, 0.1, options);
  EXPECT_NEAR(b.total_s, 8.6, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 2.0, 1e-12);
  EXPECT_NEAR(b.exposed_reduce_scatter_s, 0.5, 1e-12);
  EXPECT_NEAR(b.exposed_codec_s, 0.0, 1e-12);
  // With codec work: encode 0.1 before and decode 0.2 after every gather, all in turn.
  UnitCost u = simple_unit();
  u.pre_forward_s = u.pre_backward_s = 0.1;
  u.post_forward_s = u.post_backward_s = 0.2;
  const Breakdown c = simulate_iteration({u, u, u}, 0.1, options);
  EXPECT_NEAR(c.total_s, 6 * (0.1 + 0.5 + 0.2) + 3 * (1 + 2) + 3 * 0.25 + 0.1, 1e-12);
  EXPECT_NEAR(c.exposed_codec_s, 6 * 0.3, 1e-12);
  EXPECT_NEAR(c.exposed_allgather_s, 6 * 0.5, 1e-12);
  EXPECT_NEAR(c.exposed_reduce_scatter_s, 3 * 0.25, 1e-12);
}

TEST(SimSchedule, BlockingReduceScatterWithPrefetch) {
  // Gathers 0.5, forward 1, backward 2, reduce-scatter 0.25, prefetch 1: the first gather is
  // exposed (0.5), the others are hidden under compute; each reduce-scatter stalls the loop.
  // Forward 0.5-1.5, 1.5-2.5; backward 2.5-4.5, RS 4.5-4.75, backward 4.75-6.75, RS -7.0.
  ScheduleOptions options;
  options.blocking_reduce_scatter = true;
  const Breakdown b = simulate_iteration({simple_unit(), simple_unit()}, 0.1, options);
  EXPECT_NEAR(b.total_s, 7.1, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 0.5, 1e-12);
  EXPECT_NEAR(b.exposed_reduce_scatter_s, 0.5, 1e-12);
  EXPECT_NEAR(b.compute_s + b.exposed_allgather_s + b.exposed_reduce_scatter_s + b.optimizer_s,
              b.total_s, 1e-12);
}

TEST(SimSchedule, AUnitNotRegatheredInBackwardWaitsForNothing) {
  // Unit 0 (the FSDP root) has no backward gather. Without prefetch its backward would otherwise
  // wait for unit 1's reduce-scatter on the channel (asynchronous reduce-scatters).
  UnitCost root = simple_unit();
  root.allgather_backward_s = 0;
  ScheduleOptions options;
  options.prefetch_depth = 0;
  const Breakdown b = simulate_iteration({root, simple_unit()}, 0, options);
  // Forward 0.5 + 1 + 0.5 + 1; backward gather 0.5 + 2; root backward starts at once (5.5), ends
  // 7.5; its reduce-scatter waits for unit 1's (5.5-5.75), runs 7.5-7.75.
  EXPECT_NEAR(b.total_s, 7.75, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 1.5, 1e-12);
  EXPECT_NEAR(b.allgather_busy_s, 1.5, 1e-12);
}

TEST(SimSchedule, AllReduceFollowsTheReduceScatterOnTheChannel) {
  // As NoPrefetchSerialisesGathersAndCompute, with an all-reduce of 0.5 after each reduce-scatter
  // (HSDP). Backward: unit 1's reduce-scatter 5.5-5.75, all-reduce -6.25; unit 0's gather waits for
  // both (exposed 0.75, of which 0.5 all-reduce), runs 6.25-6.75; compute -8.75; reduce-scatter
  // -9.0, all-reduce -9.5, exposed before the optimizer; optimizer 0.1.
  UnitCost u = simple_unit();
  u.allreduce_s = 0.5;
  u.allreduce_bytes = 100;
  u.allgather_forward_inter_node = true;  // forward gathers across nodes, backward inside one
  ScheduleOptions options;
  options.prefetch_depth = 0;
  const Breakdown b = simulate_iteration({u, u}, 0.1, options);
  EXPECT_NEAR(b.total_s, 9.6, 1e-12);
  EXPECT_NEAR(b.exposed_reduce_scatter_s, 1.5, 1e-12);
  EXPECT_NEAR(b.exposed_allreduce_s, 1.0, 1e-12);
  EXPECT_NEAR(b.reduce_scatter_busy_s, 0.5, 1e-12);
  EXPECT_NEAR(b.allreduce_busy_s, 1.0, 1e-12);
  EXPECT_NEAR(b.allreduce_bytes, 200, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_s, 2.0, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_forward_s, 1.0, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_backward_s, 1.0, 1e-12);
  EXPECT_NEAR(b.exposed_allgather_inter_node_s, 1.0, 1e-12);
  EXPECT_NEAR(b.allgather_inter_node_busy_s, 1.0, 1e-12);
  EXPECT_NEAR(b.compute_s + b.exposed_allgather_s + b.exposed_reduce_scatter_s + b.optimizer_s,
              b.total_s, 1e-12);
}

TEST(SimSchedule, CodecBusyTimesCountEveryGathersPreAndPostWork) {
  UnitCost u = simple_unit();
  u.pre_forward_s = 0.1;
  u.pre_backward_s = 0.05;
  u.post_forward_s = u.post_backward_s = 0.2;
  const Breakdown b = simulate_iteration({u, u, u}, 0, ScheduleOptions{});
  EXPECT_NEAR(b.encode_busy_s, 3 * 0.15, 1e-12);
  EXPECT_NEAR(b.decode_busy_s, 6 * 0.2, 1e-12);
}

// ---- Systems --------------------------------------------------------------------------------

ModelShape tiny_model() {
  ModelShape m;
  m.name = "tiny";
  m.display = "Tiny";
  m.layers = 1;
  m.hidden = 64;
  m.heads = m.kv_heads = 1;
  m.head_dim = 64;
  m.routed_experts = 2;
  m.experts_per_token = 1;
  m.expert_intermediate = 128;
  m.vocab = 100;
  return m;
}

TEST(SimSystems, ZeroPlusPlusSendsInt8ForwardRawBackwardAndInt4Gradients) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  Workload w;
  w.world = 8;
  w.dtype = DType::kFP16;
  ChangeRates rates;
  const Projection p = project(m, c, w, rates, System::kZeroPP);
  double forward = 0, backward = 0, grads = 0;
  for (const GatherUnit& unit : model_units(m, 0, w.seq_len)) {
    const double n = static_cast<double>(unit.gathered_values());
    forward += n + std::ceil(n / 4096) * 4;  // int8 + one FP32 scale per 4096-value block
    backward += 2 * n;                       // hpZ: FP16 secondary copy
    const double g = static_cast<double>(unit.grad_values);
    grads += g / 2 + std::ceil(g / 4096) * 4;  // int4 + scales
  }
  EXPECT_NEAR(p.breakdown.allgather_bytes, forward + backward, 1e-6);
  EXPECT_NEAR(p.breakdown.reduce_scatter_bytes, grads, 1e-6);
}

// A BF16 payload's 80-byte header and bitmap for `n` values in `blocks` blocks, with the padding
// that puts a sign-mantissa plane of 64 KiB or more on a multiple of 64 (docs/format.md).
double head_bytes(double n, double blocks) {
  const double head = 80 + std::ceil(blocks / 8);
  return n >= 65536 ? std::ceil(head / 64) * 64 : head;
}

TEST(SimSystems, CieraSendsSignMantissaBitmapAndChangedExponents) {
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.inter.GBps = 0.001;  // a slow link: every type pays for its decode
  Workload w;
  w.world = 8;
  ChangeRates rates;
  for (ShardType type : kAllShardTypes) rates.of(type).block = 0.25;
  const Projection p = project(m, c, w, rates, System::kCiera);
  // Each of the 8 ranks sends a frame for its 1/8 of each shard type: an 80-byte header, a BF16
  // sign-mantissa byte per value, a bitmap bit per 512-value block (whole bytes), and in the
  // forward gather the exponent byte of every value of the changed blocks (block mode: with no
  // element rate known, fine mode is assumed to cost more).
  auto frames = [](double values, double q) {
    const double n = std::ceil(values / 8);
    const double blocks = std::ceil(n / 512);
    return 8 * (head_bytes(n, blocks) + n + q * n);
  };
  for (ShardType type : {ShardType::kExpertFfn, ShardType::kAttention, ShardType::kEmbedding}) {
    EXPECT_TRUE(p.selected[static_cast<size_t>(type)]) << to_string(type);
  }
  // A norm shard is 8 values per rank: its 80-byte headers cost more than it saves. Sent raw.
  EXPECT_FALSE(p.selected[static_cast<size_t>(ShardType::kNorm)]);
  double expected = 0;
  for (const GatherUnit& unit : model_units(m, 0, w.seq_len)) {
    for (const ShardGroup& s : unit.shards) {
      const double n = static_cast<double>(s.values);
      if (!p.selected[static_cast<size_t>(s.type)]) {
        expected += 2 * 2 * n;  // raw BF16, forward and backward
        continue;
      }
      expected += frames(n, 0.25);  // forward
      expected += frames(n, 0.0);   // backward: nothing changed
    }
  }
  EXPECT_NEAR(p.breakdown.allgather_bytes, expected, 1e-6);
  const Projection base = project(m, c, w, rates, System::kZero3);
  EXPECT_LT(p.breakdown.total_s, base.breakdown.total_s);
}

TEST(SimSystems, CieraPayloadIsTheEncodersSmallerMode) {
  // With the element rate known, fine mode (1.5 B per changed value + 1 B per changed block)
  // replaces block mode where it is smaller, as in the encoder (ciera::expected_payload_bytes).
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.inter.GBps = 0.001;
  Workload w;
  w.world = 2;
  ChangeRates rates;
  for (ShardType type : kAllShardTypes) {
    rates.of(type).block = 0.5;
    rates.of(type).element = 0.01;
  }
  const Projection p = project(m, c, w, rates, System::kCiera);
  double expected = 0;
  for (const GatherUnit& unit : model_units(m, 0, w.seq_len)) {
    for (const ShardGroup& s : unit.shards) {
      if (!p.selected[static_cast<size_t>(s.type)]) {
        expected += 2 * 2 * static_cast<double>(s.values);
        continue;
      }
      const double n = std::ceil(static_cast<double>(s.values) / 2);  // per rank
      const double blocks = std::ceil(n / 512);
      const double head = head_bytes(n, blocks) + n;
      expected += 2 * (head + std::min(0.5 * n, 0.01 * n * 1.5 + 0.5 * blocks * 1.0));
      expected += 2 * head;
    }
  }
  EXPECT_TRUE(p.selected[static_cast<size_t>(ShardType::kExpertFfn)]);
  EXPECT_NEAR(p.breakdown.allgather_bytes, expected, 1e-6);
}

TEST(SimSystems, SelectionSkipsTypesThatChangeEveryBlock) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  Workload w;
  w.world = 4;
  ChangeRates rates;
  for (ShardType type : kAllShardTypes) rates.of(type).block = 1.0;
  rates.of(ShardType::kExpertFfn).block = 0.0;
  const Projection p = project(m, c, w, rates, System::kCiera);
  EXPECT_TRUE(p.selected[static_cast<size_t>(ShardType::kExpertFfn)]);
  // q = 1 saves only the... nothing in forward, but the backward gather still saves exponents, so
  // a type is skipped only when decoding costs more than that: make decode slow.
  Cluster slow_decode = c;
  slow_decode.decode_GBps = 0.001;
  const Projection q = project(m, slow_decode, w, rates, System::kCiera);
  for (ShardType type : kAllShardTypes)
    EXPECT_FALSE(q.selected[static_cast<size_t>(type)]) << to_string(type);
}

// Detect and encode are overlapped, so BSC's rule ignores them; where the schedule cannot hide
// them (kernels far slower than the links), the types they slow are dropped: CIERA is never
// projected slower than ZeRO-3, whose gathers are its all-raw ones. Kernels as fast as the
// preset keep every type the rule chose.
TEST(SimSystems, SelectionDropsTypesWhoseEncodeTheScheduleCannotHide) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  Workload w;
  w.world = 4;
  const ChangeRates rates;
  const Projection fast = project(m, c, w, rates, System::kCiera);
  EXPECT_TRUE(fast.selected[static_cast<size_t>(ShardType::kExpertFfn)]);
  for (const bool slow_detect : {false, true}) {
    Cluster slow = c;
    (slow_detect ? slow.detect_GBps : slow.encode_GBps) = 1e-6;
    const Projection zero3 = project(m, slow, w, rates, System::kZero3);
    const Projection ciera = project(m, slow, w, rates, System::kCiera);
    EXPECT_LE(ciera.breakdown.total_s, zero3.breakdown.total_s * (1 + 1e-12))
        << (slow_detect ? "detect" : "encode");
    for (ShardType type : kAllShardTypes)
      EXPECT_FALSE(ciera.selected[static_cast<size_t>(type)]) << to_string(type);
  }
}

// ---- Topologies: flat, partial resharding, HSDP -----------------------------------------------

Projection project_on(const ModelShape& m, const Cluster& c, int world, System system,
                      Topology topology, const ChangeRates& rates = ChangeRates{}) {
  Workload w;
  w.world = world;
  w.topology = topology;
  return project(m, c, w, rates, system);
}

double unit_sum(const ModelShape& m, double (*per_unit)(const GatherUnit&)) {
  double sum = 0;
  for (const GatherUnit& unit : model_units(m, 0, 1024)) sum += per_unit(unit);
  return sum;
}

TEST(SimTopology, FlatIsTheDefaultAndReproducesThePublishedProjection) {
  // docs/simulator.md, "First projection against the paper": OLMoE at 16 GPUs on a100-hdr.
  const ModelShape& m = find_model("olmoe-1b-7b");
  const Cluster c = load_cluster(builtin_cluster_config(), "a100-hdr");
  const ChangeRates rates = paper_rates(m);
  Workload w;
  w.world = 16;
  EXPECT_EQ(w.topology, Topology::kFlat);
  EXPECT_NEAR(project(m, c, w, rates, System::kZero3).breakdown.total_s, 4.880, 5e-4);
  EXPECT_NEAR(project(m, c, w, rates, System::kCiera).breakdown.total_s, 3.292, 5e-4);
  w.dtype = DType::kFP16;
  EXPECT_NEAR(project(m, c, w, rates, System::kZeroPP).breakdown.total_s, 1.181, 5e-4);
  EXPECT_NEAR(project(m, c, w, rates, System::kCiera).breakdown.total_s, 3.900, 5e-4);
}

TEST(SimTopology, PartialReshardingKeepsOnlyForwardGathersAcrossNodes) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();  // 2 nodes of 4 GPUs
  const double raw =
      2 * unit_sum(m, [](const GatherUnit& u) { return static_cast<double>(u.gathered_values()); });
  const Projection flat = project_on(m, c, 8, System::kZero3, Topology::kFlat);
  const Projection partial = project_on(m, c, 8, System::kZero3, Topology::kPartial);
  EXPECT_NEAR(flat.breakdown.allgather_inter_node_bytes, 2 * raw, 1e-6);  // both gathers
  EXPECT_NEAR(partial.breakdown.allgather_bytes, 2 * raw, 1e-6);
  EXPECT_NEAR(partial.breakdown.allgather_inter_node_bytes, raw, 1e-6);  // forward only
  EXPECT_EQ(partial.breakdown.exposed_allgather_inter_node_s,
            partial.breakdown.exposed_allgather_forward_s);
  EXPECT_NEAR(partial.breakdown.reduce_scatter_bytes, flat.breakdown.reduce_scatter_bytes, 1e-6);
  EXPECT_EQ(partial.breakdown.allreduce_bytes, 0.0);
  // Backward gathers on NVLink instead of the slow link: busy time drops, the forward's stays.
  double intra = 0, inter = 0;
  for (const GatherUnit& unit : model_units(m, 0, 1024)) {
    intra += ring_seconds(4, 2.0 * unit.gathered_values(), c.intra);
    inter += allgather_seconds(c, 8, 2.0 * unit.gathered_values(), Algorithm::kRing);
  }
  EXPECT_NEAR(partial.breakdown.allgather_busy_s, inter + intra, 1e-12);
  EXPECT_NEAR(partial.breakdown.allgather_inter_node_busy_s, inter, 1e-12);
  EXPECT_LT(partial.breakdown.total_s, flat.breakdown.total_s);
  // Memory: the model states over 8 GPUs, plus the 1/4 of every unit kept from forward to backward.
  const double params =
      unit_sum(m, [](const GatherUnit& u) { return static_cast<double>(u.grad_values); });
  EXPECT_NEAR(flat.state_bytes_per_gpu, params * 16 / 8, 1e-6);
  EXPECT_NEAR(partial.state_bytes_per_gpu, params * 16 / 8 + params * 2 / 4, 1e-6);
}

TEST(SimTopology, CieraPartialSendsTheNodesOwnFramesInBackward) {
  // Slow links everywhere: every type worth compressing is, on both groups. Forward frames over the
  // 8 GPUs of the world; backward frames over the 4 GPUs of the node, with a step's exponent
  // changes (the node's engine last gathered the unit a step ago).
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.inter.GBps = 0.001;
  c.intra.GBps = 0.001;
  ChangeRates rates;
  for (ShardType type : kAllShardTypes) rates.of(type).block = 0.25;
  const Projection p = project_on(m, c, 8, System::kCiera, Topology::kPartial, rates);
  ASSERT_TRUE(p.backward_on_node);
  EXPECT_TRUE(p.selected[static_cast<size_t>(ShardType::kExpertFfn)]);
  EXPECT_TRUE(p.selected_backward_on_node[static_cast<size_t>(ShardType::kExpertFfn)]);
  auto frames = [](double values, int ranks, double q) {
    const double n = std::ceil(values / ranks);
    const double blocks = std::ceil(n / 512);
    return ranks * (head_bytes(n, blocks) + n + q * n);
  };
  double forward = 0, backward = 0;
  for (const GatherUnit& unit : model_units(m, 0, 1024)) {
    for (const ShardGroup& s : unit.shards) {
      const double n = static_cast<double>(s.values);
      const auto t = static_cast<size_t>(s.type);
      forward += p.selected[t] ? frames(n, 8, 0.25) : 2 * n;
      backward += p.selected_backward_on_node[t] ? frames(n, 4, 0.25) : 2 * n;
    }
  }
  EXPECT_NEAR(p.breakdown.allgather_inter_node_bytes, forward, 1e-6);
  EXPECT_NEAR(p.breakdown.allgather_bytes, forward + backward, 1e-6);
}

TEST(SimTopology, SelectionInsideTheNodeIsItsOwn) {
  // A decoder slower than NVLink: compressing the node's backward gathers costs more than it
  // saves, while the forward gathers across the slow link still gain.
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.inter.GBps = 0.001;
  c.intra.GBps = 1000;
  c.decode_GBps = 10;
  ChangeRates rates;
  for (ShardType type : kAllShardTypes) rates.of(type).block = 0.0;
  const Projection p = project_on(m, c, 8, System::kCiera, Topology::kPartial, rates);
  EXPECT_TRUE(p.selected[static_cast<size_t>(ShardType::kExpertFfn)]);
  for (ShardType type : kAllShardTypes)
    EXPECT_FALSE(p.selected_backward_on_node[static_cast<size_t>(type)]) << to_string(type);
}

TEST(SimTopology, HsdpGathersInsideTheNodeAndAllReducesAcrossNodes) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  for (System system : {System::kZero3, System::kCiera}) {
    const Projection flat = project_on(m, c, 8, system, Topology::kFlat);
    const Projection hsdp = project_on(m, c, 8, system, Topology::kHsdp);
    EXPECT_GT(hsdp.breakdown.allgather_bytes, 0.0);
    EXPECT_EQ(hsdp.breakdown.allgather_inter_node_bytes, 0.0);
    EXPECT_EQ(hsdp.breakdown.allgather_inter_node_busy_s, 0.0);
    EXPECT_EQ(hsdp.breakdown.exposed_allgather_inter_node_s, 0.0);
    // The optimizer steps 1/4 of the parameters instead of 1/8; the states are sharded 4 ways.
    EXPECT_NEAR(hsdp.breakdown.optimizer_s, 2 * flat.breakdown.optimizer_s, 1e-15);
    EXPECT_NEAR(hsdp.state_bytes_per_gpu, 2 * flat.state_bytes_per_gpu, 1e-6);
  }
  const Projection z = project_on(m, c, 8, System::kZero3, Topology::kHsdp);
  double grads = 0, allreduce = 0, reduce_scatter = 0;
  for (const GatherUnit& unit : model_units(m, 0, 1024)) {
    const double g = 2.0 * unit.grad_values;
    grads += g;
    if (g > 0) allreduce += allreduce_seconds(2, g, c.inter);
    reduce_scatter += ring_seconds(4, g, c.intra);
  }
  EXPECT_NEAR(z.breakdown.reduce_scatter_bytes, grads, 1e-6);  // over the node
  EXPECT_NEAR(z.breakdown.allreduce_bytes, grads / 4, 1e-6);   // the node's 1/4, per GPU
  EXPECT_NEAR(z.breakdown.reduce_scatter_busy_s, reduce_scatter, 1e-12);
  EXPECT_NEAR(z.breakdown.allreduce_busy_s, allreduce, 1e-12);
}

TEST(SimTopology, OnOneNodeEveryTopologyIsFlat) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  for (System system : {System::kZero3, System::kCiera}) {
    const Projection flat = project_on(m, c, 4, system, Topology::kFlat);
    for (Topology t : {Topology::kPartial, Topology::kHsdp}) {
      const Projection p = project_on(m, c, 4, system, t);
      EXPECT_EQ(p.breakdown.total_s, flat.breakdown.total_s) << topology_name(t);
      EXPECT_EQ(p.state_bytes_per_gpu, flat.state_bytes_per_gpu);
      EXPECT_FALSE(p.backward_on_node);
    }
  }
}

TEST(SimTopology, BadTopologiesAreRejected) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  expect_error([&] { project_on(m, c, 6, System::kZero3, Topology::kHsdp); },
               {"6 GPUs", "nodes of 4"});
  expect_error([&] { project_on(m, c, 8, System::kZeroPP, Topology::kPartial); },
               {"topology partial", "ZeRO-3 and CIERA only", "ZeRO++"});
  expect_error([] { parse_topology("ring"); }, {"\"ring\"", "flat, partial or hsdp"});
  EXPECT_EQ(parse_topology("hsdp"), Topology::kHsdp);
  EXPECT_EQ(topology_name(Topology::kPartial), "partial");
}

TEST(SimTopology, ZeroPlusPlusKeepsItsSecondaryCopyInTheNode) {
  const ModelShape m = tiny_model();
  const Cluster c = two_tier_cluster();
  Workload w;
  w.world = 8;
  w.dtype = DType::kFP16;
  const Projection p = project(m, c, w, ChangeRates{}, System::kZeroPP);
  double forward = 0, params = 0;
  for (const GatherUnit& unit : model_units(m, 0, w.seq_len)) {
    const double n = static_cast<double>(unit.gathered_values());
    forward += n + std::ceil(n / 4096) * 4;
    params += static_cast<double>(unit.grad_values);
  }
  EXPECT_NEAR(p.breakdown.allgather_inter_node_bytes, forward, 1e-6);  // qwZ only; hpZ inside
  EXPECT_NEAR(p.state_bytes_per_gpu, params * 16 / 8 + params * 2 / 4, 1e-6);
}

// ---- Gather schemes: SDP4Bit and stateless exponent coding -----------------------------------

// One GPU gathers nothing: no scheme codes anything, so each costs as ZeRO-3 (charged their
// kernels, stateless coding came out 3.5x slower than CIERA with no communication at all).
TEST(SimSystems, OnOneGpuEverySchemeCostsAsZero3) {
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.quantize_GBps = 500;
  c.dequantize_GBps = 250;
  Workload w;
  w.world = 1;
  const ChangeRates rates = paper_rates(find_model("olmoe-1b-7b"));
  const Projection base = project(m, c, w, rates, System::kZero3);
  EXPECT_GT(base.breakdown.total_s, 0);
  for (System system : {System::kZeroPP, System::kCiera, System::kSdp4Bit, System::kStateless}) {
    const Projection p = project(m, c, w, rates, system);
    EXPECT_EQ(p.breakdown.total_s, base.breakdown.total_s) << system_name(system);
    EXPECT_EQ(p.breakdown.allgather_bytes, base.breakdown.allgather_bytes) << system_name(system);
    EXPECT_EQ(p.breakdown.exposed_codec_s, 0) << system_name(system);
  }
}

TEST(SimSystems, Sdp4BitSendsFourBitDifferencesInEveryGatherAndRawGradients) {
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.quantize_GBps = 500;  // the built-in SDP4Bit figures take the cluster's ZeRO++ kernels
  c.dequantize_GBps = 250;
  Workload w;
  w.world = 8;
  w.prefetch_depth = 0;  // every gather in turn, so its codec steps are all exposed
  ChangeRates rates;
  const Projection p = project(m, c, w, rates, System::kSdp4Bit);
  const Projection base = project(m, c, w, rates, System::kZero3);
  // 4 bits + one FP32 scale per 2048 values, against 16 bits, forward and backward.
  EXPECT_NEAR(p.breakdown.allgather_bytes / base.breakdown.allgather_bytes, 4.015625 / 16, 1e-12);
  EXPECT_DOUBLE_EQ(p.breakdown.reduce_scatter_bytes, base.breakdown.reduce_scatter_bytes);
  EXPECT_DOUBLE_EQ(p.breakdown.reduce_scatter_busy_s, base.breakdown.reduce_scatter_busy_s);
  // Quantise the own shard before the forward gather; dequantise the whole gathered tensor
  // (lossy: the own shard too) after both gathers; the backward re-sends the forward's shard.
  double codec = 0;
  for (const GatherUnit& unit : model_units(m, 0, w.seq_len)) {
    const double raw = 2.0 * static_cast<double>(unit.gathered_values());
    codec += raw / 8 / 500e9 + 2 * raw / 250e9;
  }
  EXPECT_NEAR(p.breakdown.exposed_codec_s, codec, 1e-15);
  EXPECT_GT(codec, 0);
}

TEST(SimSystems, StatelessCodesEveryValueOfEveryGather) {
  const ModelShape m = tiny_model();
  Cluster c = two_tier_cluster();
  c.encode_GBps = 300;
  c.decode_GBps = 600;
  Workload w;
  w.world = 4;
  w.schemes.stateless.bits_per_value = 10.0;
  w.schemes.stateless.measured = BenchThroughputs{1, 2, 10, 4};  // a tenth / half of CIERA's
  ChangeRates rates;
  const GatherCodec codec = gather_codec(w.schemes.stateless, c, DType::kBF16);
  EXPECT_DOUBLE_EQ(codec.encode_GBps, 30);
  EXPECT_DOUBLE_EQ(codec.decode_GBps, 300);
  const Projection p = project(m, c, w, rates, System::kStateless);
  const Projection base = project(m, c, w, rates, System::kZero3);
  EXPECT_NEAR(p.breakdown.allgather_bytes / base.breakdown.allgather_bytes, 10.0 / 16, 1e-12);
  EXPECT_DOUBLE_EQ(p.breakdown.reduce_scatter_bytes, base.breakdown.reduce_scatter_bytes);
  // Without prefetch every decode (the W-1 peer shards, on the critical path) is exposed; the
  // encodes ran ahead from iteration start, and with a decode this slow they are done by the
  // time each gather is issued (the first, before anything else, excepted).
  c.decode_GBps = 0.6;
  w.prefetch_depth = 0;
  const Projection slow = project(m, c, w, rates, System::kStateless);
  const std::vector<GatherUnit> units = model_units(m, 0, w.seq_len);
  double decode = 0;
  for (const GatherUnit& unit : units)
    decode += 2 * 2.0 * static_cast<double>(unit.gathered_values()) * 3 / 4 / 0.3e9;
  const double first_encode = 2.0 * static_cast<double>(units[0].gathered_values()) / 4 / 30e9;
  EXPECT_NEAR(slow.breakdown.exposed_codec_s, decode + first_encode, 1e-12);
}

TEST(SimSystems, StatelessSitsBetweenCieraAndZero3WithTheDefaultFigures) {
  const ModelShape& m = find_model("olmoe-1b-7b");
  const Cluster c = load_cluster(builtin_cluster_config(), "a100-hdr");
  Workload w;
  w.world = 16;
  const ChangeRates rates = paper_rates(m);
  const double zero3 = project(m, c, w, rates, System::kZero3).breakdown.allgather_bytes;
  const double stateless = project(m, c, w, rates, System::kStateless).breakdown.allgather_bytes;
  const double ciera = project(m, c, w, rates, System::kCiera).breakdown.allgather_bytes;
  EXPECT_LT(ciera, stateless);
  EXPECT_LT(stateless, zero3);
  EXPECT_NEAR(stateless / zero3, 10.543 / 16, 1e-12);  // docs/benchmarks.md's stateless row
  const double sdp4bit = project(m, c, w, rates, System::kSdp4Bit).breakdown.allgather_bytes;
  EXPECT_NEAR(sdp4bit / zero3, 4.015625 / 16, 1e-12);
}

TEST(SimSystems, DefaultSchemeFiguresAndWhereTheirThroughputsComeFrom) {
  const GatherSchemes d = default_gather_schemes();
  EXPECT_DOUBLE_EQ(d.sdp4bit.bits_per_value, 4 + 32.0 / 2048);
  EXPECT_FALSE(d.sdp4bit.dtype.has_value());
  EXPECT_FALSE(d.sdp4bit.measured.has_value());  // the cluster's (de)quantise kernels, on purpose
  Cluster c = two_tier_cluster();
  c.quantize_GBps = 123;
  c.dequantize_GBps = 45;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const GatherCodec q = gather_codec(d.sdp4bit, c, dtype);
    EXPECT_DOUBLE_EQ(q.encode_GBps, 123);
    EXPECT_DOUBLE_EQ(q.decode_GBps, 45);
  }
  ASSERT_TRUE(d.stateless.measured.has_value());
  EXPECT_EQ(d.stateless.dtype, DType::kBF16);
  EXPECT_GT(d.stateless.bits_per_value, 8);
  EXPECT_LT(d.stateless.bits_per_value, 16);
  // Stateless coding's bits depend on the exponent width: BF16 figures do not project FP16.
  Workload w;
  w.world = 8;
  w.dtype = DType::kFP16;
  expect_error([&] { project(tiny_model(), c, w, ChangeRates{}, System::kStateless); },
               {"--baseline stateless", "measured in bf16", "not fp16", "--codec-bench"});
}

// A `ciera bench codec --json` output, reduced to what the simulator reads, in a file of its own.
class CodecBenchFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             ("ciera_sim_codec_bench_" + std::to_string(::getpid()) + ".json"))
                .string();
  }
  void TearDown() override { std::filesystem::remove(path_); }

  static std::string bench(const std::string& rows, const std::string& dtype = "bf16") {
    return R"({"command": "ciera bench codec --json", "config": {"dtype": ")" + dtype +
           R"(", "values": 16777216}, "encode_GBps": 6.0, "decode_GBps": 9.0, "comparisons": [)" +
           rows + "]}";
  }
  static constexpr const char* kCiera =
      R"({"name": "ciera-auto", "bits_per_value": 8.098, "encode_GBps": 6.0, "decode_GBps": 9.0,
          "verified": true})";
  static constexpr const char* kStateless =
      R"({"name": "stateless", "bits_per_value": 10.5, "encode_GBps": 0.6, "decode_GBps": 1.8,
          "verified": true})";
  static constexpr const char* kSdp4Bit =
      R"({"name": "sdp4bit", "bits_per_value": 4.02, "encode_GBps": 3.0, "decode_GBps": 4.5,
          "verified": false})";

  // Writes `text` to the file and applies it for `names`, as `--codec-bench FILE` does.
  GatherSchemes apply(const std::string& text, const std::vector<std::string>& names) {
    std::ofstream(path_) << text;
    GatherSchemes schemes = default_gather_schemes();
    apply_codec_bench(schemes, read_text_file(path_, "codec bench"), "codec bench " + path_,
                      names);
    return schemes;
  }
  std::string path_;
};

TEST_F(CodecBenchFile, RowsReplaceTheBuiltInFiguresScaledByCierasRow) {
  const std::string rows = std::string(kCiera) + "," + kStateless + "," + kSdp4Bit;
  const GatherSchemes s = apply(bench(rows), {"zero3", "sdp4bit", "stateless"});
  EXPECT_DOUBLE_EQ(s.stateless.bits_per_value, 10.5);
  EXPECT_DOUBLE_EQ(s.sdp4bit.bits_per_value, 4.02);
  ASSERT_TRUE(s.sdp4bit.measured.has_value());
  EXPECT_NE(s.stateless.source.find(path_), std::string::npos);
  Cluster c = two_tier_cluster();
  c.encode_GBps = 600;
  c.decode_GBps = 900;
  const GatherCodec stateless = gather_codec(s.stateless, c, DType::kBF16);
  EXPECT_DOUBLE_EQ(stateless.encode_GBps, 600 * 0.6 / 6.0);
  EXPECT_DOUBLE_EQ(stateless.decode_GBps, 900 * 1.8 / 9.0);
  // A lossy row need not verify bit for bit.
  const GatherCodec sdp4bit = gather_codec(s.sdp4bit, c, DType::kFP16);
  EXPECT_DOUBLE_EQ(sdp4bit.encode_GBps, 600 * 3.0 / 6.0);
  EXPECT_DOUBLE_EQ(sdp4bit.decode_GBps, 900 * 4.5 / 9.0);
  // An FP16 bench measures FP16's stateless bits, and projects only FP16.
  const GatherSchemes fp16 = apply(bench(rows, "fp16"), {"stateless"});
  EXPECT_EQ(fp16.stateless.dtype, DType::kFP16);
  expect_error([&] { gather_codec(fp16.stateless, c, DType::kBF16); }, {"measured in fp16"});
}

TEST_F(CodecBenchFile, OnlyTheRowsOfTheBaselinesAskedForAreNeeded) {
  // Today's bench has no "sdp4bit" row: fine unless --baseline sdp4bit asks for it.
  const std::string rows = std::string(kCiera) + "," + kStateless;
  const GatherSchemes s = apply(bench(rows), {"zero3", "stateless"});
  EXPECT_DOUBLE_EQ(s.stateless.bits_per_value, 10.5);
  EXPECT_FALSE(s.sdp4bit.measured.has_value());
  EXPECT_DOUBLE_EQ(s.sdp4bit.bits_per_value, default_gather_schemes().sdp4bit.bits_per_value);
  expect_error([&] { apply(bench(rows), {"sdp4bit"}); },
               {"codec bench " + path_, "no row \"sdp4bit\"", "--baseline sdp4bit",
                "rows: ciera-auto, stateless"});
  // Without CIERA's row there is nothing to scale the throughputs by.
  expect_error([&] { apply(bench(kStateless), {"stateless"}); },
               {path_, "no row \"ciera-auto\"", "yardstick"});
}

TEST_F(CodecBenchFile, MalformedRowsNameTheFileAndTheRow) {
  const std::string zero_encode =
      R"({"name": "stateless", "bits_per_value": 10.5, "encode_GBps": 0, "decode_GBps": 1.8})";
  expect_error([&] { apply(bench(std::string(kCiera) + "," + zero_encode), {"stateless"}); },
               {"codec bench " + path_, "row \"stateless\"", "\"comparisons[1].encode_GBps\"",
                "must be > 0"});
  const std::string no_bits = R"({"name": "stateless", "encode_GBps": 1, "decode_GBps": 1.8})";
  expect_error([&] { apply(bench(std::string(kCiera) + "," + no_bits), {"stateless"}); },
               {path_, "row \"stateless\"", "missing field \"comparisons[1].bits_per_value\""});
  const std::string text_bits =
      R"({"name": "stateless", "bits_per_value": "ten", "encode_GBps": 1, "decode_GBps": 1})";
  expect_error([&] { apply(bench(std::string(kCiera) + "," + text_bits), {"stateless"}); },
               {"row \"stateless\"", "must be a number"});
  const std::string unverified =
      R"({"name": "stateless", "bits_per_value": 10.5, "encode_GBps": 1, "decode_GBps": 1,
          "verified": false})";
  expect_error([&] { apply(bench(std::string(kCiera) + "," + unverified), {"stateless"}); },
               {"row \"stateless\"", "did not verify"});
  const std::string bad_ciera = R"({"name": "ciera-auto", "encode_GBps": 6})";
  expect_error([&] { apply(bench(bad_ciera + "," + kStateless), {"stateless"}); },
               {"row \"ciera-auto\"", "\"comparisons[0].decode_GBps\""});
  expect_error([&] { apply(bench(kStateless, "int4"), {"stateless"}); },
               {path_, "\"config.dtype\"", "int4"});
  expect_error([&] { apply(R"({"config": {"dtype": "bf16"}})", {"stateless"}); },
               {path_, "missing field \"comparisons\""});
  expect_error([&] { apply("{", {"stateless"}); }, {path_, "not valid JSON"});
  expect_error([] { read_text_file("/nonexistent/bench.json", "codec bench"); },
               {"cannot read codec bench /nonexistent/bench.json"});
}

// ---- Model zoo ------------------------------------------------------------------------------

TEST(SimModels, ParameterCountsMatchPublishedTotals) {
  ASSERT_EQ(model_zoo().size(), 6u);
  for (const ModelShape& m : model_zoo()) {
    const double count = static_cast<double>(parameter_count(m, !m.published_without_embeddings));
    EXPECT_NEAR(count / m.published_params, 1.0, 0.03) << m.name << ": " << count / 1e9 << "B";
  }
  EXPECT_NEAR(parameter_count(find_model("olmoe-1b-7b")) / 1e9, 6.92, 0.02);
  EXPECT_NEAR(parameter_count(find_model("mixtral-8x7b")) / 1e9, 46.70, 0.05);
}

TEST(SimModels, UnitsFollowExecutionOrderAndLayerLimit) {
  const ModelShape& m = find_model("deepseek-moe-16b");
  const auto units = model_units(m, 4, 1024);
  ASSERT_EQ(units.size(), 6u);  // embed, 4 layers, head
  EXPECT_EQ(units.front().name, "embed");
  EXPECT_EQ(units.back().name, "head");
  // Layer 0 of DeepSeek-MoE is dense: no router, a dense FFN.
  bool dense = false, router = false;
  for (const ShardGroup& s : units[1].shards) {
    dense |= s.type == ShardType::kDenseFfn;
    router |= s.type == ShardType::kRouter;
  }
  EXPECT_TRUE(dense);
  EXPECT_FALSE(router);
  expect_error([&] { model_units(m, 29, 1024); }, {"--layers 29", "1..28"});
  // The tool checks --layers against every model before projecting any.
  check_layers(m, 0);
  check_layers(m, 28);
  expect_error([&] { check_layers(m, 29); }, {"--layers 29", "1..28", "DeepSeek-MoE-16B"});
  expect_error([&] { check_layers(m, -1); }, {"--layers -1", "1..28"});
}

TEST(SimModels, UnknownModelNamesTheKnownOnes) {
  expect_error([] { find_model("gpt-5"); },
               {"unknown model \"gpt-5\"", "olmoe-1b-7b", "mixtral-8x7b"});
}

TEST(SimModels, ChangeRatesFromPaperAndFromAJsonFile) {
  ChangeRates rates = paper_rates(find_model("olmoe-1b-7b"));
  EXPECT_DOUBLE_EQ(rates.block_rate(ShardType::kExpertFfn), 0.22);
  EXPECT_DOUBLE_EQ(rates.of(ShardType::kExpertFfn).element, 0.0051);  // paper §2.2, top of range
  EXPECT_EQ(rates.of(ShardType::kExpertFfn).source.rfind("paper Fig. 4", 0), 0u);
  EXPECT_LT(rates.of(ShardType::kOther).element, 0);
  apply_rates_json(rates,
                   R"({"expert_ffn": 0.004, "block": {"attention": 0.5}, "block_values": 512})",
                   "rates r.json");
  EXPECT_NEAR(rates.block_rate(ShardType::kExpertFfn), 1 - std::pow(1 - 0.004, 512), 1e-12);
  EXPECT_DOUBLE_EQ(rates.block_rate(ShardType::kAttention), 0.5);
  EXPECT_EQ(rates.of(ShardType::kExpertFfn).source, "rates r.json");
  EXPECT_EQ(rates.of(ShardType::kAttention).source.rfind("rates r.json; element ", 0), 0u);
  expect_error([&] { apply_rates_json(rates, R"({"experts": 0.1})", "rates r.json"); },
               {"rates r.json", "\"experts\"", "unknown shard type"});
  expect_error([&] { apply_rates_json(rates, R"({"norm": 1.5})", "rates r.json"); },
               {"\"norm\"", "[0, 1]"});
}

TEST(SimModels, RatesFileBlockSizeIsOneTheCodecAccepts) {
  // The rates' B is CIERA's B in the payload model, so it takes the codec's range, as --block
  // and a trace's schedule.block_values do (B = 0 divided by zero before).
  ChangeRates rates = paper_rates(find_model("olmoe-1b-7b"));
  for (const char* bad : {"0", "63", "4097", "5000"}) {
    expect_error(
        [&] {
          apply_rates_json(rates, std::string(R"({"block_values": )") + bad + "}", "rates r.json");
        },
        {"rates r.json", "\"block_values\"", "64..4096", std::string("got ") + bad});
  }
  expect_error([&] { apply_rates_json(rates, R"({"block_values": -512})", "rates r.json"); },
               {"\"block_values\"", "non-negative integer"});
  apply_rates_json(rates, R"({"expert_ffn": 0.004, "block_values": 4096})", "rates r.json");
  EXPECT_EQ(rates.block_values, 512u);  // the B of the file's block rates, never --block's
}

// From an audit: a rates file of {} was taken, every rate silently the paper's; one that gave a
// block rate alone was labelled "[rates FILE] expert_ffn 0.500 (element 0.0051)", though its
// element rate was the paper's assumption.
TEST(SimModels, RatesFileGivesARateAndLabelsTheRestAsTheirs) {
  const ChangeRates paper = paper_rates(find_model("olmoe-1b-7b"));
  for (const char* none : {"{}", R"({"block": {}})", R"({"block_values": 512, "source": "x"})"}) {
    ChangeRates rates = paper;
    expect_error([&] { apply_rates_json(rates, none, "rates r.json"); },
                 {"rates r.json", "gives no change rate", "\"block\" rates"});
  }
  ChangeRates rates = paper;
  apply_rates_json(rates, R"({"block": {"expert_ffn": 0.5, "other": 0.5}})", "rates r.json");
  const TypeRate& expert = rates.of(ShardType::kExpertFfn);
  EXPECT_DOUBLE_EQ(expert.block, 0.5);
  EXPECT_DOUBLE_EQ(expert.element, 0.0051);  // the paper's, still fine mode's
  EXPECT_EQ(expert.source, "rates r.json; element 0.51% assumed (paper §2.2: 0.30-0.51%)");
  EXPECT_EQ(rates.of(ShardType::kOther).source, "rates r.json");  // no element rate to label
  // Given both, both are the file's.
  apply_rates_json(rates, R"({"attention": 0.01, "block": {"attention": 0.5}})", "rates r.json");
  EXPECT_EQ(rates.of(ShardType::kAttention).source, "rates r.json");
  // Over a trace's element rate: named, as measured there.
  rates = paper;
  rates.of(ShardType::kRouter) = {0.002, -1, 0, "trace t.json"};
  apply_rates_json(rates, R"({"block": {"router": 0.25}})", "rates r.json");
  EXPECT_EQ(rates.of(ShardType::kRouter).source, "rates r.json; element from trace t.json");
  EXPECT_DOUBLE_EQ(rates.of(ShardType::kRouter).element, 0.002);
}

// A rates file's "block_values" is the B its block rates were measured at. It used to replace the
// projection's B (--block) silently; now, at another B, a type's block rate is derived from the
// file's element rate for it, and a block rate without one is an error naming both Bs.
TEST(SimModels, RatesFileBlockRatesAtAnotherBlockSize) {
  ChangeRates rates = paper_rates(find_model("olmoe-1b-7b"));
  rates.block_values = 4096;
  apply_rates_json(rates,
                   R"({"expert_ffn": 0.004, "block": {"expert_ffn": 0.2}, "block_values": 512})",
                   "rates r.json");
  EXPECT_EQ(rates.block_values, 4096u);
  EXPECT_NEAR(rates.block_rate(ShardType::kExpertFfn), 1 - std::pow(1 - 0.004, 4096), 1e-12);
  expect_error(
      [&] {
        apply_rates_json(rates, R"({"block": {"router": 0.5}, "block_values": 512})",
                         "rates r.json");
      },
      {"rates r.json", "\"block\" rates are at B = 512", "the projection's B is 4096",
       "give --block 512, or an element rate for \"router\""});
  // The paper's Fig. 4 rates are at B = 512 and the paper gives no other: used as they are, and
  // marked so.
  EXPECT_EQ(rates.of(ShardType::kAttention).block_at, 512u);
  EXPECT_DOUBLE_EQ(rates.block_rate(ShardType::kAttention), 0.96);
}

// ---- Cluster presets ------------------------------------------------------------------------

TEST(SimClusters, BuiltInPresetsLoad) {
  const std::string config = builtin_cluster_config();
  for (const char* name : {"a100-hdr", "h100-ndr", "h200-ndr", "linklab"}) {
    const Cluster c = load_cluster(config, name);
    EXPECT_GT(c.inter.GBps, 0) << name;
    EXPECT_GT(c.peak_tflops, 0) << name;
  }
  const Cluster a100 = load_cluster(config, "a100-hdr");
  EXPECT_DOUBLE_EQ(a100.inter.GBps, 8.0);  // the paper's measured cross-node busbw
  EXPECT_EQ(a100.gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(a100.peak_tflops, 312);
  EXPECT_EQ(load_cluster(config, "linklab").gpus_per_node, 1);
}

TEST(SimClusters, BadConfigsNameTheProblem) {
  const std::string config = builtin_cluster_config();
  expect_error([&] { load_cluster(config, "tpu-v5"); },
               {"unknown cluster preset \"tpu-v5\"", "a100-hdr"});
  const std::string missing =
      R"({"format": "ciera-clusters", "version": 1, "gpus": {"g": {"peak_tflops": 1,
      "hbm_GBps": 1}}, "clusters": {"c": {"gpu": "g", "gpus_per_node": 1,
      "kernels": {"detect_GBps": 0, "encode_GBps": 1, "decode_GBps": 1, "quantize_GBps": 1, "dequantize_GBps": 1}}}})";
  expect_error([&] { load_cluster(missing, "c", "cluster config my.json"); },
               {"cluster config my.json", "missing field \"clusters.c.inter\""});
  expect_error([&] { load_cluster("{", "c", "cluster config my.json"); },
               {"my.json", "not valid JSON"});
}

// ---- Traces ---------------------------------------------------------------------------------

std::string trace_text(const std::string& bucket_extra = "", const std::string& forward = "1.0") {
  return R"({"format": "ciera-trace", "version": 1,
    "model": {"family": "olmoe", "params": 1000000},
    "world_size": 4, "dtype": "bf16",
    "link": {"kind": "linklab", "gbit": 1.0, "latency_ms": 0.0},
    "codec": {"encode_GBps": 1000, "decode_GBps": 1000, "detect_GBps": 0},
    "comm": {"allgather": [{"bytes": 1000000, "seconds": 0.5}, {"bytes": 2000000, "seconds": 1.0}],
             "reduce_scatter": [{"bytes": 1000000, "seconds": 0.5}]},
    "optimizer_s": 0.1,
    "buckets": [{"name": "layers.0", "forward_s": )" +
         forward + R"(, "backward_s": 2.0, "raw_bytes": 1000000, "wire_bytes": 500000,
                 "grad_bytes": 1000000)" +
         bucket_extra + R"(,
                 "shards": [{"name": "experts", "type": "expert_ffn", "values": 400000, "change_rate": 0.01,
                             "block_change_rate": 0.3},
                            {"name": "attn", "type": "attention", "values": 100000, "change_rate": 0.02}]}],
    "measured": {"baseline": {"iteration_s": 4.0, "allgather_s": 1.0},
                 "ciera": {"iteration_s": 4.0, "allgather_s": 0.5}}})";
}

// A value nested 200,000 deep where a number belongs: the error quotes its start (json::dump()
// recursed once a level and overflowed the stack writing the message; found by fuzzing).
TEST(SimTrace, ADeeplyNestedValueIsNamedNotACrash) {
  std::string text = trace_text();
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  text.replace(text.find("\"version\": 1"), std::string("\"version\": 1").size(),
               "\"version\": " + deep);
  try {
    parse_trace(text, "trace t.json");
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("[[[["), std::string::npos) << e.what();
  }
}

TEST(SimTrace, PredictsTheSequentialScheduleByDefault) {
  const Trace t = parse_trace(trace_text(), "trace t.json");
  EXPECT_EQ(t.world_size, 4);
  ASSERT_TRUE(t.measured_baseline.has_value());
  const TracePrediction p = predict_trace(t);
  EXPECT_FALSE(p.baseline_overlap);
  EXPECT_FALSE(p.ciera_overlap);
  EXPECT_NEAR(p.allgather.alpha_s, 0.0, 1e-9);
  EXPECT_NEAR(p.allgather.bytes_per_s, 2e6, 1e-3);
  // Baseline: two gathers of 0.5, forward 1, backward 2, reduce-scatter 0.5, optimizer 0.1.
  EXPECT_NEAR(p.baseline.total_s, 4.6, 1e-12);
  EXPECT_NEAR(p.baseline_allgather_s, 1.0, 1e-12);
  // CIERA: two gathers of Comm(500 kB) = 0.25 plus encode of 1 MB / 4 and decode of 3/4 MB at
  // 1000 GB/s (0.25 + 0.75 us) each.
  const double codec = 0.25e6 / 1e12 + 0.75e6 / 1e12;
  EXPECT_NEAR(p.ciera.total_s, 4.1 + 2 * codec, 1e-12);
  EXPECT_NEAR(p.ciera_allgather_s, 0.5 + 2 * codec, 1e-12);
  EXPECT_NEAR(p.ciera_comm_s, 0.5, 1e-12);
  EXPECT_NEAR(p.ciera_encode_s, 2 * 0.25e6 / 1e12, 1e-15);
  EXPECT_NEAR(p.ciera_decode_s, 2 * 0.75e6 / 1e12, 1e-15);
}

TEST(SimTrace, GathersPerStepCountsTheGathers) {
  // The FSDP root is gathered once per step: the sequential baseline pays one 0.5 s gather.
  const Trace t = parse_trace(trace_text(R"(, "gathers_per_step": 1)"), "trace t.json");
  EXPECT_DOUBLE_EQ(t.buckets[0].gathers_per_step, 1.0);
  const TracePrediction p = predict_trace(t);
  EXPECT_NEAR(p.baseline.total_s, 4.1, 1e-12);
  EXPECT_NEAR(p.baseline.allgather_bytes, 1e6, 1e-6);
  EXPECT_NEAR(p.ciera.allgather_bytes, 5e5, 1e-6);
}

Trace two_bucket_trace(bool overlap, bool ciera_overlap) {
  // Two identical buckets: forward 1, backward 2, gathers of 1 MB (0.5 s; 0.25 s for CIERA's
  // 500 kB), reduce-scatters of 0.5 s, codec at 1000 GB/s, W = 4, optimizer 0.1.
  Trace t;
  t.origin = "two buckets";
  t.world_size = 4;
  t.encode_GBps = t.decode_GBps = 1000;
  t.allgather_points = {{1e6, 0.5}, {1e6, 0.5}, {2e6, 1.0}};
  t.reduce_scatter_points = {{1e6, 0.5}};
  t.optimizer_s = 0.1;
  t.overlap = overlap;
  t.ciera_overlap = ciera_overlap;
  TraceBucket b;
  b.forward_s = 1;
  b.backward_s = 2;
  b.raw_bytes = b.grad_bytes = 1e6;
  b.wire_bytes = 5e5;
  t.buckets = {b, b};
  return t;
}

TEST(SimTrace, OverlappedScheduleIsFsdp2Prefetch) {
  const double codec = 0.25e6 / 1e12 + 0.75e6 / 1e12;  // encode + decode per CIERA gather
  const TracePrediction seq = predict_trace(two_bucket_trace(false, false));
  EXPECT_NEAR(seq.baseline.total_s, 4 * 0.5 + 6 + 2 * 0.5 + 0.1, 1e-12);
  EXPECT_NEAR(seq.ciera.total_s, 4 * (0.25 + codec) + 6 + 2 * 0.5 + 0.1, 1e-12);
  // Overlapped: forward gather 0 exposed (0.5), gather 1 prefetched under compute 0; the first
  // backward gather is not prefetched (exposed 0.5), the second is, under the first backward.
  // 0.5 + 1 + 1 | 0.5 + 2 + RS 0.5 + 2 + RS 0.5 | 0.1.
  const TracePrediction ovl = predict_trace(two_bucket_trace(true, true));
  EXPECT_NEAR(ovl.baseline.total_s, 8.1, 1e-12);
  EXPECT_NEAR(ovl.baseline_allgather_s, 1.0, 1e-12);
  EXPECT_NEAR(ovl.baseline.exposed_reduce_scatter_s, 1.0, 1e-12);
  // CIERA: the two exposed gathers are 0.25 s plus their encode and decode.
  EXPECT_NEAR(ovl.ciera.total_s, 7.6 + 2 * codec, 1e-12);
  EXPECT_NEAR(ovl.ciera_allgather_s, 0.5 + 2 * codec, 1e-12);
  // `ciera train --ablation`: CIERA with CCP against the sequential baseline.
  const TracePrediction abl = predict_trace(two_bucket_trace(false, true));
  EXPECT_NEAR(abl.baseline.total_s, seq.baseline.total_s, 1e-12);
  EXPECT_NEAR(abl.ciera.total_s, ovl.ciera.total_s, 1e-12);
}

TEST(SimTrace, ScheduleFieldsAreRead) {
  std::string text = trace_text();
  text.replace(text.find(R"("optimizer_s")"), 13,
               R"("schedule": {"overlap": true, "block_values": 256}, "optimizer_s")");
  const Trace t = parse_trace(text, "trace t.json");
  EXPECT_TRUE(t.overlap);
  EXPECT_TRUE(t.ciera_overlap);  // defaults to overlap
  EXPECT_EQ(t.block_values, 256u);
  text = trace_text();
  text.replace(text.find(R"("optimizer_s")"), 13,
               R"("schedule": {"overlap": false, "ciera_overlap": true}, "optimizer_s")");
  const Trace a = parse_trace(text, "trace t.json");
  EXPECT_FALSE(a.overlap);
  EXPECT_TRUE(a.ciera_overlap);
  // One bucket, overlapped: nothing to prefetch (the backward gather follows the reshard).
  EXPECT_NEAR(predict_trace(t).baseline.total_s, 4.6, 1e-12);
}

TEST(SimTrace, OptionalFieldsHaveDefaults) {
  // The first v1 traces have no schedule, gathers_per_step, block_change_rate or comm_probe.
  const Trace t = parse_trace(trace_text(), "trace t.json");
  EXPECT_FALSE(t.overlap);
  EXPECT_FALSE(t.ciera_overlap);
  EXPECT_EQ(t.block_values, 512u);
  EXPECT_DOUBLE_EQ(t.buckets[0].gathers_per_step, 2.0);
  EXPECT_LT(t.buckets[0].shards[1].block_change_rate, 0);
  EXPECT_TRUE(t.probe_allgather_points.empty());
  // comm_probe is read (and fitted for the report) but not used for the prediction.
  std::string text = trace_text();
  text.replace(text.find(R"("optimizer_s")"), 13,
               R"("comm_probe": {"allgather": [{"bytes": 1000000, "seconds": 0.1},
                                               {"bytes": 2000000, "seconds": 0.2}]},
                  "optimizer_s")");
  const Trace probed = parse_trace(text, "trace t.json");
  ASSERT_EQ(probed.probe_allgather_points.size(), 2u);
  const TracePrediction p = predict_trace(probed);
  ASSERT_TRUE(p.probe_allgather.has_value());
  EXPECT_NEAR(p.probe_allgather->bytes_per_s, 1e7, 1e-3);
  EXPECT_NEAR(p.baseline.total_s, 4.6, 1e-12);
}

TEST(SimTrace, BadOptionalFieldsAreNamed) {
  auto with_schedule = [](const std::string& schedule) {
    std::string text = trace_text();
    text.replace(text.find(R"("optimizer_s")"), 13, schedule + R"(, "optimizer_s")");
    return text;
  };
  expect_error([&] { parse_trace(with_schedule(R"("schedule": {"overlap": "yes"})"), "trace t.json"); },
               {"trace t.json", "\"schedule.overlap\"", "true or false", "\"yes\""});
  expect_error(
      [&] { parse_trace(with_schedule(R"("schedule": {"ciera_overlap": 1})"), "trace t.json"); },
      {"\"schedule.ciera_overlap\"", "true or false"});
  expect_error(
      [&] { parse_trace(with_schedule(R"("schedule": {"block_values": 8})"), "trace t.json"); },
      {"\"schedule.block_values\"", "64..4096", "got 8"});
  expect_error(
      [&] { parse_trace(with_schedule(R"("schedule": {"block_values": 51.2})"), "trace t.json"); },
      {"\"schedule.block_values\"", "non-negative integer"});
  expect_error([&] { parse_trace(with_schedule(R"("schedule": true)"), "trace t.json"); },
               {"\"schedule\"", "must be an object"});
  expect_error(
      [&] { parse_trace(trace_text(R"(, "gathers_per_step": -1)"), "trace t.json"); },
      {"\"buckets[0].gathers_per_step\"", ">= 0"});
  expect_error(
      [&] { parse_trace(trace_text(R"(, "gathers_per_step": "two")"), "trace t.json"); },
      {"\"buckets[0].gathers_per_step\"", "must be a number"});
  std::string text = trace_text();
  text.replace(text.find(R"("block_change_rate": 0.3)"), 24, R"("block_change_rate": 1.3)");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"buckets[0].shards[0].block_change_rate\"", "[0, 1]"});
  expect_error(
      [&] {
        parse_trace(with_schedule(R"("comm_probe": {"allgather": [{"bytes": -1, "seconds": 0}]})"),
                    "trace t.json");
      },
      {"\"comm_probe.allgather[0].bytes\"", ">= 0"});
}

// trace_text() with `top` inserted among the top-level fields, `comm` among comm's curves and
// `bucket` among the bucket's fields.
std::string trace_with(const std::string& top, const std::string& comm = "",
                       const std::string& bucket = "") {
  std::string text = trace_text(bucket);
  if (!top.empty()) text.replace(text.find(R"("optimizer_s")"), 13, top + R"(, "optimizer_s")");
  const std::string rs = R"("reduce_scatter": [{"bytes": 1000000, "seconds": 0.5}])";
  if (!comm.empty()) text.replace(text.find(rs), rs.size(), rs + ", " + comm);
  return text;
}

const std::string kPartialTopology =
    R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 2})";
const std::string kPostForwardCurve =
    R"("allgather_post_forward": [{"bytes": 1000000, "seconds": 0.1}, {"bytes": 2000000, "seconds": 0.2}])";

TEST(SimTrace, PostForwardGroupTakesTheBackwardGathers) {
  // W = 4 on 2 nodes, resharded to 2 after forward: the backward gather runs on the post-forward
  // curve (1e7 B/s), the forward one on comm.allgather (2e6 B/s), sequentially.
  const Trace t = parse_trace(
      trace_with(kPartialTopology, kPostForwardCurve, R"(, "post_forward_wire_bytes": 600000)"),
      "trace t.json");
  ASSERT_TRUE(t.topology.has_value());
  EXPECT_EQ(t.topology->reshard_after_forward, 2);
  EXPECT_TRUE(t.topology->post_forward_group(t.world_size));
  ASSERT_TRUE(t.buckets[0].post_forward_wire_bytes.has_value());
  const TracePrediction p = predict_trace(t);
  ASSERT_TRUE(p.post_forward_allgather.has_value());
  // Baseline: forward gather 0.5, backward 0.1, compute 3, reduce-scatter 0.5, optimizer 0.1.
  EXPECT_NEAR(p.baseline.total_s, 4.2, 1e-12);
  EXPECT_NEAR(p.baseline.allgather_bytes, 2e6, 1e-6);
  EXPECT_NEAR(p.baseline.allgather_inter_node_bytes, 1e6, 1e-6);  // the forward gather only
  EXPECT_NEAR(p.baseline.exposed_allgather_backward_s, 0.1, 1e-12);
  // CIERA: forward Comm(500 kB) = 0.25, encode 1/4 and decode 3/4 of 1 MB; backward
  // Comm_pf(600 kB) = 0.06, encode 1/2 and decode 1/2 of 1 MB (a group of 2), at 1000 GB/s.
  const double codec = 1e6 / 1e12;
  EXPECT_NEAR(p.ciera.total_s, 0.25 + 0.06 + 2 * codec + 3 + 0.5 + 0.1, 1e-12);
  EXPECT_NEAR(p.ciera.allgather_bytes, 5e5 + 6e5, 1e-6);
  EXPECT_NEAR(p.ciera_comm_s, 0.31, 1e-12);
  EXPECT_NEAR(p.ciera_encode_s, 0.25e6 / 1e12 + 0.5e6 / 1e12, 1e-15);
  EXPECT_NEAR(p.ciera_decode_s, 0.75e6 / 1e12 + 0.5e6 / 1e12, 1e-15);
  // Without post_forward_wire_bytes CIERA sends the backward gather raw: Comm_pf(1 MB), no codec.
  const TracePrediction raw =
      predict_trace(parse_trace(trace_with(kPartialTopology, kPostForwardCurve), "trace t.json"));
  EXPECT_NEAR(raw.ciera.total_s, 0.25 + 0.1 + codec + 3 + 0.5 + 0.1, 1e-12);
  EXPECT_NEAR(raw.ciera.allgather_bytes, 5e5 + 1e6, 1e-6);
}

TEST(SimTrace, HsdpAllReducesAfterEachReduceScatter) {
  // HSDP on 2 nodes of 2: shard group of 2 (no gather crosses nodes), an all-reduce of 500 kB
  // (0.25 s on its curve) after the reduce-scatter.
  const Trace t =
      parse_trace(trace_with(R"("topology": {"nodes": 2, "ranks_per_node": 2, "hsdp": true})",
                             R"("allreduce": [{"bytes": 1000000, "seconds": 0.5}])",
                             R"(, "allreduce_bytes": 500000)"),
                  "trace t.json");
  EXPECT_TRUE(t.topology->hsdp);
  EXPECT_EQ(t.topology->shard_group(t.world_size), 2);
  EXPECT_DOUBLE_EQ(t.buckets[0].allreduce_bytes, 5e5);
  const TracePrediction p = predict_trace(t);
  ASSERT_TRUE(p.allreduce.has_value());
  EXPECT_NEAR(p.baseline.total_s, 4.6 + 0.25, 1e-12);
  EXPECT_NEAR(p.baseline.exposed_reduce_scatter_s, 0.75, 1e-12);
  EXPECT_NEAR(p.baseline.exposed_allreduce_s, 0.25, 1e-12);
  EXPECT_NEAR(p.baseline.allreduce_bytes, 5e5, 1e-6);
  EXPECT_EQ(p.baseline.allgather_inter_node_bytes, 0.0);
  EXPECT_EQ(p.ciera.allgather_inter_node_bytes, 0.0);
  // CIERA's codec over the shard group of 2: encode and decode half of 1 MB each, per gather.
  const double codec = 1e6 / 1e12;
  EXPECT_NEAR(p.ciera.total_s, 0.5 + 2 * codec + 3 + 0.5 + 0.25 + 0.1, 1e-12);
  EXPECT_NEAR(p.ciera_encode_s, 2 * 0.5e6 / 1e12, 1e-15);
}

TEST(SimTrace, AbsentOrNeutralTopologyFieldsChangeNothing) {
  const TracePrediction plain = predict_trace(parse_trace(trace_text(), "trace t.json"));
  const std::vector<std::string> neutral = {
      R"("topology": {"nodes": 4, "ranks_per_node": 1})",
      R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 0, "hsdp": false})",
      R"("topology": {"nodes": 1, "ranks_per_node": 4, "reshard_after_forward": 4})"};
  for (const std::string& top : neutral) {
    const TracePrediction p = predict_trace(parse_trace(trace_with(top), "trace t.json"));
    EXPECT_EQ(p.baseline.total_s, plain.baseline.total_s) << top;
    EXPECT_EQ(p.ciera.total_s, plain.ciera.total_s) << top;
    EXPECT_EQ(p.ciera_comm_s, plain.ciera_comm_s) << top;
    EXPECT_EQ(p.ciera_encode_s, plain.ciera_encode_s) << top;
    EXPECT_EQ(p.ciera_allgather_s, plain.ciera_allgather_s) << top;
  }
  // An all-reduce curve with no bucket all-reducing (allreduce_bytes 0) adds nothing either.
  const TracePrediction curve = predict_trace(
      parse_trace(trace_with("", R"("allreduce": [{"bytes": 1000000, "seconds": 0.5}])",
                             R"(, "allreduce_bytes": 0)"),
                  "trace t.json"));
  EXPECT_EQ(curve.baseline.total_s, plain.baseline.total_s);
  EXPECT_EQ(curve.ciera.total_s, plain.ciera.total_s);
  // Without a topology every rank is its own node: every gather crosses nodes.
  EXPECT_EQ(plain.baseline.allgather_inter_node_bytes, plain.baseline.allgather_bytes);
  const Trace t = parse_trace(trace_text(), "trace t.json");
  EXPECT_FALSE(t.topology.has_value());
  EXPECT_FALSE(t.buckets[0].post_forward_wire_bytes.has_value());
  EXPECT_EQ(t.buckets[0].allreduce_bytes, 0.0);
  EXPECT_TRUE(t.post_forward_allgather_points.empty());
  EXPECT_TRUE(t.allreduce_points.empty());
}

TEST(SimTrace, BadTopologyFieldsAreNamed) {
  auto parse = [](const std::string& text) { parse_trace(text, "trace t.json"); };
  expect_error([&] { parse(trace_with(R"("topology": {"nodes": 3, "ranks_per_node": 2})")); },
               {"trace t.json", "\"topology.nodes\"", "world_size", "3 x 2"});
  expect_error([&] { parse(trace_with(R"("topology": {"ranks_per_node": 2})")); },
               {"missing field \"topology.nodes\""});
  expect_error(
      [&] {
        parse(trace_with(
            R"("topology": {"nodes": 1, "ranks_per_node": 4, "reshard_after_forward": 3})",
            kPostForwardCurve));
      },
      {"\"topology.reshard_after_forward\"", "divide the shard group of 4", "got 3"});
  expect_error(
      [&] {
        parse(trace_with(
            R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 4, "hsdp": true})"));
      },
      {"\"topology.reshard_after_forward\"", "shard group of 2"});
  expect_error(
      [&] {
        parse(trace_with(
            R"("topology": {"nodes": 1, "ranks_per_node": 4, "reshard_after_forward": -2})"));
      },
      {"\"topology.reshard_after_forward\"", "non-negative integer"});
  expect_error(
      [&] { parse(trace_with(R"("topology": {"nodes": 1, "ranks_per_node": 4, "hsdp": "yes"})")); },
      {"\"topology.hsdp\"", "true or false"});
  expect_error([&] { parse(trace_with(R"("topology": [2, 2])")); },
               {"\"topology\"", "must be an object"});
  expect_error([&] { parse(trace_with(kPartialTopology)); },
               {"missing field \"comm.allgather_post_forward\"", "reshard_after_forward is 2"});
  expect_error([&] { parse(trace_with("", kPostForwardCurve)); },
               {"\"comm.allgather_post_forward\"", "is given", "no \"topology\""});
  expect_error([&] { parse(trace_with(kPartialTopology, R"("allgather_post_forward": [])")); },
               {"\"comm.allgather_post_forward\"", "at least one"});
  expect_error(
      [&] {
        parse(trace_with(kPartialTopology,
                         R"("allgather_post_forward": [{"bytes": 1000000, "seconds": -1}])"));
      },
      {"\"comm.allgather_post_forward[0].seconds\"", ">= 0"});
  expect_error([&] { parse(trace_with("", "", R"(, "post_forward_wire_bytes": 1000)")); },
               {"\"buckets[0].post_forward_wire_bytes\"", "is given"});
  expect_error(
      [&] {
        parse(
            trace_with(kPartialTopology, kPostForwardCurve, R"(, "post_forward_wire_bytes": -5)"));
      },
      {"\"buckets[0].post_forward_wire_bytes\"", ">= 0"});
  const std::string hsdp = R"("topology": {"nodes": 2, "ranks_per_node": 2, "hsdp": true})";
  expect_error([&] { parse(trace_with(hsdp, "", R"(, "allreduce_bytes": 1000)")); },
               {"missing field \"comm.allreduce\"", "buckets[0].allreduce_bytes"});
  // From an audit: an all-reduce without HSDP was taken and timed; HSDP on nodes of one rank
  // predicted gathers on a shard group of one; a measured gather wait above the step's time.
  expect_error([&] { parse(trace_with("", "", R"(, "allreduce_bytes": 1000)")); },
               {"\"buckets[0].allreduce_bytes\"", "not HSDP"});
  expect_error(
      [&] { parse(trace_with(R"("topology": {"nodes": 4, "ranks_per_node": 1, "hsdp": true})")); },
      {"\"topology.hsdp\"", "one rank per node"});
  expect_error([&] { parse(trace_with("", "", R"(, "allreduce_bytes": "lots")")); },
               {"\"buckets[0].allreduce_bytes\"", "must be a number"});
  expect_error([&] { parse(trace_with("", R"("allreduce": {"bytes": 1})")); },
               {"\"comm.allreduce\"", "must be an array"});
  // A curve that cannot be fitted is named when the prediction fits it.
  const Trace flat = parse_trace(
      trace_with(
          kPartialTopology,
          R"("allgather_post_forward": [{"bytes": 1000000, "seconds": 0.2}, {"bytes": 2000000, "seconds": 0.1}])"),
      "trace t.json");
  expect_error([&] { predict_trace(flat); }, {"comm.allgather_post_forward", "does not increase"});
}

TEST(SimTrace, RatesPerShardTypeAreValueWeighted) {
  const Trace t = parse_trace(trace_text(), "trace t.json");
  ChangeRates rates = paper_rates(find_model("olmoe-1b-7b"));
  apply_trace_rates(rates, t);
  EXPECT_DOUBLE_EQ(rates.of(ShardType::kExpertFfn).element, 0.01);
  EXPECT_DOUBLE_EQ(rates.block_rate(ShardType::kExpertFfn), 0.3);
  EXPECT_LT(rates.of(ShardType::kAttention).block, 0);  // element rate only: derived
  EXPECT_EQ(rates.of(ShardType::kAttention).source, "trace t.json");
  EXPECT_EQ(rates.of(ShardType::kNorm).source.rfind("paper Fig. 4", 0), 0u);  // not in the trace
  // Block rates measured at another B are not carried over: derived from the element rate.
  Trace other_block = t;
  other_block.block_values = 256;
  ChangeRates derived;
  apply_trace_rates(derived, other_block);
  EXPECT_NEAR(derived.block_rate(ShardType::kExpertFfn), 1 - std::pow(1 - 0.01, 512), 1e-12);
}

TEST(SimTrace, MissingFieldIsNamed) {
  std::string text = trace_text();
  text.erase(text.find(R"("forward_s": 1.0, )"), std::string(R"("forward_s": 1.0, )").size());
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"trace t.json", "missing field \"buckets[0].forward_s\""});
}

TEST(SimTrace, NegativeTimeIsAnError) {
  expect_error([] { parse_trace(trace_text("", "-0.5"), "trace t.json"); },
               {"\"buckets[0].forward_s\"", "must be >= 0", "-0.5"});
  std::string text = trace_text();
  text.replace(text.find(R"("seconds": 0.5)"), 14, R"("seconds": -1)");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"comm.allgather[0].seconds\"", ">= 0"});
  // 1e300 seconds made the predictions infinite and their ratios NaN.
  expect_error([] { parse_trace(trace_text("", "1e300"), "trace t.json"); },
               {"\"buckets[0].forward_s\"", "at most 1e18", "1e+300"});
}

// A measured time of 0 has no relative error (it read as a perfect prediction); a bucket of bytes
// whose gather sends none would be predicted to cost nothing.
TEST(SimTrace, ZeroMeasuredTimesAndZeroWireBytesAreRejected) {
  std::string text = trace_text();
  text.replace(text.find(R"("iteration_s": 4.0)"), 18, R"("iteration_s": 0)");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"measured.baseline.iteration_s\"", "must be > 0"});
  text = trace_text();
  text.replace(text.find(R"("allgather_s": 0.5)"), 18, R"("allgather_s": 0.0)");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"measured.ciera.allgather_s\"", "must be > 0"});
  text = trace_text();
  text.replace(text.find(R"("wire_bytes": 500000)"), 20, R"("wire_bytes": 0)");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"buckets[0].wire_bytes\"", "above 0 where raw_bytes is"});
}

TEST(SimTrace, OtherFormatsAndBadValuesAreRejected) {
  std::string text = trace_text();
  text.replace(text.find("\"version\": 1"), 12, "\"version\": 2");
  expect_error([&] { parse_trace(text, "trace t.json"); }, {"\"version\"", "v1"});
  text = trace_text();
  text.replace(text.find("ciera-trace"), 11, "other-trace");
  expect_error([&] { parse_trace(text, "trace t.json"); }, {"\"format\"", "ciera-trace"});
  text = trace_text();
  text.replace(text.find("\"attention\""), 11, "\"attn\"");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"buckets[0].shards[1].type\"", "unknown shard type"});
  text = trace_text();
  text.replace(text.find("\"bf16\""), 6, "\"int8\"");
  expect_error([&] { parse_trace(text, "trace t.json"); }, {"\"dtype\""});
  expect_error([] { parse_trace("[1, 2]", "trace t.json"); },
               {"trace t.json", "must be an object"});
  text = trace_text();
  text.replace(text.find("\"allgather_s\": 1.0"), 18, "\"allgather_s\": 5.0");
  expect_error([&] { parse_trace(text, "trace t.json"); },
               {"\"measured.baseline.allgather_s\"", "more than iteration_s"});
  expect_error([] { load_trace("/nonexistent/trace.json"); },
               {"cannot read trace /nonexistent/trace.json"});
}

// From an audit: raw_bytes was never checked against the shards it gathers; a trace whose bytes
// and values disagree predicted from the one and projected from the other.
TEST(SimTrace, RawBytesMustBeTheShardsValuesAtTheDtypesWidth) {
  auto with = [](const std::string& from, const std::string& to) {
    std::string text = trace_text();
    text.replace(text.find(from), from.size(), to);
    return text;
  };
  // 400000 + 100000 BF16 values are 1000000 bytes.
  expect_error(
      [&] {
        parse_trace(with(R"("raw_bytes": 1000000)", R"("raw_bytes": 1200000)"), "trace t.json");
      },
      {"trace t.json", "field \"buckets[0].raw_bytes\"", "2 bytes per bf16 value",
       "1000000 bytes (500000 values)", "but it is 1200000"});
  // FP32 values are 4 bytes: the same bucket is 2000000 bytes.
  expect_error(
      [&] { parse_trace(with(R"("dtype": "bf16")", R"("dtype": "fp32")"), "trace t.json"); },
      {"\"buckets[0].raw_bytes\"", "4 bytes per fp32 value", "2000000 bytes", "but it is 1000000"});
  std::string fp32 = with(R"("dtype": "bf16")", R"("dtype": "fp32")");
  fp32.replace(fp32.find(R"("raw_bytes": 1000000)"), 20, R"("raw_bytes": 2000000)");
  EXPECT_DOUBLE_EQ(parse_trace(fp32, "trace t.json").buckets[0].raw_bytes, 2e6);
  // A bucket that lists no shards gathers nothing.
  expect_error(
      [&] {
        std::string text = trace_text();
        const size_t from = text.find(R"("shards": [)");
        text.replace(from, text.find("]}]", from) + 1 - from, R"("shards": [])");
        parse_trace(text, "trace t.json");
      },
      {"\"buckets[0].raw_bytes\"", "0 bytes (0 values)", "but it is 1000000"});
}

// The most the engine can send for trace_text()'s bucket on a group of `ranks`: per rank an
// envelope header (24 bytes + 8 per shard), each shard's larger of raw and max_payload_bytes, and
// the control records of two rounds (1040 + 8 x 128 bytes each; a trace's wire bytes count them,
// as `ciera train`'s do).
double engine_bound(int ranks) {
  double per_rank = 24 + 8 * 2 + 2 * (1040 + 8 * 128);
  for (uint64_t values : {400000u, 100000u}) {
    const uint64_t n = values / ranks;
    per_rank += std::max<double>(2.0 * n, max_payload_bytes(DType::kBF16, n, 512));
  }
  return per_rank * ranks;
}

std::string number_text(double bytes) { return std::to_string(static_cast<uint64_t>(bytes)); }

// From an audit: wire bytes far above raw were read as "sent raw" without a word. Up to the
// engine's bound they still are (headers, incompressible frames); beyond it the trace is wrong.
TEST(SimTrace, WireBytesAboveTheEnginesBoundAreRejected) {
  const double bound = engine_bound(4);
  ASSERT_GT(bound, 1e6);
  ASSERT_LT(bound, 1.03e6);  // headers, bitmaps and 16 KiB of control records: under 3%
  auto wire = [](double bytes) {
    std::string text = trace_text();
    text.replace(text.find(R"("wire_bytes": 500000)"), 20,
                 R"("wire_bytes": )" + number_text(bytes));
    return text;
  };
  const TracePrediction plain = predict_trace(parse_trace(trace_text(), "trace t.json"));
  for (const double accepted : {1e6, 1e6 + 100, bound}) {
    const TracePrediction p = predict_trace(parse_trace(wire(accepted), "trace t.json"));
    EXPECT_EQ(p.ciera.total_s, p.baseline.total_s) << accepted;  // sent raw, as before
    EXPECT_GT(p.ciera.total_s, plain.ciera.total_s) << accepted;
  }
  expect_error([&] { parse_trace(wire(bound + 1), "trace t.json"); },
               {"trace t.json", "field \"buckets[0].wire_bytes\"", number_text(bound + 1),
                "at most " + number_text(bound) + " bytes on the shard group of 4 ranks",
                "raw_bytes 1000000", "max_payload_bytes", "the control records"});
  expect_error([&] { parse_trace(wire(5e6), "trace t.json"); },
               {"\"buckets[0].wire_bytes\"", "is 5000000 bytes"});
  // A post-forward group's wire bytes are bounded on that group: 2 ranks here.
  const double post = engine_bound(2);
  const std::string with_post = trace_with(kPartialTopology, kPostForwardCurve,
                                           R"(, "post_forward_wire_bytes": )" + number_text(post));
  EXPECT_EQ(*parse_trace(with_post, "trace t.json").buckets[0].post_forward_wire_bytes, post);
  expect_error(
      [&] {
        parse_trace(trace_with(kPartialTopology, kPostForwardCurve,
                               R"(, "post_forward_wire_bytes": )" + number_text(post + 1)),
                    "trace t.json");
      },
      {"\"buckets[0].post_forward_wire_bytes\"", number_text(post + 1),
       "at most " + number_text(post) + " bytes on the post-forward group of 2 ranks"});
}

// From an audit: gathers_per_step had no upper bound (1e18 gathers a step were predicted).
TEST(SimTrace, GathersPerStepIsAtMost1024) {
  const Trace t = parse_trace(trace_text(R"(, "gathers_per_step": 1024)"), "trace t.json");
  EXPECT_DOUBLE_EQ(t.buckets[0].gathers_per_step, 1024.0);
  expect_error([] { parse_trace(trace_text(R"(, "gathers_per_step": 1025)"), "trace t.json"); },
               {"trace t.json", "field \"buckets[0].gathers_per_step\"",
                "at most 1024 gathers per step", "got 1025"});
  expect_error([] { parse_trace(trace_text(R"(, "gathers_per_step": 1e18)"), "trace t.json"); },
               {"\"buckets[0].gathers_per_step\"", "at most 1024", "got 1e+18"});
}

// From an audit: reshard_after_forward 1 was taken as a post-forward group of one rank, which
// needed a post-forward curve and charged the backward gathers on it. FSDP2 reads the integer 1
// as False: the unit stays gathered from forward to backward, and no backward gather runs.
TEST(SimTrace, ReshardAfterForwardOneHasNoBackwardGather) {
  for (
      const std::string top :
      {R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 1})",
       R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 1, "hsdp": true})"}) {
    const Trace t = parse_trace(trace_with(top), "trace t.json");
    EXPECT_FALSE(t.topology->post_forward_group(t.world_size)) << top;
    EXPECT_TRUE(t.topology->keeps_gathered_after_forward(t.world_size)) << top;
    EXPECT_DOUBLE_EQ(t.buckets[0].gathers_per_step, 1.0) << top;  // the default, absent
    EXPECT_NE(t.describe().find("no reshard"), std::string::npos) << t.describe();
    const TracePrediction p = predict_trace(t);
    EXPECT_FALSE(p.post_forward_allgather.has_value());
    EXPECT_EQ(p.baseline.exposed_allgather_backward_s, 0.0) << top;
    EXPECT_EQ(p.ciera.exposed_allgather_backward_s, 0.0) << top;
    EXPECT_EQ(p.ciera.allgather_bytes, 5e5) << top;  // the forward gather alone
    // As the flat run gathered once a step: one 0.5 s gather, compute 3, RS 0.5, optimizer 0.1.
    EXPECT_NEAR(p.baseline.total_s, 4.1, 1e-12) << top;
  }
  const std::string one =
      R"("topology": {"nodes": 2, "ranks_per_node": 2, "reshard_after_forward": 1})";
  expect_error([&] { parse_trace(trace_with(one, kPostForwardCurve), "trace t.json"); },
               {"\"comm.allgather_post_forward\"", "is given", "reshard_after_forward is 1",
                "no backward gather"});
  expect_error(
      [&] { parse_trace(trace_with(one, "", R"(, "gathers_per_step": 2)"), "trace t.json"); },
      {"\"buckets[0].gathers_per_step\"", "at most 1 with topology.reshard_after_forward 1",
       "got 2"});
  expect_error(
      [&] {
        parse_trace(trace_with(one, "", R"(, "post_forward_wire_bytes": 600000)"), "trace t.json");
      },
      {"\"buckets[0].post_forward_wire_bytes\"", "is given"});
}

}  // namespace
}  // namespace ciera::sim
