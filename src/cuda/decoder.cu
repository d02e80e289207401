// The device ShardDecoder (include/ciera/cuda.hpp): codec/device_decode.hpp's steps, each a kernel
// on the caller's stream. The steps are the functions the host emulation runs in the tests
// (tests/test_device_decoder.cpp holds them to the CPU decoder); this file only places them in
// device memory and launches them.
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "ciera/cuda.hpp"
#include "ciera/error.hpp"
#include "codec/device_decode.hpp"
#include "common/moved_from.hpp"
#include "format/xxh3.hpp"
#include "launch.cuh"

namespace ciera::cuda {
using detail::check_cuda;
using detail::DeviceMemory;
using detail::Launch;

namespace {
// Bytes of the cache a decoder holds between frames: an exponent per value, or for a value-delta
// stream the previous values (as codec_cache_bytes says; no second copy: the cache is written
// only from the verified output).
uint64_t cache_bytes_of(const codec::device::DecodeConfig& c) {
  return c.value_delta ? c.num_values * c.value_bytes : c.num_values;
}
uint64_t value_delta(const codec::device::DecodeConfig& c, uint64_t bytes) { return c.value_delta ? bytes : 0; }
}  // namespace

struct ShardDecoder::Impl {
  Impl(const CodecConfig& config, uint64_t n, StreamIdentity id)
      : c(codec::device::make_decode_config(config, n)),
        cache(c.value_delta ? 0 : n),
        decoded(n),
        block_offset(c.value_delta ? 8 : 8 * (c.blocks + 1)),
        segment_offsets(8 * (entropy::rans_segment_count(n) + 2)),
        slots(4 * entropy::kRansTotal),
        fine_slots(4 * 3 * entropy::kRansTotal),
        digests(8 * (codec::device::checksum_chunks(n * c.value_bytes) + 1)),
        digest_bytes(8 * (codec::device::checksum_chunks(n * c.value_bytes) + 1)),
        plan(sizeof(codec::device::DecodePlan)),
        state(sizeof(codec::device::DecodeState)),
        secret(format::xxh3::kSecretBytes),
        values(value_delta(c, n * c.value_bytes)),
        escape_symbols(value_delta(c, n + 1)),
        escape_offsets(value_delta(c, 8 * (entropy::rans_segment_count(n) + 2))),
        chunk_escapes(value_delta(c, 8 * (codec::device::difference_group_chunks(n) + 1))),
        chunk_bits(value_delta(c, 8 * (codec::device::difference_group_chunks(n) + 1))) {
    codec::device::DecodeState initial;
    initial.stream = id.stream;
    initial.epoch = id.epoch;
    cudaStream_t setup = detail::thread_stream();
    check_cuda(cudaMemcpyAsync(state.p, &initial, sizeof initial, cudaMemcpyHostToDevice, setup), "state");
    check_cuda(cudaMemcpyAsync(secret.p, format::xxh3::default_secret(), format::xxh3::kSecretBytes,
                               cudaMemcpyHostToDevice, setup), "secret");
    const uint64_t cached = cache_bytes_of(c);
    check_cuda(cudaMemsetAsync(c.value_delta ? values.p : cache.p, 0, cached == 0 ? 1 : cached, setup), "cache");
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
    // The allocations and copies above are ordered on this thread's stream only
    // (launch.cuh); frames run on other streams, so wait for it here (`initial` is on the stack).
    if (const cudaError_t e = cudaStreamSynchronize(setup); e != cudaSuccess) {
      cudaEventDestroy(done);  // ~Impl does not run for a constructor that throws
      check_cuda(e, "decoder setup");
    }
  }
  ~Impl() {
    cudaEventSynchronize(done);  // the last frame's copy into `verdict` may still be queued
    cudaEventDestroy(done);
  }

  // Orders `stream` after the last work this decoder enqueued (on whichever stream).
  void after_previous(cudaStream_t stream) { check_cuda(cudaStreamWaitEvent(stream, done, 0), "stream wait"); }

  codec::device::DecodeConfig c;
  DeviceMemory cache, decoded, block_offset, segment_offsets, slots, fine_slots, digests,
      digest_bytes, plan, state, secret;
  DeviceMemory values, escape_symbols, escape_offsets, chunk_escapes, chunk_bits;  // value-delta streams
  detail::PinnedBlock verdict_block{sizeof(codec::device::DecodePlan)};
  codec::device::DecodePlan* verdict = verdict_block.as<codec::device::DecodePlan>();  // pinned: the last plan
  cudaEvent_t done = nullptr;
  bool pending = false;
  bool broken = false;  // a frame's launches failed part-way: its enqueued steps' effects are unknown
};

ShardDecoder::ShardDecoder(const CodecConfig& config, uint64_t num_values, StreamIdentity expected)
    : impl_(std::make_unique<Impl>(config, num_values, expected)) {}
ShardDecoder::~ShardDecoder() = default;
ShardDecoder::Impl& ShardDecoder::state() const { return live_state(impl_, "cuda::ShardDecoder"); }
ShardDecoder::ShardDecoder(ShardDecoder&&) noexcept = default;
ShardDecoder& ShardDecoder::operator=(ShardDecoder&&) noexcept = default;

void ShardDecoder::decode(const void* payload, uint64_t payload_bytes, void* shard, Stream stream) {
  if (state().pending) check();
  Impl& m = state();
  if (m.broken) {
    throw Error("cuda::ShardDecoder: an earlier frame's launch failed part-way, so its cache may be "
                "half committed; make a new decoder (and have its sender start with a key frame)");
  }
  m.after_previous(stream);  // a request_resync() or reset() on another stream comes first
  codec::device::Buffers b;
  b.payload = static_cast<const uint8_t*>(payload);
  b.payload_bytes = payload_bytes;
  b.out = static_cast<uint8_t*>(shard);
  b.cache = m.cache.as<uint8_t>();
  b.decoded = m.decoded.as<uint8_t>();
  b.block_offset = m.block_offset.as<uint64_t>();
  b.segment_offsets = m.segment_offsets.as<uint64_t>();
  b.slots = m.slots.as<uint32_t>();
  b.fine_slots = m.fine_slots.as<uint32_t>();
  b.digests = m.digests.as<uint64_t>();
  b.digest_bytes = m.digest_bytes.as<uint8_t>();
  b.plan = m.plan.as<codec::device::DecodePlan>();
  b.state = m.state.as<codec::device::DecodeState>();
  b.secret = m.secret.as<uint8_t>();
  b.values = m.values.as<uint8_t>();
  b.escape_symbols = m.escape_symbols.as<uint8_t>();
  b.escape_offsets = m.escape_offsets.as<uint64_t>();
  b.chunk_escapes = m.chunk_escapes.as<uint64_t>();
  b.chunk_bits = m.chunk_bits.as<uint64_t>();
  try {
    codec::device::decode_frame(Launch{stream}, b, m.c);
    check_cuda(cudaMemcpyAsync(m.verdict, m.plan.p, sizeof *m.verdict, cudaMemcpyDeviceToHost, stream),
               "verdict copy");
    check_cuda(cudaEventRecord(m.done, stream), "event record");
  } catch (...) {
    // The steps enqueued before the failure still run: later work (and ~Impl's wait before its
    // memory is freed) must wait for them, and no later frame may follow them.
    cudaEventRecord(m.done, stream);
    m.broken = true;
    throw;
  }
  m.pending = true;
}

void ShardDecoder::check() {
  Impl& m = state();
  if (!m.pending) return;
  check_cuda(cudaEventSynchronize(m.done), "decode");
  m.pending = false;
  if (m.verdict->status != codec::device::kOk) {
    throw FormatError(codec::device::describe_status(m.verdict->status, m.verdict->detail[0],
                                                     m.verdict->detail[1]));
  }
}

void ShardDecoder::request_resync(Stream stream) {
  static const uint32_t one = 1;
  Impl& m = state();
  m.after_previous(stream);  // after a pending frame's commit, which clears the request
  check_cuda(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(m.state.p) +
                                 offsetof(codec::device::DecodeState, resync_requested),
                             &one, sizeof one, cudaMemcpyHostToDevice, stream), "request_resync");
  check_cuda(cudaEventRecord(m.done, stream), "event record");
}

void ShardDecoder::reset(Stream stream) {
  static const uint32_t zero = 0;
  Impl& m = state();
  m.after_previous(stream);
  check_cuda(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(m.state.p) +
                                 offsetof(codec::device::DecodeState, has_cache),
                             &zero, sizeof zero, cudaMemcpyHostToDevice, stream), "reset");
  request_resync(stream);
}

uint32_t ShardDecoder::epoch() const {
  Impl& m = state();
  check_cuda(cudaEventSynchronize(m.done), "decoder epoch");
  codec::device::DecodeState state;
  cudaStream_t setup = detail::thread_stream();
  check_cuda(cudaMemcpyAsync(&state, m.state.p, sizeof state, cudaMemcpyDeviceToHost, setup), "state copy");
  check_cuda(cudaStreamSynchronize(setup), "state copy");
  return state.epoch;
}

uint64_t ShardDecoder::num_values() const { return state().c.num_values; }
size_t ShardDecoder::cache_bytes() const { return cache_bytes_of(state().c); }

namespace {
std::vector<uint8_t> copy_out(const detail::DeviceMemory& from, uint64_t bytes, cudaEvent_t after) {
  std::vector<uint8_t> host(bytes);
  check_cuda(cudaEventSynchronize(after), "cache copy");
  if (!host.empty()) {
    cudaStream_t setup = detail::thread_stream();
    check_cuda(cudaMemcpyAsync(host.data(), from.p, host.size(), cudaMemcpyDeviceToHost, setup), "cache copy");
    check_cuda(cudaStreamSynchronize(setup), "cache copy");
  }
  return host;
}
}  // namespace

std::vector<uint8_t> ShardDecoder::cached_exponents() const {
  const Impl& m = state();
  return copy_out(m.cache, m.c.value_delta ? 0 : m.c.num_values, m.done);
}

std::vector<uint8_t> ShardDecoder::cached_values() const {
  const Impl& m = state();
  return copy_out(m.values, m.c.value_delta ? m.c.num_values * m.c.value_bytes : 0, m.done);
}

}  // namespace ciera::cuda
