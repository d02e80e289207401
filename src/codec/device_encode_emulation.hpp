// The GPU encoder's steps (codec/device_encode.hpp) run on the host, one index at a time: the same
// functions the CUDA kernels run, so tests hold the device encoder's payloads to the CPU
// encoder's byte for byte on any machine. Not a production encoder (sequential and slow).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "codec/device_encode.hpp"
#include "codec/frame_schedule.hpp"
#include "format/xxh3.hpp"

namespace ciera::codec::device {

class EmulatedEncoder {
 public:
  EmulatedEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity = {})
      : config_(make_encode_config(config, num_values)),
        stream_(identity.stream),
        // A value-delta stream has no warmup of key frames (as the CPU encoder).
        schedule_{.warmup = config_.value_delta ? 0 : config.warmup_steps, .epoch = identity.epoch},
        sent_(exponent_reuse(num_values)), exps_(num_values), block_symbols_(exponent_reuse(num_values)),
        // Sized as src/cuda/encoder.cu sizes them, so that a step touching a buffer its stream
        // kind does not have fails here too (a null pointer; under AddressSanitizer, any overrun).
        sent_hashes_(exponent_reuse(2 * (config_.blocks + 1))),
        changes_in_block_(exponent_reuse(config_.blocks + 1)), change_base_(exponent_reuse(config_.blocks + 1)),
        block_rank_(exponent_reuse(config_.blocks + 1)), block_at_(exponent_reuse(config_.blocks + 1)),
        positions_(exponent_reuse(num_values + 1)), steps_(exponent_reuse(num_values + 1)),
        count_symbols_(exponent_reuse(config_.blocks + 1)),
        change_symbols_(exponent_reuse(num_values + 1)), escape_symbols_(num_values + 1),
        extra_(exponent_reuse((11 * (config_.blocks + num_values) + 7) / 8 + 8)),
        scratch_((entropy::rans_segment_count(num_values) + 1) * entropy::device::kSegmentScratch),
        seg_bytes_(entropy::rans_segment_count(num_values) + 2),
        seg_offsets_(entropy::rans_segment_count(num_values) + 2),
        digests_(num_values * config_.value_bytes / format::kChecksumChunkBytes + 2),
        digest_bytes_(8 * digests_.size()),
        sent_values_(value_delta(num_values * config_.value_bytes)),
        z_(value_delta(num_values)),
        groups_(value_delta((num_values + kGroupValues - 1) / kGroupValues + 1)),
        chunk_escapes_(value_delta(difference_chunks(num_values) + 1)),
        chunk_bits_(value_delta(difference_chunks(num_values) + 1)),
        extra_words_(value_delta(difference_extra_words(num_values, config_.value_bytes))),
        plan_(std::make_unique<EncodePlan>()) {}

  // Encodes `shard` into `payload` (max_payload_bytes); returns the payload's length.
  uint64_t encode(std::span<const uint8_t> shard, std::span<uint8_t> payload) {
    set_frame(config_, schedule_.next_is_key(), stream_, schedule_.epoch, schedule_.sequence);
    EncodeBuffers b;
    b.values = shard.data();
    b.payload = payload.data();
    b.sent = sent_.data();
    b.sent_hashes = sent_hashes_.data();
    b.exps = exps_.data();
    b.block_symbols = block_symbols_.data();
    b.changes_in_block = changes_in_block_.data();
    b.change_base = change_base_.data();
    b.block_rank = block_rank_.data();
    b.block_at = block_at_.data();
    b.positions = positions_.data();
    b.steps = steps_.data();
    b.count_symbols = count_symbols_.data();
    b.change_symbols = change_symbols_.data();
    b.escape_symbols = escape_symbols_.data();
    b.extra = extra_.data();
    b.scratch = scratch_.data();
    b.seg_bytes = seg_bytes_.data();
    b.seg_offsets = seg_offsets_.data();
    b.digests = digests_.data();
    b.digest_bytes = digest_bytes_.data();
    b.plan = plan_.get();
    b.secret = format::xxh3::default_secret();
    b.sent_values = sent_values_.data();
    b.z = z_.data();
    b.groups = groups_.data();
    b.chunk_escapes = chunk_escapes_.data();
    b.chunk_bits = chunk_bits_.data();
    b.extra_words = extra_words_.data();
    encode_frame([](uint64_t n, auto f) {
      for (uint64_t i = 0; i < n; ++i) f(i);
    }, b, config_);
    schedule_.advance();
    return plan_->payload_bytes;
  }

  void request_key_frame() { schedule_.request_key_frame(); }
  const EncodePlan& plan() const { return *plan_; }
  // What the receivers hold (a value-delta stream), as the CPU encoder's sent_values.
  std::span<const uint8_t> sent_values() const { return sent_values_; }

 private:
  // Buffer sizes of one kind of stream only (the other kind's are left empty).
  uint64_t exponent_reuse(uint64_t size) const { return config_.value_delta ? 0 : size; }
  uint64_t value_delta(uint64_t size) const { return config_.value_delta ? size : 0; }

  EncodeConfig config_;
  uint32_t stream_;
  FrameSchedule schedule_;
  std::vector<uint8_t> sent_, exps_, block_symbols_;
  std::vector<uint64_t> sent_hashes_;
  std::vector<uint32_t> changes_in_block_;
  std::vector<uint64_t> change_base_, block_rank_, block_at_;
  std::vector<uint16_t> positions_;
  std::vector<uint8_t> steps_, count_symbols_, change_symbols_, escape_symbols_, extra_, scratch_;
  std::vector<uint64_t> seg_bytes_, seg_offsets_, digests_;
  std::vector<uint8_t> digest_bytes_;
  std::vector<uint8_t> sent_values_;
  std::vector<uint32_t> z_;
  std::vector<uint8_t> groups_;
  std::vector<uint64_t> chunk_escapes_, chunk_bits_;
  std::vector<uint32_t> extra_words_;
  std::unique_ptr<EncodePlan> plan_;
};

}  // namespace ciera::codec::device
