// The device ShardEncoder (include/ciera/cuda.hpp): codec/device_encode.hpp's steps, each a kernel
// on the caller's stream. The steps are the functions the host emulation runs in the tests
// (tests/test_device_encoder.cpp holds its payloads to the CPU encoder's byte for byte); this file
// only places them in device memory and launches them.
#include <cuda_runtime.h>

#include <utility>

#include "ciera/cuda.hpp"
#include "codec/device_encode.hpp"
#include "codec/frame_schedule.hpp"
#include "common/moved_from.hpp"
#include "entropy/stream_writer_hd.hpp"
#include "format/xxh3.hpp"
#include "launch.cuh"

namespace ciera::cuda {
using detail::check_cuda;
using detail::DeviceMemory;
using detail::Launch;

// Buffer sizes of one kind of stream only: an exponent-reuse encoder holds no values, a
// value-delta encoder no exponents, change lists or block hashes.
namespace {
uint64_t exponent_reuse(const codec::device::EncodeConfig& c, uint64_t bytes) { return c.value_delta ? 0 : bytes; }
uint64_t value_delta(const codec::device::EncodeConfig& c, uint64_t bytes) { return c.value_delta ? bytes : 0; }
}  // namespace

struct ShardEncoder::Impl {
  Impl(const CodecConfig& config, uint64_t n, StreamIdentity id)
      : c(codec::device::make_encode_config(config, n)),
        stream(id.stream),
        // A value-delta stream has no warmup of key frames (as the CPU encoder).
        schedule{.warmup = c.value_delta ? 0 : config.warmup_steps, .epoch = id.epoch},
        sent(exponent_reuse(c, n)), exps(n), block_symbols(exponent_reuse(c, n)),
        sent_hashes(exponent_reuse(c, 16 * (c.blocks + 1))),
        changes_in_block(exponent_reuse(c, 4 * (c.blocks + 1))), change_base(exponent_reuse(c, 8 * (c.blocks + 1))),
        block_rank(exponent_reuse(c, 8 * (c.blocks + 1))), block_at(exponent_reuse(c, 8 * (c.blocks + 1))),
        positions(exponent_reuse(c, 2 * (n + 1))), steps(exponent_reuse(c, n + 1)),
        count_symbols(exponent_reuse(c, c.blocks + 1)), change_symbols(exponent_reuse(c, n + 1)),
        escape_symbols(n + 1), extra(exponent_reuse(c, (11 * (c.blocks + n) + 7) / 8 + 8)),
        scratch((entropy::rans_segment_count(n) + 1) * entropy::device::kSegmentScratch),
        seg_bytes(8 * (entropy::rans_segment_count(n) + 2)),
        seg_offsets(8 * (entropy::rans_segment_count(n) + 2)),
        digests(8 * (n * c.value_bytes / format::kChecksumChunkBytes + 2)),
        digest_bytes(8 * (n * c.value_bytes / format::kChecksumChunkBytes + 2)),
        plan(sizeof(codec::device::EncodePlan)),
        secret(format::xxh3::kSecretBytes),
        sent_values(value_delta(c, n * c.value_bytes)),
        z(value_delta(c, 4 * n)),
        groups(value_delta(c, (n + codec::kGroupValues - 1) / codec::kGroupValues + 1)),
        chunk_escapes(value_delta(c, 8 * (codec::device::difference_chunks(n) + 1))),
        chunk_bits(value_delta(c, 8 * (codec::device::difference_chunks(n) + 1))),
        extra_words(value_delta(c, 4 * codec::device::difference_extra_words(n, c.value_bytes))) {
    check_cuda(cudaMemcpyAsync(secret.p, format::xxh3::default_secret(), format::xxh3::kSecretBytes,
                               cudaMemcpyHostToDevice, detail::thread_stream()), "secret");
    *length = 0;
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
    // The allocations and the copy above are ordered on this thread's stream only
    // (launch.cuh); frames run on other streams, so wait for it here.
    if (const cudaError_t e = cudaStreamSynchronize(detail::thread_stream()); e != cudaSuccess) {
      cudaEventDestroy(done);  // ~Impl does not run for a constructor that throws
      check_cuda(e, "encoder setup");
    }
  }
  ~Impl() {
    cudaEventSynchronize(done);  // the last frame's copy into `length` may still be queued
    cudaEventDestroy(done);
  }

  codec::device::EncodeConfig c;
  uint32_t stream;
  codec::FrameSchedule schedule;
  DeviceMemory sent, exps, block_symbols, sent_hashes, changes_in_block, change_base, block_rank, block_at,
      positions, steps, count_symbols, change_symbols, escape_symbols, extra, scratch, seg_bytes,
      seg_offsets, digests, digest_bytes, plan, secret;
  DeviceMemory sent_values, z, groups, chunk_escapes, chunk_bits, extra_words;  // value-delta streams
  detail::PinnedBlock length_block{sizeof(uint64_t)};
  uint64_t* length = length_block.as<uint64_t>();  // pinned: the last payload's length
  cudaEvent_t done = nullptr;
  bool broken = false;  // a frame's launches failed part-way: its enqueued steps' effects are unknown
};

ShardEncoder::ShardEncoder(const CodecConfig& config, uint64_t num_values, StreamIdentity identity)
    : impl_(std::make_unique<Impl>(config, num_values, identity)) {}
ShardEncoder::~ShardEncoder() = default;
ShardEncoder::Impl& ShardEncoder::state() const { return live_state(impl_, "cuda::ShardEncoder"); }
ShardEncoder::ShardEncoder(ShardEncoder&&) noexcept = default;
ShardEncoder& ShardEncoder::operator=(ShardEncoder&&) noexcept = default;

void ShardEncoder::encode(const void* shard, void* payload, uint64_t* payload_bytes, Stream s) {
  Impl& m = state();
  if (m.broken) {
    throw Error("cuda::ShardEncoder: an earlier frame's launch failed part-way, so its state may be "
                "half updated; make a new encoder (its first frame is a key frame)");
  }
  // Frames use the same scratch and state: one waits for the one before, whatever its stream.
  check_cuda(cudaStreamWaitEvent(s, m.done, 0), "stream wait");
  codec::device::set_frame(m.c, m.schedule.next_is_key(), m.stream, m.schedule.epoch, m.schedule.sequence);
  codec::device::EncodeBuffers b;
  b.values = static_cast<const uint8_t*>(shard);
  b.payload = static_cast<uint8_t*>(payload);
  b.sent = m.sent.as<uint8_t>();
  b.sent_hashes = m.sent_hashes.as<uint64_t>();
  b.exps = m.exps.as<uint8_t>();
  b.block_symbols = m.block_symbols.as<uint8_t>();
  b.changes_in_block = m.changes_in_block.as<uint32_t>();
  b.change_base = m.change_base.as<uint64_t>();
  b.block_rank = m.block_rank.as<uint64_t>();
  b.block_at = m.block_at.as<uint64_t>();
  b.positions = m.positions.as<uint16_t>();
  b.steps = m.steps.as<uint8_t>();
  b.count_symbols = m.count_symbols.as<uint8_t>();
  b.change_symbols = m.change_symbols.as<uint8_t>();
  b.escape_symbols = m.escape_symbols.as<uint8_t>();
  b.extra = m.extra.as<uint8_t>();
  b.scratch = m.scratch.as<uint8_t>();
  b.seg_bytes = m.seg_bytes.as<uint64_t>();
  b.seg_offsets = m.seg_offsets.as<uint64_t>();
  b.digests = m.digests.as<uint64_t>();
  b.digest_bytes = m.digest_bytes.as<uint8_t>();
  b.plan = m.plan.as<codec::device::EncodePlan>();
  b.secret = m.secret.as<uint8_t>();
  b.sent_values = m.sent_values.as<uint8_t>();
  b.z = m.z.as<uint32_t>();
  b.groups = m.groups.as<uint8_t>();
  b.chunk_escapes = m.chunk_escapes.as<uint64_t>();
  b.chunk_bits = m.chunk_bits.as<uint64_t>();
  b.extra_words = m.extra_words.as<uint32_t>();
  try {
    codec::device::encode_frame(Launch{s}, b, m.c);
    const auto* length_on_device = reinterpret_cast<const uint8_t*>(m.plan.p) +
                                   offsetof(codec::device::EncodePlan, payload_bytes);
    check_cuda(cudaMemcpyAsync(payload_bytes, length_on_device, sizeof(uint64_t), cudaMemcpyDeviceToDevice, s),
               "payload length");
    check_cuda(cudaMemcpyAsync(m.length, length_on_device, sizeof(uint64_t), cudaMemcpyDeviceToHost, s),
               "payload length");
    check_cuda(cudaEventRecord(m.done, s), "event record");
  } catch (...) {
    // As the decoder: later work waits for the steps already enqueued; no frame follows them.
    cudaEventRecord(m.done, s);
    m.broken = true;
    throw;
  }
  m.schedule.advance();
}

uint64_t ShardEncoder::payload_bytes() {
  check_cuda(cudaEventSynchronize(state().done), "encode");
  return *state().length;
}

void ShardEncoder::request_key_frame() { state().schedule.request_key_frame(); }

uint64_t ShardEncoder::num_values() const { return state().c.num_values; }
size_t ShardEncoder::max_payload_bytes() const { return state().c.capacity; }
uint32_t ShardEncoder::epoch() const { return state().schedule.epoch; }
uint64_t ShardEncoder::next_sequence() const { return state().schedule.sequence; }

}  // namespace ciera::cuda
