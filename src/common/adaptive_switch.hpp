// Whether to send compressed or raw, from measured times. Where links are fast and cores are
// few, coding can cost more than the bytes it saves (docs/benchmarks.md, unshaped links); this
// switch finds out on the real system and keeps the faster way, probing the other way now and
// then in case conditions changed. The engine keys it by bucket (its allgathers); the lossless
// collectives by call shape (their reduce-scatters and alltoallvs).
//
// In the engine the choice is engine-wide, so all buckets switch together: gathers batched into
// one round share their exchange, and only same-mode rounds give comparable times. Every rank
// feeds it the same agreed numbers (the slowest rank's time for each gather), so the ranks come
// to the same preferences; but a gather reads the preference when it starts, on the caller's
// thread, while other buckets' gathers finishing on the communication thread may change it, so
// with several buckets in flight two ranks can start one bucket's gather on either side of a
// change (seen about once in a few hundred gathers where both ways cost nearly the same). That
// gather is then mixed, which is exact (every envelope says how it is coded); its time is not
// sampled (finish() keeps same-mode gathers only). The preference has no margin: it follows
// the sums whenever a new sample tips them, at a probe or not; the medians of kKeptSamples damp
// it. Switching is free and exact: while a bucket goes raw its encoders and decoders stay frozen
// at the same state, and its next compressed gather is a delta against it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

namespace ciera {

class AdaptiveSwitch {
 public:
  static constexpr uint32_t kProbeGathers = 4;    // gathers per mode in a probe
  static constexpr uint32_t kReprobeEvery = 256;  // gathers between probes
  static constexpr size_t kKeptSamples = 8;

  // Whether gather number `index` (counted after warmup) should be compressed.
  bool compress(uint64_t index) const {
    if (index < 2 * kProbeGathers) return index < kProbeGathers;  // first both ways
    const uint64_t in_cycle = (index - 2 * kProbeGathers) % (kReprobeEvery + kProbeGathers);
    // Each cycle ends with a probe of the way not chosen.
    return in_cycle < kReprobeEvery ? prefer_compressed_ : !prefer_compressed_;
  }

  // Records the agreed duration of a finished gather of `bucket`.
  void record(size_t bucket, bool compressed, double seconds) {
    auto& samples = (compressed ? compressed_s_ : raw_s_)[bucket];
    samples.push_back(seconds);
    if (samples.size() > kKeptSamples) samples.erase(samples.begin());
    // Compare the buckets measured both ways: the sum of their typical times.
    double compressed_total = 0, raw_total = 0;
    bool any = false;
    for (const auto& [b, c] : compressed_s_) {
      auto r = raw_s_.find(b);
      if (r == raw_s_.end() || c.empty() || r->second.empty()) continue;
      compressed_total += median(c);
      raw_total += median(r->second);
      any = true;
    }
    if (any) prefer_compressed_ = compressed_total <= raw_total;
  }

  bool prefers_compressed() const { return prefer_compressed_; }

 private:
  static double median(std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }

  // Vectors and maps, not deques: their moves are noexcept, so engine state stays movable.
  std::map<size_t, std::vector<double>> compressed_s_, raw_s_;
  bool prefer_compressed_ = true;
};

}  // namespace ciera
