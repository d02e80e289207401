// The peer schemes' quantisers (include/ciera/peers.hpp): ZeRO++'s block-wise int8 and SDP4Bit's
// 4-bit weight differences. Their byte layouts are in docs/format.md, "Peer-scheme frames".
//
// Every rank must reconstruct the same bits from the same payload, so the arithmetic is plain
// FP32 in a fixed order, compiled without contraction into fused multiply-adds (CMakeLists.txt).
#include "ciera/peers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "ciera/error.hpp"
#include "codec/limits.hpp"
#include "common/bytes.hpp"
#include "common/float_mode.hpp"
#include "common/floats.hpp"

namespace ciera::peers {
namespace {

// A group's scale is a little-endian FP32; NaN marks a group that travels raw (it held a value
// that is not finite, which no scale can carry).
constexpr size_t kScaleBytes = 4;

template <DType D>
struct Values;

template <>
struct Values<DType::kBF16> {
  static constexpr size_t kBytes = 2;
  static float load(const std::byte* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16_to_float(h);
  }
  // Round to nearest, ties to even; only finite or infinite values reach here (never NaN).
  static void store(std::byte* p, float f) {
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    const uint16_t h = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    std::memcpy(p, &h, 2);
  }
};

template <>
struct Values<DType::kFP16> {
  static constexpr size_t kBytes = 2;
  static float load(const std::byte* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return fp16_to_float(h);
  }
  static void store(std::byte* p, float f) {
    const uint16_t h = float_to_fp16(f);
    std::memcpy(p, &h, 2);
  }
};

template <>
struct Values<DType::kFP32> {
  static constexpr size_t kBytes = 4;
  static float load(const std::byte* p) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  static void store(std::byte* p, float f) { std::memcpy(p, &f, 4); }
};

void put_scale(std::byte* p, float scale) { store_le32(reinterpret_cast<uint8_t*>(p), std::bit_cast<uint32_t>(scale)); }
float get_scale(const std::byte* p) { return std::bit_cast<float>(load_le32(reinterpret_cast<const uint8_t*>(p))); }

uint64_t groups_of(uint64_t values, uint32_t group_values) {
  return (values + group_values - 1) / group_values;
}

void check_group(const char* what, uint32_t group_values) {
  if (group_values == 0) throw ConfigError(std::string(what) + ": group_values must be > 0");
}

// Dispatches on the dtype once per call, so the loops are specialised per format.
template <typename F>
decltype(auto) with_values(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBF16: return f(Values<DType::kBF16>{});
    case DType::kFP16: return f(Values<DType::kFP16>{});
    case DType::kFP32: return f(Values<DType::kFP32>{});
  }
  throw ConfigError("peer quantiser: unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

void check_values(const char* what, DType dtype, size_t bytes) {
  const size_t value_bytes = dtype_info(dtype).value_bytes;
  if (bytes % value_bytes) {
    throw ConfigError(std::string(what) + ": " + std::to_string(bytes) + " bytes are not whole " +
                      std::string(dtype_name(dtype)) + " values");
  }
}

// splitmix64's finaliser: a counter-based source of the stochastic rounding's uniform draws.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

float uniform01(uint64_t seed, uint64_t index) {
  // 24 random bits: every float in [0, 1) of that spacing, exactly.
  return static_cast<float>(mix64(seed + 0x9E3779B97F4A7C15ull * (index + 1)) >> 40) * 0x1p-24f;
}

// Round half to even, for |x| < 2^22 (levels are far smaller): adding and subtracting 1.5 * 2^23
// leaves x rounded under the default rounding mode. Unlike std::nearbyint, which on baseline
// x86-64 is a libm call that saves and restores the floating-point environment, it is two adds.
float round_half_even(float x) {
  constexpr float kMagic = 0x1.8p23f;
  return (x + kMagic) - kMagic;
}

// floor(x) for |x| < 2^31, inline (std::floor is a libm call without SSE4.1).
int floor_to_int(float x) {
  const int t = static_cast<int>(x);
  return t - (static_cast<float>(t) > x);
}

[[noreturn]] void malformed(const char* what, const std::string& why) {
  throw FormatError(std::string(what) + ": malformed payload: " + why);
}

}  // namespace

// ---- int8 ---------------------------------------------------------------------------------------

size_t int8_bound_bytes(DType dtype, uint64_t values, uint32_t group_values) {
  check_group("int8_bound_bytes", group_values);
  codec::check_shard_values(values, "int8_bound_bytes");
  const uint64_t per_value = std::max<uint64_t>(1, dtype_info(dtype).value_bytes);
  return groups_of(values, group_values) * kScaleBytes + values * per_value;
}

size_t quantize_int8(DType dtype, std::span<const std::byte> values, uint32_t group_values,
                     std::span<std::byte> out) {
  // Every rank computes with the values these give (lossy: the same on every rank, or the
  // ranks train apart): IEEE arithmetic whatever the thread flushes (common/float_mode.hpp).
  const DefinedFloatingPoint defined;
  check_group("quantize_int8", group_values);
  check_values("quantize_int8", dtype, values.size());
  return with_values(dtype, [&]<typename V>(V) -> size_t {
    const uint64_t n = values.size() / V::kBytes;
    if (out.size() < int8_bound_bytes(dtype, n, group_values)) {
      throw ConfigError("quantize_int8: output smaller than int8_bound_bytes()");
    }
    std::byte* o = out.data();
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      const std::byte* in = values.data() + first * V::kBytes;
      float max_abs = 0;
      bool finite = true;
      for (uint64_t i = 0; i < count; ++i) {
        const float x = V::load(in + i * V::kBytes);
        finite = finite && std::isfinite(x);
        max_abs = std::max(max_abs, std::fabs(x));
      }
      const float inverse = max_abs > 0 ? 127.0f / max_abs : 0.0f;
      // A group too small to scale (127 / max overflows FP32: subnormal values) travels raw too.
      if (!finite || !std::isfinite(inverse)) {
        put_scale(o, std::numeric_limits<float>::quiet_NaN());
        std::memcpy(o + kScaleBytes, in, count * V::kBytes);
        o += kScaleBytes + count * V::kBytes;
        continue;
      }
      const float scale = max_abs / 127.0f;
      put_scale(o, scale);
      auto* q = reinterpret_cast<int8_t*>(o + kScaleBytes);
      for (uint64_t i = 0; i < count; ++i) {
        const float r = round_half_even(V::load(in + i * V::kBytes) * inverse);
        q[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
      }
      o += kScaleBytes + count;
    }
    return static_cast<size_t>(o - out.data());
  });
}

void dequantize_int8(DType dtype, std::span<const std::byte> in, uint32_t group_values,
                     std::span<std::byte> values) {
  const DefinedFloatingPoint defined;  // as quantize_int8's
  check_group("dequantize_int8", group_values);
  check_values("dequantize_int8", dtype, values.size());
  with_values(dtype, [&]<typename V>(V) {
    const uint64_t n = values.size() / V::kBytes;
    size_t at = 0;
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      if (in.size() - at < kScaleBytes) malformed("dequantize_int8", "truncated at a group's scale");
      const float scale = get_scale(in.data() + at);
      at += kScaleBytes;
      std::byte* dst = values.data() + first * V::kBytes;
      if (std::isnan(scale)) {
        if (in.size() - at < count * V::kBytes) malformed("dequantize_int8", "truncated raw group");
        std::memcpy(dst, in.data() + at, count * V::kBytes);
        at += count * V::kBytes;
        continue;
      }
      if (!(scale >= 0) || std::isinf(scale)) malformed("dequantize_int8", "a scale that is negative or infinite");
      if (in.size() - at < count) malformed("dequantize_int8", "truncated quantised group");
      const auto* q = reinterpret_cast<const int8_t*>(in.data() + at);
      for (uint64_t i = 0; i < count; ++i) {
        if (q[i] == -128) malformed("dequantize_int8", "level -128 (quantize_int8 writes -127..127)");
        V::store(dst + i * V::kBytes, static_cast<float>(q[i]) * scale);
      }
      at += count;
    }
    if (at != in.size()) malformed("dequantize_int8", std::to_string(in.size() - at) + " bytes past the last group");
  });
}

bool int8_within_bound(DType dtype, std::span<const std::byte> values,
                       std::span<const std::byte> reconstructed, uint32_t group_values) {
  check_group("int8_within_bound", group_values);
  check_values("int8_within_bound", dtype, values.size());
  if (reconstructed.size() != values.size()) {
    throw ConfigError("int8_within_bound: " + std::to_string(reconstructed.size()) +
                      " reconstructed bytes for " + std::to_string(values.size()) + " input bytes");
  }
  return with_values(dtype, [&]<typename V>(V) -> bool {
    const uint64_t n = values.size() / V::kBytes;
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      const size_t offset = first * V::kBytes;
      double max_abs = 0;
      bool finite = true;
      for (uint64_t i = 0; i < count; ++i) {
        const double x = V::load(values.data() + offset + i * V::kBytes);
        finite = finite && std::isfinite(x);
        max_abs = std::max(max_abs, std::fabs(x));
      }
      // quantize_int8's own test for a group it sends raw.
      if (!finite || !std::isfinite(max_abs > 0 ? 127.0f / static_cast<float>(max_abs) : 0.0f)) {
        if (std::memcmp(values.data() + offset, reconstructed.data() + offset, count * V::kBytes) !=
            0) {
          return false;
        }
        continue;
      }
      for (uint64_t i = 0; i < count; ++i) {
        const double x = V::load(values.data() + offset + i * V::kBytes);
        const double y = V::load(reconstructed.data() + offset + i * V::kBytes);
        if (!(std::fabs(y - x) <= max_abs / 127.0)) return false;
      }
    }
    return true;
  });
}

// ---- 4-bit differences --------------------------------------------------------------------------

size_t diff4_bound_bytes(DType dtype, uint64_t values, uint32_t group_values) {
  check_group("diff4_bound_bytes", group_values);
  codec::check_shard_values(values, "diff4_bound_bytes");
  const uint64_t value_bytes = dtype_info(dtype).value_bytes;
  // A raw group (value_bytes per value) is never smaller than a nibble group.
  return groups_of(values, group_values) * kScaleBytes + values * value_bytes;
}

// Level q in [-7, 7] travels as the nibble q + 8 (1..15); nibble 0 never occurs. Value i of a group
// is the low nibble of byte i / 2 when i is even, the high nibble when odd.
size_t quantize_diff4(DType dtype, std::span<const std::byte> values, std::span<std::byte> base,
                      uint32_t group_values, uint64_t seed, std::span<std::byte> out) {
  const DefinedFloatingPoint defined;  // as quantize_int8's
  check_group("quantize_diff4", group_values);
  check_values("quantize_diff4", dtype, values.size());
  if (base.size() != values.size()) {
    throw ConfigError("quantize_diff4: base is " + std::to_string(base.size()) + " bytes, values " +
                      std::to_string(values.size()));
  }
  return with_values(dtype, [&]<typename V>(V) -> size_t {
    const uint64_t n = values.size() / V::kBytes;
    if (out.size() < diff4_bound_bytes(dtype, n, group_values)) {
      throw ConfigError("quantize_diff4: output smaller than diff4_bound_bytes()");
    }
    std::byte* o = out.data();
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      const std::byte* in = values.data() + first * V::kBytes;
      std::byte* b = base.data() + first * V::kBytes;
      float max_abs = 0;
      bool finite = true;
      for (uint64_t i = 0; i < count; ++i) {
        const float d = V::load(in + i * V::kBytes) - V::load(b + i * V::kBytes);
        finite = finite && std::isfinite(d);
        max_abs = std::max(max_abs, std::fabs(d));
      }
      const float inverse = max_abs > 0 ? 7.0f / max_abs : 0.0f;
      // A value, its base or their difference is not finite, or the differences are too small to
      // scale (7 / max overflows FP32): the group sends its values.
      if (!finite || !std::isfinite(inverse)) {
        put_scale(o, std::numeric_limits<float>::quiet_NaN());
        std::memcpy(o + kScaleBytes, in, count * V::kBytes);
        std::memcpy(b, in, count * V::kBytes);
        o += kScaleBytes + count * V::kBytes;
        continue;
      }
      const float scale = max_abs / 7.0f;
      put_scale(o, scale);
      std::byte* nibbles = o + kScaleBytes;
      std::memset(nibbles, 0, (count + 1) / 2);
      for (uint64_t i = 0; i < count; ++i) {
        const float d = V::load(in + i * V::kBytes) - V::load(b + i * V::kBytes);
        const int q = std::clamp(floor_to_int(d * inverse + uniform01(seed, first + i)), -7, 7);
        nibbles[i / 2] |= static_cast<std::byte>((q + 8) << (4 * (i & 1)));
        if (q != 0) V::store(b + i * V::kBytes, V::load(b + i * V::kBytes) + static_cast<float>(q) * scale);
      }
      o += kScaleBytes + (count + 1) / 2;
    }
    return static_cast<size_t>(o - out.data());
  });
}

void apply_diff4(DType dtype, std::span<const std::byte> in, uint32_t group_values,
                 std::span<std::byte> base) {
  const DefinedFloatingPoint defined;  // as quantize_int8's
  check_group("apply_diff4", group_values);
  check_values("apply_diff4", dtype, base.size());
  with_values(dtype, [&]<typename V>(V) {
    const uint64_t n = base.size() / V::kBytes;
    // First the whole payload is checked, so that a malformed one leaves `base` as it was.
    size_t at = 0;
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      if (in.size() - at < kScaleBytes) malformed("apply_diff4", "truncated at a group's scale");
      const float scale = get_scale(in.data() + at);
      at += kScaleBytes;
      const uint64_t bytes = std::isnan(scale) ? count * V::kBytes : (count + 1) / 2;
      if (in.size() - at < bytes) malformed("apply_diff4", "truncated group");
      if (!std::isnan(scale)) {
        if (!(scale >= 0) || std::isinf(scale)) malformed("apply_diff4", "a scale that is negative or infinite");
        for (uint64_t i = 0; i < count; ++i) {
          const unsigned nibble = (static_cast<unsigned>(in[at + i / 2]) >> (4 * (i & 1))) & 15u;
          if (nibble == 0) malformed("apply_diff4", "nibble 0 (quantize_diff4 writes 1..15)");
        }
        if ((count & 1) && (static_cast<unsigned>(in[at + count / 2]) >> 4) != 0) {
          malformed("apply_diff4", "bits set past a group's last value");
        }
      }
      at += bytes;
    }
    if (at != in.size()) malformed("apply_diff4", std::to_string(in.size() - at) + " bytes past the last group");
    at = 0;
    for (uint64_t first = 0; first < n; first += group_values) {
      const uint64_t count = std::min<uint64_t>(group_values, n - first);
      const float scale = get_scale(in.data() + at);
      at += kScaleBytes;
      std::byte* b = base.data() + first * V::kBytes;
      if (std::isnan(scale)) {
        std::memcpy(b, in.data() + at, count * V::kBytes);
        at += count * V::kBytes;
        continue;
      }
      for (uint64_t i = 0; i < count; ++i) {
        const int q = static_cast<int>((static_cast<unsigned>(in[at + i / 2]) >> (4 * (i & 1))) & 15u) - 8;
        if (q != 0) V::store(b + i * V::kBytes, V::load(b + i * V::kBytes) + static_cast<float>(q) * scale);
      }
      at += (count + 1) / 2;
    }
  });
}

}  // namespace ciera::peers
