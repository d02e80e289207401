// The GPU decoder's steps (codec/device_decode.hpp) run on the host, one index at a time: the same
// functions the CUDA kernels run, so tests and fuzzers hold the device decoder's logic to the CPU
// decoder on any machine. Not a production decoder (it is sequential and slow).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ciera/codec.hpp"
#include "codec/device_decode.hpp"
#include "entropy/rans_core.hpp"
#include "format/xxh3.hpp"

namespace ciera::codec::device {

class EmulatedDecoder {
 public:
  EmulatedDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected = {})
      : config_(make_decode_config(config, num_values)),
        cache_(config_.value_delta ? 0 : num_values),
        decoded_(num_values),
        block_offset_(config_.value_delta ? 1 : config_.blocks + 1),
        segment_offsets_(entropy::rans_segment_count(num_values) + 2),
        slots_(entropy::kRansTotal),
        fine_slots_(3 * entropy::kRansTotal),
        digests_(checksum_chunks(num_values * config_.value_bytes) + 1),
        digest_bytes_(8 * digests_.size()),
        values_(config_.value_delta ? num_values * config_.value_bytes : 0),
        escape_symbols_(config_.value_delta ? num_values + 1 : 0),
        escape_offsets_(config_.value_delta ? entropy::rans_segment_count(num_values) + 2 : 0),
        chunk_escapes_(config_.value_delta ? difference_group_chunks(num_values) + 1 : 0),
        chunk_bits_(config_.value_delta ? difference_group_chunks(num_values) + 1 : 0) {
    state_.stream = expected.stream;
    state_.epoch = expected.epoch;
  }

  // Decodes `payload` into `shard` (num_values values); returns kOk or why it was refused (the
  // cache and stream position then unchanged).
  uint32_t decode(std::span<const uint8_t> payload, std::span<uint8_t> shard) {
    Buffers b;
    b.payload = payload.data();
    b.payload_bytes = payload.size();
    b.out = shard.data();
    b.cache = cache_.data();
    b.decoded = decoded_.data();
    b.block_offset = block_offset_.data();
    b.segment_offsets = segment_offsets_.data();
    b.slots = slots_.data();
    b.fine_slots = fine_slots_.data();
    b.digests = digests_.data();
    b.digest_bytes = digest_bytes_.data();
    b.plan = &plan_;
    b.state = &state_;
    b.secret = format::xxh3::default_secret();
    b.values = values_.data();
    b.escape_symbols = escape_symbols_.data();
    b.escape_offsets = escape_offsets_.data();
    b.chunk_escapes = chunk_escapes_.data();
    b.chunk_bits = chunk_bits_.data();
    decode_frame([](uint64_t n, auto f) {
      for (uint64_t i = 0; i < n; ++i) f(i);
    }, b, config_);
    return plan_.status;
  }

  void request_resync() { state_.resync_requested = 1; }
  void reset() {
    state_.has_cache = 0;
    state_.resync_requested = 1;
  }
  const DecodePlan& plan() const { return plan_; }
  const DecodeState& state() const { return state_; }
  std::span<const uint8_t> cache() const { return cache_; }
  // A value-delta stream's cache: the previous values.
  std::span<const uint8_t> values() const { return values_; }

 private:
  DecodeConfig config_;
  DecodePlan plan_;
  DecodeState state_;
  std::vector<uint8_t> cache_, decoded_;
  std::vector<uint64_t> block_offset_, segment_offsets_;
  std::vector<uint32_t> slots_, fine_slots_;
  std::vector<uint64_t> digests_;
  std::vector<uint8_t> digest_bytes_;
  std::vector<uint8_t> values_, escape_symbols_;
  std::vector<uint64_t> escape_offsets_, chunk_escapes_, chunk_bits_;
};

}  // namespace ciera::codec::device
