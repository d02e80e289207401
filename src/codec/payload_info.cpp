// Codec entry points shared by both directions: names, payload inspection, one-shot coding.
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "codec/wire.hpp"

namespace ciera {

std::string_view frame_kind_name(FrameKind kind) {
  switch (kind) {
    case FrameKind::kKey: return "key";
    case FrameKind::kDelta: return "delta";
    case FrameKind::kValueDelta: return "value-delta";
  }
  return "unknown";
}

std::string_view exponent_section_name(ExponentSection section) {
  switch (section) {
    case ExponentSection::kFull: return "full";
    case ExponentSection::kUnchanged: return "unchanged";
    case ExponentSection::kBlock: return "block";
    case ExponentSection::kFine: return "fine";
    case ExponentSection::kDifferences: return "differences";
  }
  return "unknown";
}

uint32_t new_stream_epoch() {
  std::random_device entropy;  // the kernel's random source: differs across processes and restarts
  return entropy();
}

namespace {
PayloadInfo info_of(const wire::Header& h) {
  return {h.dtype,  h.kind,     h.section,  h.block_values,           h.num_values,
          h.stream, h.epoch,    h.sequence, h.has_content_checksum(), h.payload_bytes()};
}
}  // namespace

PayloadInfo inspect_payload(std::span<const std::byte> payload) {
  return info_of(
      wire::read_header(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
}

PayloadInfo inspect_leading_payload(std::span<const std::byte> bytes) {
  return info_of(
      wire::read_leading_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

namespace {
uint64_t values_in(const CodecConfig& config, size_t bytes, const char* who) {
  const uint32_t value_bytes = dtype_info(config.dtype).value_bytes;
  if (bytes % value_bytes != 0) {
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(bytes) +
                                " bytes is not a whole number of " +
                                std::string(dtype_name(config.dtype)) + " values");
  }
  return bytes / value_bytes;
}

// A stateless payload is the one frame of a stream that exists for it alone: stream 0, epoch 0.
constexpr StreamIdentity kStatelessStream{.stream = 0, .epoch = 0};
}  // namespace

FrameStats encode_stateless_frame(const CodecConfig& config, std::span<const std::byte> shard,
                                  std::span<std::byte> payload) {
  ShardEncoder encoder = ShardEncoder::one_shot(
      config, values_in(config, shard.size(), "encode_stateless"), kStatelessStream);
  return encoder.encode(shard, payload);
}

size_t encode_stateless(const CodecConfig& config, std::span<const std::byte> shard,
                        std::span<std::byte> payload) {
  return encode_stateless_frame(config, shard, payload).payload_bytes;
}

void decode_stateless(const CodecConfig& config, std::span<const std::byte> payload,
                      std::span<std::byte> shard) {
  const uint64_t values = values_in(config, shard.size(), "decode_stateless");
  // The output's size is the caller's choice: a sound payload of another N means the output is
  // the wrong size, said as such. (The decoder, set up for the output, would blame the payload.)
  // A header that does not parse is the payload's fault, and the decoder says why.
  if (payload.size() >= wire::kHeaderBytes) {
    try {
      const wire::Header h = wire::read_leading_header(
          reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
      if (h.dtype == config.dtype && h.num_values != values) {  // another dtype: the decoder says
        throw std::invalid_argument("decode_stateless: the output holds " + std::to_string(values) +
                                    " " + std::string(dtype_name(config.dtype)) +
                                    " values, but the payload holds " +
                                    std::to_string(h.num_values));
      }
    } catch (const FormatError&) {
    }
  }
  ShardDecoder decoder = ShardDecoder::one_shot(config, values, kStatelessStream);
  decoder.decode(payload, shard);
}

}  // namespace ciera
