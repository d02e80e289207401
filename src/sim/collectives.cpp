// Alpha-beta costs of allgather and reduce-scatter (docs/simulator.md, "Collectives"), and the
// least-squares fit of a measured cost curve used by trace-driven prediction.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "sim/sim.hpp"

namespace ciera::sim {

Algorithm parse_algorithm(std::string_view name) {
  if (name == "ring") return Algorithm::kRing;
  if (name == "hierarchical") return Algorithm::kHierarchical;
  throw ConfigError("unknown collective algorithm \"" + std::string(name) +
                    "\" (expected ring or hierarchical)");
}

double ring_seconds(int ranks, double total_bytes, const Link& link) {
  if (ranks <= 1 || total_bytes <= 0) return 0.0;
  const double steps = ranks - 1;
  return steps * link.latency_s + steps / ranks * total_bytes / (link.GBps * 1e9);
}

double allgather_seconds(const Cluster& cluster, int world, double total_bytes,
                         Algorithm algorithm) {
  const int per_node = std::max(1, cluster.gpus_per_node);
  if (world <= per_node) return ring_seconds(world, total_bytes, cluster.intra);
  require_whole_nodes(cluster, world);
  const int nodes = world / per_node;
  if (algorithm == Algorithm::kRing) {
    // A flat ring crosses each node boundary once per direction: every byte a node receives
    // passes through its inter-node link, so that link sets the pace, with one step per rank.
    Link slowest = cluster.inter;
    if (per_node > 1) {
      slowest.GBps = std::min(cluster.inter.GBps, cluster.intra.GBps);
      slowest.latency_s = std::max(cluster.inter.latency_s, cluster.intra.latency_s);
    }
    return ring_seconds(world, total_bytes, slowest);
  }
  // The per_node inter-node rings (one per local rank) share their node's link, so together they
  // move what one ring of `nodes` ranks over `total_bytes` would; then each node gathers locally.
  return ring_seconds(nodes, total_bytes, cluster.inter) +
         ring_seconds(per_node, total_bytes, cluster.intra);
}

double reduce_scatter_seconds(const Cluster& cluster, int world, double total_bytes,
                              Algorithm algorithm) {
  return allgather_seconds(cluster, world, total_bytes, algorithm);
}

double allreduce_seconds(int ranks, double total_bytes, const Link& link) {
  return 2 * ring_seconds(ranks, total_bytes, link);
}

CostCurve fit_cost_curve(const std::vector<CostPoint>& points, const std::string& what) {
  if (points.empty()) throw ConfigError(what + ": no measured points to fit a cost curve to");
  // Identical buckets give points of the same size: average them, so that every size counts once.
  std::vector<CostPoint> sizes;
  std::vector<double> repeats;
  for (const CostPoint& p : points) {
    auto same = std::find_if(sizes.begin(), sizes.end(),
                             [&](const CostPoint& q) { return q.bytes == p.bytes; });
    if (same == sizes.end()) {
      sizes.push_back(p);
      repeats.push_back(1);
    } else {
      const size_t i = static_cast<size_t>(same - sizes.begin());
      same->seconds = (same->seconds * repeats[i] + p.seconds) / (repeats[i] + 1);
      repeats[i] += 1;
    }
  }
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const CostPoint& p : sizes) {
    n += 1;
    sx += p.bytes;
    sy += p.seconds;
    sxx += p.bytes * p.bytes;
    sxy += p.bytes * p.seconds;
  }
  CostCurve curve;
  const double spread = n * sxx - sx * sx;
  double slope = 0, intercept = 0;
  if (sizes.size() >= 2 && spread > 1e-9 * sxx * n) {
    slope = (n * sxy - sx * sy) / spread;
    intercept = (sy - slope * sx) / n;
  }
  if (sizes.size() < 2 || spread <= 1e-9 * sxx * n || intercept < 0) {
    // One size only, or a negative fixed cost: fit through the origin instead.
    if (sxx <= 0) throw ConfigError(what + ": all measured points have 0 bytes");
    slope = sxy / sxx;
    intercept = 0;
  }
  if (!(slope > 0)) {
    char per_mb[32];
    std::snprintf(per_mb, sizeof per_mb, "%.3g", slope * 1e6);
    throw ConfigError(what + ": measured time does not increase with bytes (fitted slope " +
                      per_mb + " s/MB)");
  }
  curve.alpha_s = intercept;
  curve.bytes_per_s = 1.0 / slope;
  curve.sizes = static_cast<int>(sizes.size());
  return curve;
}

double byte_reduction_bound(double allgather_share, double byte_ratio) {
  if (byte_ratio <= 0) return 1.0;
  return 1.0 / (1.0 - allgather_share * (1.0 - 1.0 / byte_ratio));
}

double byte_reduction_bound(const Breakdown& baseline, const Breakdown& coded) {
  if (!(baseline.total_s > 0)) return 1.0;
  const auto links = [](const Breakdown& b) {
    std::vector<uint64_t> keys;
    for (const auto& [link, load] : b.allgather_links) keys.push_back(link);
    return keys;
  };
  if (links(baseline) != links(coded)) return std::numeric_limits<double>::quiet_NaN();
  // The busy time each link saves if it shrinks by exactly its byte ratio.
  double saved = 0;
  for (const auto& [link, load] : baseline.allgather_links) {
    if (load.bytes > 0)
      saved += load.busy_s * (1.0 - coded.allgather_links.at(link).bytes / load.bytes);
  }
  return baseline.total_s / (baseline.total_s - saved);
}

}  // namespace ciera::sim
