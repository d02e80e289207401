// The ZeRO-3/FSDP iteration as a timeline of four in-order streams: compute, the collective
// channel (allgathers and reduce-scatters in issue order), a "pre" side stream and a "post"
// stream (docs/simulator.md, "Schedule"). With prefetch depth 0 and blocking reduce-scatters it
// is the sequential schedule of CPU ranks: every collective and codec step in turn.
#include <algorithm>
#include <vector>

#include "sim/sim.hpp"

namespace ciera::sim {
namespace {

// One parameter gather: gathers 0..n-1 serve the forward pass, n..2n-1 the backward pass.
struct GatherTimes {
  bool issued = false;
  double end = 0;        // collective finished
  double ready = 0;      // post work finished: the unit may run
  double pre_delay = 0;  // how long the collective waited on its pre work alone
  bool inter_node = false;
};

// A gradient collective's turn on the channel.
struct GradientCollective {
  double start = 0, end = 0;
  bool allreduce = false;  // HSDP's all-reduce, else the reduce-scatter
};

// How long [from, to] overlaps the gradient collectives (all, or HSDP's all-reduces only).
double overlap_s(const std::vector<GradientCollective>& collectives, double from, double to,
                 bool allreduce_only) {
  double sum = 0;
  for (const GradientCollective& c : collectives) {
    if (allreduce_only && !c.allreduce) continue;
    sum += std::max(0.0, std::min(c.end, to) - std::max(c.start, from));
  }
  return sum;
}

}  // namespace

Breakdown simulate_iteration(const std::vector<UnitCost>& units, double optimizer_s,
                             const ScheduleOptions& options) {
  const int n = static_cast<int>(units.size());
  const int steps = 2 * n;
  const int depth = std::max(0, options.prefetch_depth);

  Breakdown b;
  std::vector<GatherTimes> gathers(steps);
  double compute_free = 0, comm_free = 0, pre_free = 0, post_free = 0, last_reduce_scatter = 0;
  std::vector<GradientCollective> gradient_collectives;  // busy intervals on the channel

  auto issue = [&](int g, double now) {
    GatherTimes& t = gathers[g];
    if (t.issued) return;
    t.issued = true;
    const bool forward = g < n;
    const UnitCost& u = units[forward ? g : 2 * n - 1 - g];
    const double pre = forward ? u.pre_forward_s : u.pre_backward_s;
    const double post = forward ? u.post_forward_s : u.post_backward_s;
    const double collective = forward ? u.allgather_forward_s : u.allgather_backward_s;
    const double bytes = forward ? u.allgather_forward_bytes : u.allgather_backward_bytes;
    t.inter_node = forward ? u.allgather_forward_inter_node : u.allgather_backward_inter_node;
    const uint64_t link = forward ? u.allgather_forward_link : u.allgather_backward_link;
    b.allgather_bytes += bytes;
    if (t.inter_node) b.allgather_inter_node_bytes += bytes;
    if (bytes > 0) b.allgather_links[link].bytes += bytes;
    if (pre <= 0 && collective <= 0 && post <= 0) {  // nothing to gather (e.g. the FSDP root in
      t.end = t.ready = now;                         // backward): no turn on the channel
      return;
    }
    b.encode_busy_s += pre;
    b.decode_busy_s += post;
    if (t.inter_node) b.allgather_inter_node_busy_s += collective;
    if (bytes > 0) b.allgather_links[link].busy_s += collective;
    double pre_end = 0;
    if (pre > 0) {
      pre_end = std::max(pre_free, options.pre_from_start ? 0.0 : now) + pre;
      pre_free = pre_end;
    }
    const double unblocked = std::max(comm_free, now);
    const double start = std::max(unblocked, pre_end);
    t.pre_delay = start - unblocked;
    t.end = start + collective;
    comm_free = t.end;
    t.ready = t.end;
    if (post > 0) {
      t.ready = std::max(post_free, t.end) + post;
      post_free = t.ready;
    }
    b.allgather_busy_s += collective;
  };

  for (int step = 0; step < steps; ++step) {
    const bool forward = step < n;
    const UnitCost& u = units[forward ? step : 2 * n - 1 - step];
    issue(step, compute_free);
    const GatherTimes& mine = gathers[step];
    const double start = std::max(compute_free, mine.ready);
    // Split the wait: decoding after the collective; reduce-scatters holding the channel before
    // it; the collective waiting on its pre work; the rest is the allgather itself.
    const double wait = start - compute_free;
    const double post_wait = std::max(0.0, start - std::max(mine.end, compute_free));
    const double rs_wait = overlap_s(gradient_collectives, compute_free, mine.end, false);
    b.exposed_allreduce_s += overlap_s(gradient_collectives, compute_free, mine.end, true);
    const double pre_wait = std::min(wait - post_wait - rs_wait, mine.pre_delay);
    b.exposed_codec_s += post_wait + pre_wait;
    b.exposed_reduce_scatter_s += rs_wait;
    const double allgather_wait = wait - post_wait - rs_wait - pre_wait;
    b.exposed_allgather_s += allgather_wait;
    (forward ? b.exposed_allgather_forward_s : b.exposed_allgather_backward_s) += allgather_wait;
    if (mine.inter_node) b.exposed_allgather_inter_node_s += allgather_wait;
    // Prefetch: the next `depth` gathers are issued as this unit starts.
    for (int ahead = 1; ahead <= depth && step + ahead < steps; ++ahead) {
      if (!options.prefetch_into_backward && forward && step + ahead >= n) break;
      issue(step + ahead, start);
    }
    const double duration = forward ? u.forward_s : u.backward_s;
    compute_free = start + duration;
    b.compute_s += duration;
    if (!forward && (u.reduce_scatter_s > 0 || u.allreduce_s > 0)) {
      // The reduce-scatter, then (HSDP) the all-reduce of its output, in one turn on the channel.
      const double rs_start = std::max(comm_free, compute_free);
      comm_free = rs_start + u.reduce_scatter_s;
      gradient_collectives.push_back({rs_start, comm_free, false});
      if (u.allreduce_s > 0) {
        gradient_collectives.push_back({comm_free, comm_free + u.allreduce_s, true});
        comm_free += u.allreduce_s;
      }
      last_reduce_scatter = comm_free;
      b.reduce_scatter_busy_s += u.reduce_scatter_s;
      b.allreduce_busy_s += u.allreduce_s;
      if (options.blocking_reduce_scatter) {  // the training loop waits for it (and its turn)
        b.exposed_reduce_scatter_s += comm_free - compute_free;
        b.exposed_allreduce_s += overlap_s(gradient_collectives, compute_free, comm_free, true);
        compute_free = comm_free;
      }
    }
    if (!forward) {
      b.reduce_scatter_bytes += u.reduce_scatter_bytes;
      b.allreduce_bytes += u.allreduce_bytes;
    }
  }
  const double optimizer_start = std::max(compute_free, last_reduce_scatter);
  b.exposed_reduce_scatter_s += optimizer_start - compute_free;
  b.exposed_allreduce_s += overlap_s(gradient_collectives, compute_free, optimizer_start, true);
  b.optimizer_s = optimizer_s;
  b.total_s = optimizer_start + optimizer_s;
  return b;
}

}  // namespace ciera::sim
