#include "collectives/slice_coding.hpp"

#include <algorithm>
#include <string>

#include "ciera/error.hpp"

namespace ciera::collectives {

uint64_t coded_slice_bound(const CodecConfig& c, uint64_t values, uint64_t frame_values) {
  const uint64_t full = values / frame_values, rest = values % frame_values;
  return (full == 0 ? 0 : full * max_payload_bytes(c.dtype, frame_values, c.block_values)) +
         (rest == 0 ? 0 : max_payload_bytes(c.dtype, rest, c.block_values));
}

FrameStats encode_slice(const CodecConfig& c, uint64_t frame_values,
                        std::span<const std::byte> slice, std::span<std::byte> out) {
  const uint32_t value_bytes = dtype_info(c.dtype).value_bytes;
  const uint64_t values = slice.size() / value_bytes;
  FrameStats total;
  // Counted in values, not bytes: frame_values * value_bytes may not fit 64 bits.
  for (uint64_t first = 0; first < values; first += frame_values) {
    const uint64_t m = std::min(frame_values, values - first);
    const FrameStats f = encode_stateless_frame(
        c, slice.subspan(first * value_bytes, m * value_bytes), out.subspan(total.payload_bytes));
    total.payload_bytes += f.payload_bytes;
    total.sign_mantissa_bytes += f.sign_mantissa_bytes;
    total.coded_symbols_entropy_bits += f.coded_symbols_entropy_bits;
  }
  return total;
}

void decode_slice(const CodecConfig& c, std::span<const std::byte> in, std::span<std::byte> out) {
  const uint32_t value_bytes = dtype_info(c.dtype).value_bytes;
  uint64_t read = 0, written = 0;
  while (read < in.size()) {
    const PayloadInfo frame = inspect_leading_payload(in.subspan(read));
    const uint64_t values_left = (out.size() - written) / value_bytes;
    if (frame.num_values == 0 || frame.num_values > values_left) {
      throw FormatError("a frame of " + std::to_string(frame.num_values) + " values where " +
                        std::to_string(values_left) + " of the slice are left");
    }
    const uint64_t bytes = frame.num_values * value_bytes;
    decode_stateless(c, in.subspan(read, frame.payload_bytes), out.subspan(written, bytes));
    read += frame.payload_bytes;
    written += bytes;
  }
  if (written != out.size()) {
    throw FormatError("the slice's frames hold " + std::to_string(written / value_bytes) +
                      " of its " + std::to_string(out.size() / value_bytes) + " values");
  }
}

}  // namespace ciera::collectives
