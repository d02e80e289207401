// The peer schemes' stream coders: the quantisers of peers.cpp and stateless exponent coding,
// each payload framed with the stream's identity, its position and a checksum
// (docs/format.md, "Peer-scheme frames"), so that a misrouted, stale or damaged frame is an error
// like any other codec frame's, never a silently wrong reconstruction.
#include "codec/peer_coders.hpp"

#include <cstring>
#include <string>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/error.hpp"
#include "ciera/peers.hpp"
#include "codec/stream_position.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"

namespace ciera {
namespace {

constexpr uint32_t kPeerMagic = 0x53504943;  // "CIPS"
constexpr uint8_t kPeerVersion = 1;
constexpr size_t kPeerHeaderBytes = 56;
constexpr size_t kChecksumAt = 48;

// What a frame's body holds.
enum class PeerFrame : uint8_t {
  kValues = 1,  // the values as they are (sdp4bit's first frame, and after a resynchronisation)
  kCoded = 2,   // the scheme's coding of the values
  kRepeat = 3,  // sdp4bit: the input is what the previous frame carried; receivers keep their copy
};

struct PeerHeader {
  StreamKind kind;
  PeerFrame frame;
  DType dtype;
  uint32_t group_values;
  uint32_t stream;
  uint32_t epoch;
  uint64_t values;
  uint64_t sequence;
  uint64_t body_bytes;
};

// memcpy, for empty shards too (whose buffers may be null, which memcpy must not be given).
void copy_bytes(void* to, const void* from, size_t bytes) {
  if (bytes) std::memcpy(to, from, bytes);
}

uint64_t frame_checksum(const uint8_t* header, const std::byte* body, uint64_t body_bytes) {
  return XXH3_64bits_withSeed(body, body_bytes, checksum64(header, kChecksumAt));
}

void write_header(const PeerHeader& h, std::byte* payload) {
  auto* p = reinterpret_cast<uint8_t*>(payload);
  store_le32(p, kPeerMagic);
  p[4] = kPeerVersion;
  p[5] = static_cast<uint8_t>(h.kind);
  p[6] = static_cast<uint8_t>(h.frame);
  p[7] = static_cast<uint8_t>(h.dtype);
  store_le32(p + 8, h.group_values);
  store_le32(p + 12, h.stream);
  store_le32(p + 16, h.epoch);
  store_le32(p + 20, 0);
  store_le64(p + 24, h.values);
  store_le64(p + 32, h.sequence);
  store_le64(p + 40, h.body_bytes);
  store_le64(p + kChecksumAt, frame_checksum(p, payload + kPeerHeaderBytes, h.body_bytes));
}

uint32_t group_values_of(const CodecConfig& config) {
  switch (config.stream_kind) {
    case StreamKind::kZeroppInt8: return peers::kZeroppGroupValues;
    case StreamKind::kSdp4bit: return peers::kSdp4bitGroupValues;
    default: return config.block_values;
  }
}

uint64_t frame_seed(uint32_t stream, uint32_t epoch, uint64_t sequence) {
  return (uint64_t{stream} << 32 | epoch) ^ (sequence * 0xD1B54A32D192ED03ull);
}

class PeerEncoder final : public PayloadEncoder {
 public:
  PeerEncoder(const CodecConfig& config, uint64_t values, StreamIdentity identity)
      : config_(config), values_(values), value_bytes_(dtype_info(config.dtype).value_bytes),
        group_values_(group_values_of(config)), identity_(identity) {
    if (config.stream_kind == StreamKind::kSdp4bit) base_.resize(values * value_bytes_);
  }

  uint64_t encode(const std::byte* shard, uint64_t shard_bytes, std::byte* payload) override {
    if (shard_bytes != values_ * value_bytes_) {
      throw ConfigError(std::string(stream_kind_name(config_.stream_kind)) + " encoder: shard of " +
                        std::to_string(shard_bytes) + " bytes, expected " +
                        std::to_string(values_ * value_bytes_));
    }
    const std::span<const std::byte> in(shard, shard_bytes);
    std::byte* body = payload + kPeerHeaderBytes;
    const std::span<std::byte> out(body, max_payload_bytes() - kPeerHeaderBytes);
    PeerHeader h{config_.stream_kind, PeerFrame::kCoded, config_.dtype, group_values_, identity_.stream,
                 identity_.epoch, values_, sequence_, 0};
    switch (config_.stream_kind) {
      case StreamKind::kZeroppInt8:
        h.body_bytes = peers::quantize_int8(config_.dtype, in, group_values_, out);
        break;
      case StreamKind::kStateless:
        h.body_bytes = encode_stateless(config_, in, out);
        break;
      default:
        h.body_bytes = encode_difference(in, out, h);
        break;
    }
    write_header(h, payload);
    ++sequence_;
    return kPeerHeaderBytes + h.body_bytes;
  }

  void request_key_frame() override {
    ++identity_.epoch;
    key_requested_ = true;
  }
  uint32_t epoch() const override { return identity_.epoch; }
  size_t max_payload_bytes() const override {
    return peers::frame_bound_bytes(config_.stream_kind, config_.dtype, values_, config_.block_values);
  }
  size_t cache_bytes() const override { return base_.size(); }
  bool lossy() const override { return config_.stream_kind != StreamKind::kStateless; }

  void reconstruct(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
                   uint64_t shard_bytes) const override {
    if (config_.stream_kind == StreamKind::kSdp4bit) {
      copy_bytes(shard, base_.data(), shard_bytes);
    } else if (config_.stream_kind == StreamKind::kZeroppInt8) {
      peers::dequantize_int8(config_.dtype, {payload + kPeerHeaderBytes, payload_bytes - kPeerHeaderBytes},
                             group_values_, {shard, shard_bytes});
    } else {
      PayloadEncoder::reconstruct(payload, payload_bytes, shard, shard_bytes);
    }
  }

 private:
  // SDP4Bit: the values themselves first (receivers hold no copy yet), then 4-bit differences
  // against the reconstruction, or nothing when the input has not changed since the last frame
  // (FSDP2's backward re-gather of a layer: SDP4Bit gathers once per iteration, so both gathers
  // of a step see the same weights).
  uint64_t encode_difference(std::span<const std::byte> in, std::span<std::byte> out, PeerHeader& h) {
    const XXH128_hash_t hash = XXH3_128bits(in.data(), in.size());
    if (key_requested_) {
      copy_bytes(out.data(), in.data(), in.size());
      copy_bytes(base_.data(), in.data(), in.size());
      key_requested_ = false;
      last_input_ = hash;
      h.frame = PeerFrame::kValues;
      return in.size();
    }
    if (XXH128_isEqual(hash, last_input_)) {
      h.frame = PeerFrame::kRepeat;
      return 0;
    }
    last_input_ = hash;
    return peers::quantize_diff4(config_.dtype, in, base_, group_values_,
                                 frame_seed(identity_.stream, identity_.epoch, sequence_), out);
  }

  CodecConfig config_;
  uint64_t values_;
  uint32_t value_bytes_;
  uint32_t group_values_;
  StreamIdentity identity_;
  uint64_t sequence_ = 0;
  bool key_requested_ = true;
  std::vector<std::byte> base_;  // sdp4bit: what the receivers hold
  XXH128_hash_t last_input_{};
};

class PeerDecoder final : public PayloadDecoder {
 public:
  PeerDecoder(const CodecConfig& config, uint64_t values, StreamIdentity expected)
      : config_(config), values_(values), value_bytes_(dtype_info(config.dtype).value_bytes),
        group_values_(group_values_of(config)), stream_(expected.stream), epoch_(expected.epoch) {
    if (config.stream_kind == StreamKind::kSdp4bit) base_.resize(values * value_bytes_);
  }

  // A refused frame leaves the receiver's state (the sdp4bit copy, the stream position) as it
  // was; the shard's contents are then unspecified, as ShardDecoder::decode's (a zeropp-int8 body
  // found malformed part-way has written the groups before it): the engine fails the gather and
  // resends, so no scratch copy is spent on every frame.
  void decode(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
              uint64_t shard_bytes) override {
    const PeerHeader h = read_header(payload, payload_bytes);
    if (shard_bytes != values_ * value_bytes_) {
      throw FormatError(name() + " decoder: output of " + std::to_string(shard_bytes) + " bytes, expected " +
                        std::to_string(values_ * value_bytes_));
    }
    check_position(h);
    const std::span<const std::byte> body(payload + kPeerHeaderBytes, h.body_bytes);
    const std::span<std::byte> out(shard, shard_bytes);
    switch (h.frame) {
      case PeerFrame::kValues:
        copy_bytes(base_.data(), body.data(), body.size());
        has_base_ = true;
        copy_bytes(shard, base_.data(), shard_bytes);
        break;
      case PeerFrame::kRepeat:
        copy_bytes(shard, base_.data(), shard_bytes);
        break;
      case PeerFrame::kCoded:
        if (h.kind == StreamKind::kZeroppInt8) {
          peers::dequantize_int8(config_.dtype, body, group_values_, out);
        } else if (h.kind == StreamKind::kStateless) {
          // Not decode_stateless: it calls a key frame of another value count the caller's
          // mistake (std::invalid_argument), where here it is the frame's (FormatError).
          ShardDecoder::one_shot(config_, values_, {.stream = 0, .epoch = 0}).decode(body, out);
        } else {
          peers::apply_diff4(config_.dtype, body, group_values_, base_);
          copy_bytes(shard, base_.data(), shard_bytes);
        }
        break;
    }
    epoch_ = h.epoch;
    last_sequence_ = h.sequence;
    decoded_any_ = true;
    resync_requested_ = false;
  }

  void request_resync() override { resync_requested_ = true; }
  uint32_t epoch() const override { return epoch_; }
  size_t cache_bytes() const override { return base_.size(); }

 private:
  std::string name() const { return std::string(stream_kind_name(config_.stream_kind)); }

  [[noreturn]] void reject(const std::string& why) const {
    throw FormatError(name() + " frame of stream " + std::to_string(stream_) + ": " + why);
  }

  PeerHeader read_header(const std::byte* payload, uint64_t payload_bytes) const {
    if (payload_bytes < kPeerHeaderBytes) reject("truncated: " + std::to_string(payload_bytes) + " bytes");
    const auto* p = reinterpret_cast<const uint8_t*>(payload);
    if (load_le32(p) != kPeerMagic) reject("bad magic (not a peer-scheme frame)");
    if (p[4] != kPeerVersion) reject("version " + std::to_string(p[4]) + ", expected " + std::to_string(kPeerVersion));
    PeerHeader h{static_cast<StreamKind>(p[5]), static_cast<PeerFrame>(p[6]), static_cast<DType>(p[7]),
                 load_le32(p + 8), load_le32(p + 12), load_le32(p + 16), load_le64(p + 24),
                 load_le64(p + 32), load_le64(p + 40)};
    if (h.body_bytes != payload_bytes - kPeerHeaderBytes) {
      reject("header says " + std::to_string(h.body_bytes) + " body bytes, payload has " +
             std::to_string(payload_bytes - kPeerHeaderBytes));
    }
    if (load_le64(p + kChecksumAt) != frame_checksum(p, payload + kPeerHeaderBytes, h.body_bytes)) {
      reject("checksum mismatch (damaged in transit)");
    }
    if (load_le32(p + 20) != 0) reject("non-zero reserved field (bytes 20..23)");
    if (h.kind != config_.stream_kind) reject("a frame of another scheme (kind " + std::to_string(p[5]) + ")");
    if (h.dtype != config_.dtype || h.group_values != group_values_ || h.values != values_) {
      reject("dtype, group size or value count differ from this decoder's (" + std::to_string(h.values) +
             " values, expected " + std::to_string(values_) + ")");
    }
    const bool sdp4bit = h.kind == StreamKind::kSdp4bit;
    const bool known = h.frame == PeerFrame::kCoded ||
                       (sdp4bit && (h.frame == PeerFrame::kValues || h.frame == PeerFrame::kRepeat));
    if (!known) reject("unknown frame code " + std::to_string(p[6]));
    if (h.frame == PeerFrame::kValues && h.body_bytes != values_ * value_bytes_) reject("values frame of the wrong size");
    if (h.frame == PeerFrame::kRepeat && h.body_bytes != 0) reject("repeat frame with a body");
    return h;
  }

  // As ShardDecoder (docs/format.md, "Streams"): the next frame of this epoch, or after a
  // requested resynchronisation a frame that starts a later one (for sdp4bit, with the values).
  void check_position(const PeerHeader& h) const {
    const std::string frame = "epoch " + std::to_string(h.epoch) + ", sequence " + std::to_string(h.sequence);
    if (h.stream != stream_) reject("misrouted: it belongs to stream " + std::to_string(h.stream));
    const bool needs_base = h.kind == StreamKind::kSdp4bit && h.frame != PeerFrame::kValues;
    if (needs_base && !has_base_) reject("(" + frame + ") needs the values this receiver has not got yet");
    uint32_t ahead = 0;
    switch (codec::stream_position(h.epoch, h.sequence, epoch_, last_sequence_, decoded_any_,
                                   !needs_base, resync_requested_, ahead)) {
      case codec::StreamPosition::kNext:
      case codec::StreamPosition::kResync:
        return;
      case codec::StreamPosition::kStale:
        reject("stale or out of sequence (" + frame + "; this decoder is at epoch " +
               std::to_string(epoch_) +
               (decoded_any_ ? ", sequence " + std::to_string(last_sequence_)
                             : std::string(", nothing decoded")) +
               ")");
      case codec::StreamPosition::kUnrequested:
        reject("(" + frame +
               ") starts a new epoch, but this receiver asked for no resynchronisation");
      case codec::StreamPosition::kTooFarAhead:
        reject("(" + frame + ") is not a resynchronisation of this stream");
    }
  }

  CodecConfig config_;
  uint64_t values_;
  uint32_t value_bytes_;
  uint32_t group_values_;
  uint32_t stream_;
  uint32_t epoch_;
  uint64_t last_sequence_ = 0;
  bool decoded_any_ = false;
  bool resync_requested_ = false;
  bool has_base_ = false;
  std::vector<std::byte> base_;  // sdp4bit: the reconstruction every rank holds
};

void check_peer(const CodecConfig& config) {
  config.validate();
  if (!is_peer_stream(config.stream_kind)) {
    throw ConfigError("peer-scheme coder for a " + std::string(stream_kind_name(config.stream_kind)) + " stream");
  }
}

}  // namespace

bool is_peer_stream(StreamKind kind) {
  return kind == StreamKind::kZeroppInt8 || kind == StreamKind::kSdp4bit || kind == StreamKind::kStateless;
}

std::unique_ptr<PayloadEncoder> make_peer_encoder(const CodecConfig& config, uint64_t values,
                                                  StreamIdentity identity) {
  check_peer(config);
  return std::make_unique<PeerEncoder>(config, values, identity);
}

std::unique_ptr<PayloadDecoder> make_peer_decoder(const CodecConfig& config, uint64_t values,
                                                  StreamIdentity expected) {
  check_peer(config);
  return std::make_unique<PeerDecoder>(config, values, expected);
}

void PayloadEncoder::reconstruct(const std::byte*, uint64_t, std::byte*, uint64_t) const {
  throw std::logic_error("reconstruct() called on a lossless stream's encoder");
}

namespace peers {

size_t frame_bound_bytes(StreamKind kind, DType dtype, uint64_t values, uint32_t block_values) {
  switch (kind) {
    case StreamKind::kZeroppInt8:
      return kPeerHeaderBytes + int8_bound_bytes(dtype, values, kZeroppGroupValues);
    case StreamKind::kSdp4bit:
      return kPeerHeaderBytes + diff4_bound_bytes(dtype, values, kSdp4bitGroupValues);
    case StreamKind::kStateless:
      return kPeerHeaderBytes + max_payload_bytes(dtype, values, block_values);
    default:
      throw ConfigError("frame_bound_bytes: " + std::string(stream_kind_name(kind)) + " is not a peer scheme");
  }
}

}  // namespace peers
}  // namespace ciera
