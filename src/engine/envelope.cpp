// The envelope's bytes (docs/format.md, "Engine protocol", step 2).
#include "engine/envelope.hpp"

#include <algorithm>
#include <stdexcept>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "common/bytes.hpp"
#include "engine/protocol.hpp"

namespace ciera {

uint64_t envelope_bound(const BucketLayout& layout, int rank, uint32_t block_values) {
  const uint32_t value_bytes = dtype_info(layout.dtype).value_bytes;
  uint64_t bytes = envelope_header_bytes(layout.params());
  for (size_t k = 0; k < layout.params(); ++k) {
    const uint64_t n = layout.shard_values[rank][k];
    bytes += std::max<uint64_t>(n * value_bytes, coded_payload_bound(layout.policy[k], layout.dtype, n, block_values));
  }
  return bytes;
}

uint64_t coded_payload_bound(ShardPolicy policy, DType dtype, uint64_t values, uint32_t block_values) {
  if (!coded_policy(policy)) return 0;
  const StreamKind kind = policy_stream_kind(policy);
  if (kind == StreamKind::kExponentReuse || kind == StreamKind::kValueDelta) {
    return max_payload_bytes(dtype, values, block_values);
  }
  return peers::frame_bound_bytes(kind, dtype, values, block_values);
}

uint64_t raw_envelope_bytes(const BucketLayout& layout, int rank) {
  return envelope_header_bytes(layout.params()) + layout.rank_bytes(rank);
}

void lay_out_send_buffer(std::span<const uint64_t> slot_capacity_bytes, SendLayout& layout) {
  constexpr uint64_t kLine = 64;
  const uint64_t header = envelope_header_bytes(slot_capacity_bytes.size());
  layout.envelope_offset = (kLine - header % kLine) % kLine;
  layout.slot_offset.resize(slot_capacity_bytes.size());
  uint64_t slot = layout.envelope_offset + header;
  for (size_t k = 0; k < slot_capacity_bytes.size(); ++k) {
    slot = (slot + kLine - 1) / kLine * kLine;
    layout.slot_offset[k] = slot;
    slot += slot_capacity_bytes[k];
  }
  layout.buffer_bytes = slot;
}

uint64_t pack_envelope(std::byte* send, const SendLayout& layout,
                       std::span<const uint64_t> payload_bytes, const EnvelopeHeader& header,
                       const MemoryOps& memory, std::span<uint8_t> scratch) {
  std::byte* envelope = send + layout.envelope_offset;
  const size_t params = payload_bytes.size();
  const uint64_t header_bytes = envelope_header_bytes(params);
  if (scratch.size() < header_bytes) throw std::logic_error("pack_envelope: scratch too small");
  uint8_t* head = scratch.data();
  uint64_t at = header_bytes;
  for (size_t k = 0; k < params; ++k) {
    const uint64_t slot = layout.slot_offset[k] - layout.envelope_offset;
    if (slot != at && payload_bytes[k] != 0)
      memory.move(envelope + at, envelope + slot, payload_bytes[k]);
    store_le64(head + kEnvelopeFixedBytes + 8 * k, payload_bytes[k]);
    at += payload_bytes[k];
  }
  store_le32(head, kEnvelopeMagic);
  head[4] = kEngineProtocolVersion;
  head[5] = header.all_raw ? kEnvelopeAllRaw : 0;
  store_le16(head + 6, 0);
  store_le32(head + 8, header.bucket);
  store_le32(head + 12, header.params);
  store_le64(head + 16, header.step);
  memory.copy(envelope, reinterpret_cast<const std::byte*>(head), header_bytes);
  return at;
}

bool EnvelopeReader::open(const EnvelopeHeader& expected) {
  const uint64_t header = envelope_header_bytes(expected.params);
  if (bytes_ < header) return false;
  header_.resize(header);
  memory_.copy(reinterpret_cast<std::byte*>(header_.data()), envelope_, header);
  const uint8_t* head = header_.data();
  if (load_le32(head) != kEnvelopeMagic || head[4] != kEngineProtocolVersion ||
      load_le32(head + 8) != expected.bucket || load_le32(head + 12) != expected.params ||
      load_le64(head + 16) != expected.step) {
    return false;
  }
  // Unknown flags and non-zero reserved bytes are malformed, as in a payload header.
  if ((head[5] & ~kEnvelopeAllRaw) != 0 || load_le16(head + 6) != 0) return false;
  params_ = expected.params;
  next_param_ = 0;
  offset_ = header;
  return true;
}

bool EnvelopeReader::all_raw() const { return (header_.at(5) & kEnvelopeAllRaw) != 0; }

bool EnvelopeReader::next(std::span<const std::byte>& payload) {
  if (next_param_ >= params_) return false;
  const uint8_t* head = header_.data();
  const uint64_t length = load_le64(head + kEnvelopeFixedBytes + 8 * next_param_);
  if (length > bytes_ - offset_) return false;
  payload = {envelope_ + offset_, length};
  offset_ += length;
  ++next_param_;
  return true;
}

void decode_envelope(const std::byte* envelope, uint64_t envelope_bytes,
                     const EnvelopeHeader& expected, const BucketLayout& layout, int peer,
                     std::span<const std::unique_ptr<PayloadDecoder>> decoders,
                     std::span<const uint8_t> raw_params, std::byte* dest, const MemoryOps& memory,
                     const EnvelopeFailure& fail) {
  // Worded only on failure: a steady-state gather builds no strings.
  auto who = [peer] { return "rank " + std::to_string(peer) + "'s envelope"; };
  EnvelopeReader reader(envelope, envelope_bytes, memory);
  if (!reader.open(expected)) {
    fail(-1, who() + " header is malformed or for another gather");
    return;
  }
  const bool raw = reader.all_raw();
  const uint32_t value_bytes = dtype_info(layout.dtype).value_bytes;
  for (size_t k = 0; k < layout.params(); ++k) {
    const uint64_t bytes = layout.shard_values[peer][k] * value_bytes;
    std::span<const std::byte> payload;
    if (!reader.next(payload)) {
      fail(static_cast<int>(k), who() + " is shorter than its shard lengths");
      return;
    }
    if (raw || !decoders[k] || (!raw_params.empty() && raw_params[k])) {
      if (payload.size() != bytes) {
        fail(static_cast<int>(k), "raw shard of " + std::to_string(payload.size()) +
                                      " bytes, expected " + std::to_string(bytes));
        return;
      }
      memory.copy(dest, payload.data(), bytes);
    } else {
      try {
        decoders[k]->decode(payload.data(), payload.size(), dest, bytes);
      } catch (const FormatError& e) {
        fail(static_cast<int>(k), e.what());
      }
    }
    dest += bytes;
  }
  if (!reader.at_end()) fail(-1, who() + " has trailing bytes");
}

}  // namespace ciera
