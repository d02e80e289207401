// The codec's public size functions (include/ciera/codec.hpp): what a shard costs on the wire and
// in memory, from the wire layout (docs/format.md) that only the codec knows.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/limits.hpp"
#include "codec/wire.hpp"
#include "common/checked.hpp"
#include "format/planes.hpp"

namespace ciera {

double expected_payload_bytes(const CodecConfig& codec, DType dtype, uint64_t values,
                              double block_change_rate, double value_change_rate) {
  codec.validate();
  for (const auto& [name, rate] : {std::pair{"block_change_rate", block_change_rate},
                                   std::pair{"value_change_rate", value_change_rate}}) {
    if (!(rate >= 0.0 && rate <= 1.0)) {  // NaN fails both
      throw ConfigError(std::string("expected_payload_bytes: ") + name +
                        " must be in [0, 1], got " + std::to_string(rate));
    }
  }
  if (values == 0) return 0;
  const uint64_t sign_mantissa = format::SignMantissaLayout(dtype, values).total_bytes();
  const uint64_t blocks = wire::block_count(values, codec.block_values);
  // The paper's block mode: every exponent of each changed block.
  double exponents = block_change_rate * double(values) * dtype_info(dtype).exponent_bits / 8.0;
  // Fine mode: with ~1% of values changing, almost every block of 512 holds a change (q near 1)
  // and block mode saves nothing, while fine mode sends ~1.5 bytes per change (measured 8.1
  // bits/value for BF16 at 0.94% changes). Only with exact detection, as the encoder.
  if (codec.detection == ChangeDetection::kExact) {
    const double fine = value_change_rate * double(values) * kFineBytesPerChange +
                        block_change_rate * double(blocks) * kFineBytesPerBlock;
    exponents = std::min(exponents, fine);
  }
  // The header, the bitmap and the padding that aligns a large sign-mantissa plane.
  const uint64_t bitmap = wire::bitmap_bytes_for(values, codec.block_values);
  return double(wire::sign_mantissa_offset(bitmap, sign_mantissa) + sign_mantissa) + exponents;
}

uint64_t codec_cache_bytes(const CodecConfig& codec, uint64_t values, bool sender) {
  codec.validate();
  codec::check_shard_values(values, "codec_cache_bytes");
  // The stateless and int8 peer schemes keep nothing between frames.
  if (codec.stream_kind == StreamKind::kStateless || codec.stream_kind == StreamKind::kZeroppInt8)
    return 0;
  // A value-delta stream: both sides keep the previous values (and SDP4Bit's both sides their
  // reconstruction).
  if (codec.stream_kind == StreamKind::kValueDelta || codec.stream_kind == StreamKind::kSdp4bit) {
    const std::optional<uint64_t> bytes =
        checked_product(values, dtype_info(codec.dtype).value_bytes);
    if (!bytes)
      throw ConfigError("codec_cache_bytes: " + std::to_string(values) +
                        " values are more than 2^64 - 1 bytes");
    return *bytes;
  }
  if (!sender || codec.detection == ChangeDetection::kExact) return values;  // a byte per exponent
  return wire::block_count(values, codec.block_values) * 16;  // one XXH3-128 per block
}

}  // namespace ciera
