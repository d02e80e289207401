// The measured cost model of benefit-driven selection (paper §3.2: "Comm(·) maps a payload size to
// the measured Allgather latency (profiled at initialization)"), and the codec's throughput.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/selection.hpp"
#include "common/statistics.hpp"
#include "selection/agreement.hpp"

namespace ciera {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<double> gather_doubles(Transport& transport, double value) {
  std::vector<double> all(static_cast<size_t>(transport.size()));
  transport.allgather(&value, sizeof value, all.data());
  return all;
}

}  // namespace

CommCurve CommCurve::fit(std::vector<CommSample> samples) {
  for (const CommSample& s : samples) {
    if (!std::isfinite(s.bytes) || !std::isfinite(s.seconds) || s.bytes < 0 || s.seconds < 0) {
      throw ConfigError("CommCurve: sample (" + std::to_string(s.bytes) + " bytes, " +
                        std::to_string(s.seconds) + " s) is negative or not finite");
    }
  }
  std::sort(samples.begin(), samples.end(),
            [](const CommSample& a, const CommSample& b) { return a.bytes < b.bytes; });
  // Repeated sizes: keep their mean, so the curve is a function.
  std::vector<CommSample> merged;
  for (size_t i = 0; i < samples.size();) {
    size_t j = i;
    double sum = 0;
    for (; j < samples.size() && samples[j].bytes == samples[i].bytes; ++j) sum += samples[j].seconds;
    merged.push_back({samples[i].bytes, sum / double(j - i)});
    i = j;
  }
  if (merged.size() < 2) {
    throw ConfigError("CommCurve: need samples at two or more distinct sizes, got " +
                      std::to_string(merged.size()));
  }
  // Ordinary least squares t = alpha + bytes / bandwidth over the raw (noisy) points.
  const double n = double(merged.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const CommSample& s : merged) {
    sx += s.bytes, sy += s.seconds, sxx += s.bytes * s.bytes, sxy += s.bytes * s.seconds;
  }
  const double denom = n * sxx - sx * sx;
  double slope = denom > 0 ? (n * sxy - sx * sy) / denom : 0;
  // A non-positive slope (all sizes latency-bound in the noise) would mean infinite bandwidth;
  // use the slope through the end points instead, which the monotone curve makes >= 0.
  CommCurve curve;
  for (size_t i = 1; i < merged.size(); ++i) {  // a larger collective is never faster
    merged[i].seconds = std::max(merged[i].seconds, merged[i - 1].seconds);
  }
  if (slope <= 0) {
    slope = (merged.back().seconds - merged.front().seconds) / (merged.back().bytes - merged.front().bytes);
  }
  curve.alpha_s_ = std::max(0.0, (sy - slope * sx) / n);
  curve.bytes_per_s_ = slope > 0 ? 1.0 / slope : std::numeric_limits<double>::infinity();
  curve.samples_ = std::move(merged);
  return curve;
}

double CommCurve::seconds(double bytes) const {
  if (samples_.empty()) return 0;
  const double slope = std::isfinite(bytes_per_s_) ? 1.0 / bytes_per_s_ : 0.0;
  const CommSample& first = samples_.front();
  const CommSample& last = samples_.back();
  if (bytes >= last.bytes) return last.seconds + (bytes - last.bytes) * slope;
  // Below the samples: the line down from the first one, never under the fitted latency, nor
  // above the first sample (the latency is fitted to all the noisy points and may lie above it;
  // a smaller collective must not be modelled slower, or compressing could look like a loss and
  // expanding like a gain).
  if (bytes <= first.bytes) {
    return std::min(first.seconds,
                    std::max(alpha_s_, first.seconds - (first.bytes - bytes) * slope));
  }
  const auto upper = std::upper_bound(samples_.begin(), samples_.end(), bytes,
                                      [](double b, const CommSample& s) { return b < s.bytes; });
  const CommSample& hi = *upper;
  const CommSample& lo = *(upper - 1);
  const double t = (bytes - lo.bytes) / (hi.bytes - lo.bytes);
  return lo.seconds + t * (hi.seconds - lo.seconds);
}

std::vector<uint64_t> default_probe_sizes(uint64_t largest_bytes) {
  // At least two sizes, or the curve has no slope to fit (CommCurve::fit refuses one): a model
  // whose buckets are all 4 KiB or less is probed at 4 and 16 KiB.
  std::vector<uint64_t> sizes = {4096};
  for (uint64_t s = 4 * 4096; s < largest_bytes; s *= 4) sizes.push_back(s);
  sizes.push_back(std::max<uint64_t>(largest_bytes, 4 * 4096));
  return sizes;
}

CommCurve measure_allgather(Transport& transport, std::span<const uint64_t> sizes_bytes, int repeats) {
  std::vector<uint64_t> arguments(sizes_bytes.begin(), sizes_bytes.end());
  arguments.push_back(static_cast<uint64_t>(static_cast<int64_t>(repeats)));
  selection::agree_on_arguments(transport, "measure_allgather", arguments);
  // A median of no runs would read before the vector.
  if (repeats < 1) {
    throw ConfigError("measure_allgather: repeats must be >= 1, got " + std::to_string(repeats));
  }
  const int world = transport.size();
  const int rank = transport.rank();
  std::vector<CommSample> samples;
  std::vector<std::byte> out;
  std::vector<uint64_t> counts(static_cast<size_t>(world)), displs(static_cast<size_t>(world));
  for (const uint64_t total : sizes_bytes) {
    const uint64_t per_rank = (total + uint64_t(world) - 1) / uint64_t(world);
    out.assign(per_rank * uint64_t(world), std::byte{0x5a});
    for (int r = 0; r < world; ++r) counts[size_t(r)] = per_rank, displs[size_t(r)] = per_rank * uint64_t(r);
    std::vector<double> times;
    for (int i = 0; i <= repeats; ++i) {  // the first run warms up buffers and connections
      transport.barrier();
      const auto start = Clock::now();
      transport.allgatherv(out.data() + displs[size_t(rank)], out.data(), counts, displs);
      if (i > 0) times.push_back(seconds_since(start));
    }
    const std::vector<double> all = gather_doubles(transport, median(times));
    samples.push_back({double(per_rank * uint64_t(world)), *std::max_element(all.begin(), all.end())});
  }
  return CommCurve::fit(std::move(samples));
}

double agree_max(Transport& transport, double value) {
  const std::vector<double> all = gather_doubles(transport, value);
  return *std::max_element(all.begin(), all.end());
}

double agree_min(Transport& transport, double value) {
  const std::vector<double> all = gather_doubles(transport, value);
  return *std::min_element(all.begin(), all.end());
}

CostModel measure_cost_model(Transport& transport, uint64_t largest_bytes, std::span<const DType> dtypes,
                             const CodecConfig& codec, int repeats) {
  CostModel model;
  model.world_size = transport.size();
  model.allgather = measure_allgather(transport, default_probe_sizes(largest_bytes), repeats);
  for (const DType dtype : dtypes) {
    CodecConfig config = codec;
    config.dtype = dtype;
    config.stream_kind = StreamKind::kExponentReuse;
    const CodecThroughput local = measure_codec(config);
    // The slowest rank decides: every rank's selector must see the same numbers.
    model.throughput(dtype) = {agree_min(transport, local.detect_bytes_per_s),
                               agree_min(transport, local.encode_bytes_per_s),
                               agree_min(transport, local.decode_bytes_per_s)};
    config.stream_kind = StreamKind::kValueDelta;
    const CodecThroughput delta = measure_codec(config);
    model.delta_throughput(dtype) = {agree_min(transport, delta.detect_bytes_per_s),
                                     agree_min(transport, delta.encode_bytes_per_s),
                                     agree_min(transport, delta.decode_bytes_per_s)};
  }
  return model;
}

CodecThroughput measure_codec(const CodecConfig& base, uint64_t values, double change_rate, int repeats) {
  if (repeats < 1) {
    throw ConfigError("measure_codec: repeats must be >= 1, got " + std::to_string(repeats));
  }
  // A rate outside [0, 1] (or NaN) would convert to some 2^64 exponent flips a step.
  if (!(change_rate >= 0 && change_rate <= 1)) {
    throw ConfigError("measure_codec: change_rate must be in [0, 1], got " +
                      std::to_string(change_rate));
  }
  CodecConfig config = base;
  config.warmup_steps = 0;
  config.validate();
  const DTypeInfo info = dtype_info(config.dtype);
  const size_t bytes = values * info.value_bytes;
  const unsigned exponent_shift = info.sign_mantissa_bits - 1;
  // Weights of a trained layer: exponents spread around 2^-7, every mantissa moving each step,
  // and a sparse set of values crossing a power of two (an exponent step of ±1).
  std::mt19937_64 rng(0x5eed);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::vector<std::byte> shard(bytes);
  auto store = [&](size_t i, float v) {
    uint32_t f;
    std::memcpy(&f, &v, 4);
    if (config.dtype == DType::kFP32) {
      std::memcpy(shard.data() + 4 * i, &f, 4);
    } else {
      uint16_t h;
      if (config.dtype == DType::kBF16) {
        h = uint16_t(f >> 16);
      } else {  // a half-precision value of similar magnitude: sign, 5-bit exponent, mantissa
        const int e = std::clamp(int((f >> 23) & 0xff) - 127 + 15, 1, 30);
        h = uint16_t(((f >> 16) & 0x8000) | (uint32_t(e) << 10) | ((f >> 13) & 0x3ff));
      }
      std::memcpy(shard.data() + 2 * i, &h, 2);
    }
  };
  for (size_t i = 0; i < values; ++i) store(i, weight(rng));
  auto next_step = [&] {
    std::uniform_int_distribution<size_t> pick(0, values ? values - 1 : 0);
    const auto flips = size_t(double(values) * change_rate);
    for (size_t f = 0; f < flips; ++f) {  // exponent +1 on a random value, mantissa unchanged
      const size_t i = pick(rng);
      if (info.value_bytes == 2) {
        uint16_t h;
        std::memcpy(&h, shard.data() + 2 * i, 2);
        h = uint16_t(h ^ (1u << exponent_shift));
        std::memcpy(shard.data() + 2 * i, &h, 2);
      } else {
        uint32_t w;
        std::memcpy(&w, shard.data() + 4 * i, 4);
        w ^= 1u << exponent_shift;
        std::memcpy(shard.data() + 4 * i, &w, 4);
      }
    }
    for (size_t i = 0; i < bytes; i += 2 * info.value_bytes) shard[i] ^= std::byte{1};  // mantissa noise
  };

  ShardEncoder encoder(config, values);
  ShardDecoder decoder(config, values);
  ChangeMonitor monitor(config.dtype, {values}, config.block_values);
  std::vector<std::byte> payload(encoder.max_payload_bytes()), out(bytes);
  std::vector<double> detect, encode, decode;
  for (int i = 0; i <= repeats; ++i) {  // the first (key) frame is not timed
    auto start = Clock::now();
    monitor.observe(shard);
    const double detect_s = seconds_since(start);
    start = Clock::now();
    const FrameStats sent = encoder.encode(shard, payload);
    const double encode_s = seconds_since(start);
    start = Clock::now();
    decoder.decode({payload.data(), sent.payload_bytes}, out);
    const double decode_s = seconds_since(start);
    if (std::memcmp(out.data(), shard.data(), bytes) != 0) {
      throw Error("measure_codec: decoded shard differs from the input (a codec bug)");
    }
    if (i > 0) detect.push_back(detect_s), encode.push_back(encode_s), decode.push_back(decode_s);
    next_step();
  }
  const double b = double(bytes);
  return {b / std::max(median(detect), 1e-9), b / std::max(median(encode), 1e-9),
          b / std::max(median(decode), 1e-9)};
}

}  // namespace ciera
