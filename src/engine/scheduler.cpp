// The engine's communication thread. One gather of one bucket (docs/format.md, "Engine protocol"):
//
//   encode   this rank's shards into one envelope (worker threads; starts at start())
//   control  allgather of fixed-size control records: envelope sizes, steps, cold flags, policy
//            digests and any local error. Peers out of step or cold -> key-frame round.
//   payload  allgatherv of the envelopes, sized exactly (no padding to the maximum)
//   decode   every peer's envelope into the output (worker threads)
//   verdict  allgather of per-rank decode verdicts: all ranks agree that every shard was
//            reconstructed exactly; otherwise all re-send key frames once, then fail together.
//
// All collectives run on this one thread, in start() order, so that the order is the same on
// every rank and the caller's thread only waits where it asks to (paper §3.3: encoding overlaps
// earlier work, decoding is the only codec work on the critical path). Gathers started together
// share one round: one control, one batched payload and one verdict exchange.
#include <algorithm>
#include <limits>
#include <stdexcept>

#include "ciera/error.hpp"
#include "common/text.hpp"
#include "engine/engine_impl.hpp"
#include "engine/protocol.hpp"

namespace ciera {
namespace {

// Each of `gathers` its share of one exchange of `record_bytes` from each of `world` ranks (the
// first also the remainder, so that the shares add up to what was sent).
void charge_control(std::span<Gather* const> gathers, size_t record_bytes, int world) {
  const uint64_t sent = uint64_t{record_bytes} * static_cast<uint64_t>(world);
  for (Gather* g : gathers) g->stats.control_bytes += sent / gathers.size();
  gathers[0]->stats.control_bytes += sent % gathers.size();
}

}  // namespace

template <typename F>
void CompressedAllgather::Impl::timed(std::span<Gather* const> gathers, F&& collective) {
  const auto t = std::chrono::steady_clock::now();
  collective();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  // A batched exchange serves every gather in it; each is charged the whole wait.
  for (Gather* g : gathers) g->stats.exchange_s += seconds;
}

// Waits for the gather's encoding and packs its envelope (once).
void CompressedAllgather::Impl::prepare(Gather& g) {
  if (g.packed || !g.local_error.empty()) return;
  BucketState& s = buckets[g.bucket];
  if (g.sends_raw) {
    // Nothing is encoded for a raw gather: if every rank sends raw, input goes straight to
    // output. The size announced is that of a raw envelope, built only if some peer compresses.
    g.envelope_bytes = raw_envelope_bytes(s.layout, rank);
    return;
  }
  try {
    g.encoding.wait();
  } catch (const std::exception& e) {
    g.local_error = std::string("encoding failed: ") + e.what();
    return;
  }
  g.stats.encode_s = g.encoding.seconds_since(g.started);
  g.envelope_bytes = pack(s, s.step, g.sends_raw);
  g.packed = true;
}

// After a control exchange: decides whether the gather goes direct (every rank raw) and, if
// this rank is raw but a peer compresses, builds the raw envelope it announced.
void CompressedAllgather::Impl::settle_mode(Gather& g) {
  g.direct = std::all_of(g.control.begin(), g.control.end(),
                         [](const ControlRecord& c) { return (c.flags & kRaw) != 0; });
  if (g.direct || g.packed || !g.sends_raw) return;
  BucketState& s = buckets[g.bucket];
  encode(g, s, true);
  g.encoding.wait();
  const uint64_t envelope = pack(s, g.control[rank].step, true);
  if (envelope != g.envelope_bytes)
    throw std::logic_error("raw envelope size differs from the announced size");
  g.packed = true;
}

ControlRecord CompressedAllgather::Impl::make_record(const Gather& g, uint32_t flags) const {
  const BucketState& s = buckets[g.bucket];
  ControlRecord r{};
  r.magic = kControlMagic;
  r.version = kEngineProtocolVersion;
  r.bucket = static_cast<uint32_t>(g.bucket);
  r.flags = flags | (s.cold ? uint32_t{kCold} : 0u) |
            (g.local_error.empty() ? 0u : uint32_t{kLocalError}) |
            (g.sends_raw ? uint32_t{kRaw} : 0u);
  r.step = s.step;
  r.envelope_bytes = g.local_error.empty() ? g.envelope_bytes : 0;
  r.policy_digest = policy_digest(s.layout);
  // Saturated to the field's u32 (a gather of more than 71 minutes reads as one of 71).
  r.previous_us = static_cast<uint32_t>(
      std::min<double>(std::numeric_limits<uint32_t>::max(), s.last_gather_s * 1e6));
  r.previous_compressed = s.last_compressed;
  write_text(r.error_text, kErrorTextBytes, g.local_error);
  return r;
}

// One allgather of every rank's records for `gathers`. Returns how many leading gathers all
// ranks have ready (each one's `control` is filled for those); throws if ranks disagree on what
// they gather.
size_t CompressedAllgather::Impl::exchange_controls(std::span<Gather* const> gathers,
                                                    uint32_t flags) {
  phase = flags & kKeyRound ? "control exchange of a key-frame round" : "control exchange";
  RoundControl mine{};
  mine.magic = kControlMagic;
  mine.count = static_cast<uint32_t>(gathers.size());
  for (size_t i = 0; i < gathers.size(); ++i) mine.records[i] = make_record(*gathers[i], flags);
  seal(mine);
  std::vector<RoundControl> all(static_cast<size_t>(world));
  timed(gathers, [&] { transport.allgather(&mine, sizeof mine, all.data()); });
  charge_control(gathers, sizeof mine, world);
  const size_t ready = gathers_ready(all);
  for (size_t i = 0; i < ready; ++i) {
    Gather& g = *gathers[i];
    g.control.resize(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) g.control[r] = all[r].records[i];
    try {
      const BucketState& s = buckets[g.bucket];
      check_records(g.control, g.bucket, s.layout, rank, s.max_envelope_bytes, g.local_error);
    } catch (const ConfigError&) {
      // A gather some rank rejected fails alone: gathers before it proceed, and it and those
      // after it wait for the next round, where it comes first and fails by itself.
      if (i == 0) throw;
      return i;
    }
  }
  return ready;
}

// A gather must be re-sent as key frames when some rank is cold, the ranks' step counts differ
// (a restarted rank), or this rank compressed a gather that the agreed step puts in raw warmup
// (delta and peer-scheme parameters aside, which skip it). (Ranks may otherwise send raw or compressed
// independently: each envelope says which.)
bool CompressedAllgather::Impl::needs_resync(const Gather& g) const {
  const uint64_t step = agreed_step(g.control);
  for (const ControlRecord& c : g.control) {
    if (c.step != step || (c.flags & kCold)) return true;
  }
  return warmup_raw(step) && !g.sends_raw && !buckets[g.bucket].skips_warmup;
}

// Every rank re-sends key frames (or raw bytes in warmup) for the agreed step, from its streams'
// next epochs, which every rank's decoders are told to expect; then the ranks exchange fresh
// control records for this gather alone.
void CompressedAllgather::Impl::resynchronise(Gather& g) {
  BucketState& s = buckets[g.bucket];
  const uint64_t step = agreed_step(g.control);
  g.stats.resynchronised = true;
  s.step = step;
  for (auto& e : s.encoders) {
    if (e) e->request_key_frame();
  }
  for (auto& peer : s.decoders) {
    for (auto& d : peer) {
      if (d) d->request_resync();
    }
  }
  g.packed = false;
  g.sends_raw = send_raw(s, step);
  if (!g.sends_raw) {
    const auto t = std::chrono::steady_clock::now();
    encode(g, s, false);
    g.encoding.wait();
    g.stats.encode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  prepare(g);
  Gather* one[] = {&g};
  exchange_controls(one, kKeyRound);
  settle_mode(g);
}

// Exchanges the envelopes of `gathers` (all in flight together) and decodes each gather as soon
// as its own exchange completes, overlapping the exchanges still in flight (paper §3.3).
void CompressedAllgather::Impl::exchange_and_decode(std::span<Gather* const> gathers) {
  std::vector<std::vector<uint64_t>> counts(gathers.size()), displs(gathers.size());
  std::vector<Transport::AllgathervCall> calls;
  for (size_t i = 0; i < gathers.size(); ++i) {
    Gather& g = *gathers[i];
    BucketState& s = buckets[g.bucket];
    g.step = agreed_step(g.control);
    uint64_t total = 0;
    for (int r = 0; r < world; ++r) {
      counts[i].push_back(g.control[r].envelope_bytes);
      displs[i].push_back(total);
      total += g.control[r].envelope_bytes;
    }
    if (g.direct) {
      // Every rank raw: the plain allgather of the inputs, exactly what MPI would do.
      for (int r = 0; r < world; ++r) {
        counts[i][r] = s.layout.rank_bytes(r);
        displs[i][r] = g.slot_offset(s.layout, r);
      }
      g.stats.wire_bytes += s.layout.total_bytes();
      g.stats.local_payload_bytes += s.layout.rank_bytes(rank);
      // As plain MPI would: one transfer. Raw gathers are chosen where links are fast and the
      // cores busy, and there extra channels only add per-message work.
      g.wait_for_input();
      calls.push_back({g.in, g.out, counts[i], displs[i], 1});
      continue;
    }
    // Added: a gather re-sent after a bad payload carries both exchanges' bytes.
    g.stats.wire_bytes += total;
    g.stats.local_payload_bytes += g.control[rank].envelope_bytes;
    calls.push_back(
        {s.send.data() + s.send_layout.envelope_offset, s.recv.data(), counts[i], displs[i]});
  }
  phase = "payload exchange";
  timed(gathers, [&] {
    transport.allgatherv_many(calls, [&](size_t i) {
      if (!gathers[i]->direct) start_decode(*gathers[i]);
    });
  });
  for (Gather* g : gathers) {
    if (g->direct) continue;
    g->decoding.wait();
    g->stats.decode_s += g->decoding.seconds_since(g->decode_started);
  }
}

// Returns, per gather, "" if every rank reconstructed it exactly, else the first failure in
// rank order, worded the same on every rank.
std::vector<std::string> CompressedAllgather::Impl::exchange_verdicts(
    std::span<Gather* const> gathers) {
  phase = "verdict exchange";
  RoundVerdicts mine{};
  for (size_t i = 0; i < gathers.size(); ++i) mine.verdicts[i] = gathers[i]->verdict;
  seal(mine);
  std::vector<RoundVerdicts> all(static_cast<size_t>(world));
  timed(gathers, [&] { transport.allgather(&mine, sizeof mine, all.data()); });
  charge_control(gathers, sizeof mine, world);
  check_sealed(all);
  std::vector<std::string> failures(gathers.size());
  for (size_t i = 0; i < gathers.size(); ++i) {
    failures[i] = failure_text(all, i, buckets[gathers[i]->bucket].layout.name);
  }
  return failures;
}

void CompressedAllgather::Impl::finish(Gather& g) {
  BucketState& s = buckets[g.bucket];
  // The slowest rank's time for the previous gather, as every rank reported it here.
  uint32_t slowest_us = 0;
  bool all_reported = true;
  bool same_mode = true;
  for (const ControlRecord& c : g.control) {
    slowest_us = std::max(slowest_us, c.previous_us);
    all_reported = all_reported && c.previous_us > 0;
    same_mode = same_mode && c.previous_compressed == g.control[0].previous_compressed;
  }
  if (config.adaptive && all_reported && same_mode && g.step > config.warmup_steps) {
    std::lock_guard lock(mutex);  // start() reads the switch on the caller's thread
    adaptive.record(g.bucket, g.control[0].previous_compressed != 0, slowest_us * 1e-6);
  }
  s.cold = false;
  s.reset_since_gather = false;
  s.step = g.step + 1;
  g.stats.step = g.step;
  g.stats.warmup = warmup_raw(g.step);
  g.stats.compressed = !g.sends_raw;
  g.stats.raw_bytes = s.layout.total_bytes();
  g.stats.total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - g.started).count();
  s.last_gather_s = g.stats.total_s;
  s.last_compressed = g.stats.compressed;
  {
    std::lock_guard lock(mutex);
    s.busy = false;
  }
  g.promise.set_value(g.stats);
}

// Processes `round` (gathers taken from the queue, in start order). Gathers that not every rank
// has ready yet go back to the front of the queue for the next round.
void CompressedAllgather::Impl::run_round(std::vector<std::shared_ptr<Gather>>& round) {
  std::vector<Gather*> gathers;
  for (auto& g : round) {
    prepare(*g);
    gathers.push_back(g.get());
  }
  size_t ready = 0;
  try {
    ready = exchange_controls(gathers, 0);
  } catch (const ConfigError&) {
    // The round's first gather was rejected (every rank sees the same records, so every rank
    // rejects it): it fails alone, and the gathers after it wait for the next round.
    std::lock_guard lock(mutex);
    for (size_t i = round.size(); i-- > 1;) queue.push_front(round[i]);
    round.resize(1);
    throw;
  }
  // The round ends before the first gather that must resynchronise (unless that is the first,
  // which then goes alone) or that failed locally (check_records threw already in that case).
  for (size_t i = 0; i < ready; ++i) {
    if (needs_resync(*gathers[i])) {
      ready = i == 0 ? 1 : i;
      break;
    }
  }
  {
    std::lock_guard lock(mutex);
    for (size_t i = round.size(); i-- > ready;) queue.push_front(round[i]);
  }
  round.resize(ready);
  gathers.resize(ready);
  if (needs_resync(*gathers[0])) {
    resynchronise(*gathers[0]);
  } else {
    settle_mode(*gathers[0]);
  }
  for (size_t i = 1; i < gathers.size(); ++i) settle_mode(*gathers[i]);

  exchange_and_decode(gathers);
  // Direct gathers cannot fail to decode; only enveloped ones need a verdict (every rank knows
  // which are which from the control records).
  std::vector<Gather*> enveloped;
  for (Gather* g : gathers) {
    if (!g->direct) enveloped.push_back(g);
  }
  const std::vector<std::string> failures =
      enveloped.empty() ? std::vector<std::string>{} : exchange_verdicts(enveloped);
  for (size_t i = 0; i < enveloped.size(); ++i) {
    if (failures[i].empty()) continue;
    // Every rank re-sends this gather as key frames, once; a second failure fails it everywhere.
    Gather* one[] = {enveloped[i]};
    resynchronise(*enveloped[i]);
    exchange_and_decode(one);
    const std::string again = exchange_verdicts(one)[0];
    if (!again.empty()) throw CommError(again + " (again after a key-frame round)");
  }
  for (Gather* g : gathers) finish(*g);
}

// Every gather of the round fails the same way. After a CommError the transport may be left
// mid-collective (a peer gone, or in another collective than this rank's), so every later gather
// fails too, saying so and naming the first failure.
void CompressedAllgather::Impl::fail_round(std::vector<std::shared_ptr<Gather>>& round,
                                           std::exception_ptr error) {
  using Failure = Gather::Failure;
  Failure failure = Failure::kOther;
  std::string text = "unknown error";
  try {
    std::rethrow_exception(error);
  } catch (const CommError& e) {
    if (broken.empty()) broken = e.what();
    failure = Failure::kComm;
    text = e.what();
  } catch (const ConfigError& e) {
    failure = Failure::kConfig;
    text = e.what();
  } catch (const FormatError& e) {
    failure = Failure::kFormat;
    text = e.what();
  } catch (const std::invalid_argument& e) {
    failure = Failure::kInvalidArgument;
    text = e.what();
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
  }
  for (auto& g : round) {
    // The round has already failed with `error`; an encoding that also failed (it was the
    // cause, or saw the same broken state) adds nothing the gathers' callers could act on.
    g->encoding.settle();
    {
      std::lock_guard lock(mutex);
      BucketState& s = buckets[g->bucket];
      s.busy = false;
      // Peers may have advanced their codec state; resynchronise next time rather than find
      // out through a failed decode.
      s.cold = true;
    }
    g->failure = failure;
    g->failure_text = text;
    g->promise.set_value(g->stats);
  }
}

void CompressedAllgather::Impl::comm_loop() {
  for (;;) {
    std::vector<std::shared_ptr<Gather>> round;
    {
      std::unique_lock lock(mutex);
      wake.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;
      round.push_back(queue.front());
      queue.pop_front();
    }
    // Gathers already started join the round, and their encoding is waited for: encoding takes
    // milliseconds where a round of exchanges costs at least a network round trip, and one
    // batched round keeps every link busy (paper §3.3: encoding overlaps communication; only
    // decoding is on the critical path).
    {
      std::lock_guard lock(mutex);
      while (round.size() < kMaxRoundGathers && !queue.empty()) {
        round.push_back(queue.front());
        queue.pop_front();
      }
    }
    try {
      // `broken` is the communication thread's alone (written in fail_round, read here).
      if (!broken.empty()) {
        throw CommError("this engine gathers no more since an earlier gather failed (make a new " +
                        std::string("engine and transport): ") + broken);
      }
      run_round(round);
    } catch (const CommError& e) {
      // Name what this rank was waiting for: the first gather of the round and the exchange.
      const Gather& first = *round.front();
      const BucketState& s = buckets[first.bucket];
      // Counted from 1 and called a gather: a training step (in the caller's message beside
      // this one) is another count.
      const std::string text = broken.empty()
                                   ? "the " + ordinal(s.step + 1) + " gather of bucket '" +
                                         s.layout.name + "' (" + phase + "): " + e.what()
                                   : std::string(e.what());
      fail_round(round, std::make_exception_ptr(CommError(text)));
    } catch (...) {
      fail_round(round, std::current_exception());
    }
  }
}

}  // namespace ciera
