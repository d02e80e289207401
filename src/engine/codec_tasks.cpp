// A gather's codec work on the worker threads: this rank's shards into their envelope slots
// (start(), so that encoding overlaps earlier work), and every peer's envelope into the output
// as soon as its payload exchange completes (paper §3.3: decoding is the only codec work on the
// critical path). Payload bytes move only through `memory` (engine/memory_ops.hpp).
#include <string>

#include "ciera/error.hpp"
#include "engine/engine_impl.hpp"

namespace ciera {

// Small shards are grouped so a task is worth its scheduling.
void CompressedAllgather::Impl::encode(Gather& g, BucketState& s, bool raw) {
  g.sends_raw = raw;
  constexpr uint64_t kTaskBytes = 1 << 20;
  const size_t params = s.layout.params();
  // Read here, not on the workers: the step moves on when the gather finishes.
  const std::span<const uint8_t> raw_params = warmup_raw_params(s, s.step);
  size_t first = 0;
  while (first < params) {
    size_t last = first;
    uint64_t bytes = 0;
    while (last < params && (last == first || bytes < kTaskBytes)) {
      bytes += s.layout.shard_values[rank][last] * s.value_bytes;
      ++last;
    }
    pool.submit(g.encoding, [&s, &g, first, last, raw, raw_params, this] {
      g.wait_for_input();
      for (size_t k = first; k < last; ++k) {
        const uint64_t shard_bytes = s.layout.shard_values[rank][k] * s.value_bytes;
        const std::byte* src = g.in + s.my_param_offset[k];
        std::byte* slot = s.send.data() + s.send_layout.slot_offset[k];
        if (raw || !s.encoders[k] || (!raw_params.empty() && raw_params[k])) {
          memory.copy(slot, src, shard_bytes);
          s.payload_bytes[k] = shard_bytes;
        } else {
          s.payload_bytes[k] = s.encoders[k]->encode(src, shard_bytes, slot);
        }
      }
    });
    first = last;
  }
}

uint64_t CompressedAllgather::Impl::pack(BucketState& s, uint64_t step, bool raw) {
  EnvelopeHeader header;
  header.bucket = static_cast<uint32_t>(&s - buckets.data());
  header.params = static_cast<uint32_t>(s.layout.params());
  header.step = step;
  header.all_raw = raw;
  return pack_envelope(s.send.data(), s.send_layout, s.payload_bytes, header, memory,
                       s.envelope_header);
}

// g.decoding completes when every peer's envelope is decoded and this rank's own shards are in
// place; g.verdict then holds the outcome.
void CompressedAllgather::Impl::start_decode(Gather& g) {
  BucketState& s = buckets[g.bucket];
  g.verdict = Verdict{};
  g.decode_started = std::chrono::steady_clock::now();
  // Own shards: straight from the input (nothing to do when gathering in place), except that a
  // lossy parameter sent coded gathers what its receivers reconstruct, so that every rank holds
  // the same values (its encoder wrote them; encoding is done before decoding starts).
  std::byte* own = g.slot(s.layout, rank);
  const uint64_t own_bytes = s.layout.rank_bytes(rank);
  const bool reconstruct = s.has_lossy && !g.sends_raw;
  if ((own != g.in || reconstruct) && own_bytes) {
    pool.submit(g.decoding, [own, &g, &s, own_bytes, reconstruct, this] {
      g.wait_for_input();
      if (own != g.in) memory.move(own, g.in, own_bytes);
      if (!reconstruct) return;
      // Each payload where pack() left it: back to back after the envelope's header.
      uint64_t at = s.send_layout.envelope_offset + envelope_header_bytes(s.layout.params());
      for (size_t k = 0; k < s.layout.params(); ++k) {
        if (s.lossy_params[k] && s.encoders[k]) {
          s.encoders[k]->reconstruct(s.send.data() + at, s.payload_bytes[k], own + s.my_param_offset[k],
                                     s.layout.shard_values[rank][k] * s.value_bytes);
        }
        at += s.payload_bytes[k];
      }
    });
  }
  uint64_t at = 0;
  for (int p = 0; p < world; ++p) {
    const uint64_t bytes = g.control[p].envelope_bytes;
    if (p != rank) {
      pool.submit(g.decoding, [&g, p, at, bytes, this] { decode_envelope(g, p, at, bytes); });
    }
    at += bytes;
  }
}

// Decodes `peer`'s envelope (at `envelope_offset` of the bucket's `recv`) into its slot of the
// output; a problem becomes g.verdict, never an exception, so that every rank can agree on it.
void CompressedAllgather::Impl::decode_envelope(Gather& g, int peer, uint64_t envelope_offset,
                                                uint64_t envelope_bytes) {
  BucketState& s = buckets[g.bucket];
  EnvelopeHeader expected;
  expected.bucket = static_cast<uint32_t>(g.bucket);
  expected.params = static_cast<uint32_t>(s.layout.params());
  expected.step = g.step;
  ciera::decode_envelope(s.recv.data() + envelope_offset, envelope_bytes, expected, s.layout, peer,
                         s.decoders[peer], warmup_raw_params(s, g.step), g.slot(s.layout, peer), memory,
                         [&g, peer](int param, const std::string& reason) {
                           std::lock_guard lock(g.verdict_mutex);
                           record_failure(g.verdict, peer, param, reason);
                         });
}

}  // namespace ciera
