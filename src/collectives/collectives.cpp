// One call of a lossless collective, on every rank (docs/format.md, "Lossless collectives"). The
// parts move in rounds, slice k of every part in round k (collectives::slice_of: short first and
// last slices, since only their coding and decoding are not hidden); for each round:
//   1. code the slice for each peer (or keep it raw) into send region k % kRegions;
//   2. exchange call records (allgather) and check them: same call everywhere, sizes that match;
//   3. alltoallv of the slices as sent, into receive region k % kRegions, started
//      (Transport::start_alltoallv) behind round k - 1's while that one still moves;
//   4. decode the peers' slices, then (reduce-scatter) add them in rank order (reduction.hpp).
// A worker codes the rounds ahead and decodes the rounds behind while the caller's thread runs
// the exchanges, so only the first coding and the last decoding are not hidden behind the
// transport, and a round whose coding runs late (the worker shares its core) is absorbed by the
// rounds queued ahead instead of holding up that round's exchange.
// The worker runs at a lower priority (worker_niceness); a task it has not started when the
// caller needs it, the caller runs itself (ThreadPool::wait), so a starved worker never holds a
// round up. After the last round the ranks exchange verdicts (allgather), so a slice that did not
// decode is an error on every rank, not a wrong result on one; a reduce-scatter's result reaches
// its output only then.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/collectives.hpp"
#include "ciera/error.hpp"
#include "collectives/call_record.hpp"
#include "collectives/reduction.hpp"
#include "collectives/slice_coding.hpp"
#include "common/adaptive_switch.hpp"
#include "common/bytes.hpp"
#include "common/checked.hpp"
#include "common/moved_from.hpp"
#include "common/one_caller.hpp"
#include "common/poll.hpp"
#include "common/thread_pool.hpp"

namespace ciera {

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

std::string_view collective_coding_name(CollectiveCoding coding) {
  switch (coding) {
    case CollectiveCoding::kRaw:
      return "raw";
    case CollectiveCoding::kExponent:
      return "exponent";
    case CollectiveCoding::kAuto:
      return "auto";
  }
  return "?";
}

CollectiveCoding parse_collective_coding(std::string_view name) {
  for (auto c : {CollectiveCoding::kRaw, CollectiveCoding::kExponent, CollectiveCoding::kAuto}) {
    if (name == collective_coding_name(c)) return c;
  }
  throw ConfigError("collective coding must be raw, exponent or auto, got '" + std::string(name) +
                    "'");
}

void CollectivesConfig::validate() const {
  if (coding != CollectiveCoding::kRaw && coding != CollectiveCoding::kExponent &&
      coding != CollectiveCoding::kAuto) {
    throw ConfigError("CollectivesConfig.coding: unknown value " +
                      std::to_string(static_cast<int>(coding)));
  }
  if (slice_values == 0) throw ConfigError("CollectivesConfig.slice_values must be at least 1");
  if (frame_values == 0) throw ConfigError("CollectivesConfig.frame_values must be at least 1");
  // Here, at construction, not at the first call's bound on one rank (its peers would wait).
  if (frame_values > kMaxShardValues) {
    throw ConfigError(
        "CollectivesConfig.frame_values must be at most 2^48 (a frame is a shard of "
        "the codec), got " +
        std::to_string(frame_values));
  }
  if (worker_threads > kMaxWorkerThreads) {
    throw ConfigError("CollectivesConfig.worker_threads must be at most " +
                      std::to_string(kMaxWorkerThreads) + ", got " +
                      std::to_string(worker_threads));
  }
  if (worker_niceness < 0 || worker_niceness > 19) {
    throw ConfigError(
        "CollectivesConfig.worker_niceness must be 0..19 (a nice value; 19 is the lowest "
        "priority), got " +
        std::to_string(worker_niceness));
  }
  CodecConfig codec;
  codec.block_values = block_values;
  try {
    codec.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("CollectivesConfig.") + e.what());
  }
}

using collectives::CallKind;
using collectives::CallRecord;
using collectives::Verdict;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Grows `buffer` to at least `bytes` (never shrinks: steady-state calls do not allocate).
std::byte* room(std::vector<std::byte>& buffer, uint64_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// Bytes each rank sends and receives over the rounds of one call (CollectiveStats::busiest_link_*).
struct LinkLoad {
  std::vector<uint64_t> sent, received;  // per rank

  void reset(int world) {
    sent.assign(static_cast<size_t>(world), 0);
    received.assign(static_cast<size_t>(world), 0);
  }
  void add(size_t from, size_t to, uint64_t bytes) {
    if (from == to) return;  // a rank's own part stays on it
    sent[from] += bytes;
    received[to] += bytes;
  }
  uint64_t busiest() const {
    uint64_t most = 0;
    for (const auto* side : {&sent, &received})
      for (uint64_t bytes : *side) most = std::max(most, bytes);
    return most;
  }
};

std::vector<uint64_t> offsets_of(std::span<const uint64_t> sizes) {
  std::vector<uint64_t> offsets(sizes.size());
  std::exclusive_scan(sizes.begin(), sizes.end(), offsets.begin(), uint64_t{0});
  return offsets;
}

}  // namespace

// One collective call as the rounds see it.
struct Call {
  CallKind kind;
  DType dtype;
  ReduceOp op;
  const std::byte* in;                    // the parts for each peer, back to back in rank order
  std::span<const uint64_t> send_values;  // per peer
  std::span<const uint64_t> recv_values;  // per peer
  bool compress;
  // Where peer p's slice of round k is decoded to.
  std::function<std::byte*(size_t p, uint32_t k)> destination;
  // Round k is complete: `slices[p]` is peer p's slice (this rank's own in `in`).
  std::function<void(uint32_t k, std::span<const std::byte* const> slices)> on_round;
};

// Rounds in flight: round k codes into send region k % kRegions and is received into receive
// region k % kRegions. Two rounds' exchanges may be in flight at once, so the worker may code
// kRegions - 2 rounds ahead of them and decode the rounds behind.
constexpr uint32_t kRegions = 4;

struct LosslessCollectives::Impl {
  explicit Impl(const CollectivesConfig& c) : pool(c.worker_threads, c.worker_niceness) {}

  std::shared_ptr<Transport> transport;
  std::optional<Transport::User> user;  // given back once everything below has stopped
  CollectivesConfig config;
  int rank = 0, world = 1;
  uint64_t sequence = 0;
  std::atomic<const char*> in_call{nullptr};  // the call in flight (OneCaller)
  // The adaptive switch (kAuto), keyed by call shape: one per (kind, dtype, bytes) seen.
  AdaptiveSwitch adaptive;
  std::map<std::tuple<CallKind, DType, uint64_t>, std::pair<size_t, uint64_t>>
      shapes;  // -> (key, calls)
  ThreadPool pool;
  // Round k in region k % kRegions; grown to the largest call, then reused.
  std::vector<std::byte> send[kRegions], recv[kRegions];
  // Per peer, of the slices in send[k % kRegions].
  std::vector<uint64_t> sent_bytes[kRegions], send_at[kRegions];
  std::vector<std::byte> decoded, reduced, records, verdicts;
  LinkLoad wire_links;  // this call's, from every round's records
  // Tasks of different rounds may run at once (the worker's and the caller's, ThreadPool::wait):
  // what they add to the call's stats and verdict, they add under this lock.
  std::mutex tally;
  Verdict verdict;  // this rank's; on failures in several rounds, the earliest round's
  uint32_t failed_round = 0;
  double slowest_s = 0;  // the slowest rank's time for the current call, from the verdicts
  double encode_s = 0, decode_s = 0, reduce_s = 0;  // this call's, summed over rounds
  uint64_t control_bytes = 0;  // this call's records and verdict (CollectiveStats::control_bytes)

  CodecConfig codec(DType dtype) const {
    CodecConfig c;
    c.dtype = dtype;
    c.block_values = config.block_values;
    c.content_checksum = config.content_checksum;
    return c;
  }

  // Whether this call codes its parts, and the switch's slot for its shape.
  std::pair<bool, std::pair<size_t, uint64_t>*> decide(CallKind kind, DType dtype, uint64_t bytes) {
    if (config.coding != CollectiveCoding::kAuto)
      return {config.coding == CollectiveCoding::kExponent, nullptr};
    auto [it, fresh] =
        shapes.try_emplace({kind, dtype, bytes}, std::pair<size_t, uint64_t>{shapes.size(), 0});
    return {adaptive.compress(it->second.second), &it->second};
  }

  collectives::Slice slice(uint64_t values, uint32_t k) const {
    return collectives::slice_of(values, k, config.slice_values);
  }

  // Codes (or copies) round k's slice of each part for a peer into send[k % kRegions], back to
  // back in rank order (so that transports taking split sizes, as torch's all_to_all_single, need
  // no copy). This rank's own part is never sent.
  void code_round(const Call& call, std::span<const uint64_t> in_at, uint32_t k,
                  CollectiveStats& call_stats) {
    const auto start = Clock::now();
    CollectiveStats stats;  // this round's, added to the call's at the end
    const uint32_t value_bytes = dtype_info(call.dtype).value_bytes;
    const CodecConfig c = codec(call.dtype);
    const size_t region = k % kRegions;
    uint64_t room_needed = 0;
    for (size_t p = 0; p < call.send_values.size(); ++p) {
      const uint64_t m = slice(call.send_values[p], k).values;
      room_needed += call.compress
                         ? std::max<uint64_t>(m * value_bytes, collectives::coded_slice_bound(
                                                                   c, m, config.frame_values))
                         : m * value_bytes;
    }
    room(send[region], room_needed);
    sent_bytes[region].assign(call.send_values.size(), 0);
    send_at[region].assign(call.send_values.size(), 0);
    uint64_t at = 0;
    for (size_t p = 0; p < call.send_values.size(); ++p) {
      send_at[region][p] = at;
      const auto [begin, m] = slice(call.send_values[p], k);
      if (static_cast<int>(p) == rank || m == 0) continue;
      const uint64_t raw = m * value_bytes;
      const std::byte* part = call.in + (in_at[p] + begin) * value_bytes;
      std::byte* out = send[region].data() + at;
      FrameStats frame;
      frame.payload_bytes = raw;
      if (call.compress) {
        const uint64_t bound =
            std::max<uint64_t>(raw, collectives::coded_slice_bound(c, m, config.frame_values));
        frame = collectives::encode_slice(c, config.frame_values, {part, raw}, {out, bound});
      }
      if (frame.payload_bytes >= raw) {  // not smaller: raw, and the receiver tells by the size
        std::memcpy(out, part, raw);
        sent_bytes[region][p] = raw;
      } else {
        sent_bytes[region][p] = frame.payload_bytes;
        ++stats.coded_slices;
        stats.coded_values += m;
        stats.coded_exponent_bytes += frame.payload_bytes - frame.sign_mantissa_bytes;
        stats.exponent_entropy_bits += frame.coded_symbols_entropy_bits;
      }
      stats.raw_bytes += raw;
      stats.wire_bytes += sent_bytes[region][p];
      at += sent_bytes[region][p];
    }
    std::lock_guard lock(tally);
    call_stats.coded_slices += stats.coded_slices;
    call_stats.coded_values += stats.coded_values;
    call_stats.coded_exponent_bytes += stats.coded_exponent_bytes;
    call_stats.exponent_entropy_bits += stats.exponent_entropy_bits;
    call_stats.raw_bytes += stats.raw_bytes;
    call_stats.wire_bytes += stats.wire_bytes;
    encode_s += seconds_since(start);
  }

  // Arguments this rank refuses still take part in the record exchange, so that its peers fail
  // at once with an error naming it instead of waiting for it until the timeout.
  // Its peers, seeing the refusal in its record, then exchange the reasons with it (one more
  // allgather, only on this path), so that each of them names the reason too.
  [[noreturn]] void reject(CallKind kind, DType dtype, const std::string& problem) {
    const std::vector<uint64_t> none(static_cast<size_t>(world), 0);
    share_record({kind, dtype, ReduceOp::kSum, true, sequence, 0, config.slice_values, none, none,
                  none, config.block_values, config.content_checksum});
    exchange_refusals(problem);
    throw ConfigError(problem);
  }

  // Every rank's reason for refusing the call ("" for a rank that did not), in the verdict
  // record's layout: the ranks call this once any record of the call says it was refused.
  std::vector<std::string> exchange_refusals(const std::string& mine) {
    const size_t bytes = collectives::verdict_bytes();
    std::vector<std::byte> own(bytes);
    collectives::write_verdict({mine.empty(), 0, mine}, own);
    allgather_control(own, verdicts);
    std::vector<std::string> reasons;
    for (int r = 0; r < world; ++r) {
      reasons.push_back(
          collectives::read_verdict({verdicts.data() + bytes * static_cast<size_t>(r), bytes}, r)
              .message);
    }
    return reasons;
  }

  // A call's dtype and op, before anything reads them: a record carries only known codes, so a
  // bad one is refused through reject() (with a placeholder dtype), not sent to the peers, who
  // would blame the record's sender, nor thrown here alone, which would leave them waiting.
  void check_codes(CallKind kind, DType dtype, ReduceOp op, const char* call) {
    if (!is_valid_dtype_code(static_cast<uint8_t>(dtype))) {
      reject(kind, DType::kBF16,
             std::string(call) + ": unknown dtype code " +
                 std::to_string(static_cast<int>(static_cast<uint8_t>(dtype))));
    }
    if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
      reject(kind, dtype,
             std::string(call) + ": unknown reduce op code " +
                 std::to_string(static_cast<int>(static_cast<uint8_t>(op))) + " (sum or avg)");
    }
  }

  // Every record and verdict this rank sends goes through here, so that control_bytes counts
  // each once: what the allgather takes from this rank, however many peers it reaches.
  void allgather_control(std::span<const std::byte> own, std::vector<std::byte>& all) {
    room(all, own.size() * static_cast<size_t>(world));
    transport->allgather(own.data(), own.size(), all.data());
    control_bytes += own.size();
  }

  void share_record(const CallRecord& mine) {
    std::vector<std::byte> own(collectives::call_record_bytes(world));
    collectives::write_call_record(mine, own);
    allgather_control(own, records);
  }

  // Every rank's record of round k; throws on every rank if they disagree.
  std::vector<CallRecord> exchange_records(const Call& call, uint32_t k) {
    const CallRecord mine{call.kind,
                          call.dtype,
                          call.op,
                          false,
                          sequence,
                          k,
                          config.slice_values,
                          {call.send_values.begin(), call.send_values.end()},
                          sent_bytes[k % kRegions],
                          {call.recv_values.begin(), call.recv_values.end()},
                          config.block_values,
                          config.content_checksum};
    share_record(mine);
    std::vector<CallRecord> all = read_records();
    if (refused_or_passed(all)) disagree(all, "");
    collectives::check_agreement(all);
    return all;
  }

  // Every rank's record, from the last share_record().
  std::vector<CallRecord> read_records() const {
    const size_t bytes = collectives::call_record_bytes(world);
    std::vector<CallRecord> all;
    for (int r = 0; r < world; ++r) {
      all.push_back(collectives::read_call_record(
          {records.data() + bytes * static_cast<size_t>(r), bytes}, world, r));
    }
    return all;
  }

  static bool refused_or_passed(std::span<const CallRecord> all) {
    return std::any_of(all.begin(), all.end(),
                       [](const CallRecord& r) { return r.rejected || r.passes_through; });
  }

  // Some rank refused the call, or ranks differ in passing it through: every rank (each sees the
  // same records) exchanges its reason (`mine`, "" for a rank that runs the call) and throws the
  // same text, naming the first refusing rank, else the ranks on each side of the pass-through.
  [[noreturn]] void disagree(std::span<const CallRecord> all, const std::string& mine) {
    const std::vector<std::string> reasons = exchange_refusals(mine);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].rejected) throw ConfigError(collectives::refusal_text(all, r, reasons[r]));
    }
    throw ConfigError(collectives::pass_through_text(all, reasons));
  }

  // A pass-through is decided per rank by the caller (whose own reduce-scatter then runs), so the
  // ranks must agree on it: it rides in the call record every call exchanges first, flagged, so a
  // call that every rank runs costs nothing more, and a pass-through costs one record exchange
  // (the reasons, only where ranks differ). A rank that passed through alone would otherwise sit
  // in its caller's collective while its peers wait in this one's: both until their timeouts.
  void pass_through(CallKind kind, const std::string& reason) {
    const std::vector<uint64_t> none(static_cast<size_t>(world), 0);
    share_record({kind, DType::kBF16, ReduceOp::kSum, false, sequence, 0, config.slice_values, none,
                  none, none, config.block_values, config.content_checksum,
                  /*passes_through=*/true});
    const std::vector<CallRecord> all = read_records();
    const bool all_pass =
        std::all_of(all.begin(), all.end(), [](const CallRecord& r) { return r.passes_through; });
    if (!all_pass) disagree(all, reason.empty() ? "passed through by its caller" : reason);
    collectives::check_agreement(all);
    ++sequence;  // a call every rank made, as one that ran here
  }

  // Round k's slices as sent, from send[k % kRegions] into recv[k % kRegions], rank order:
  // started, finished by the caller (Transport::start_alltoallv). Sets where each peer's slice
  // starts there.
  std::unique_ptr<Transport::PendingExchange> start_slices(std::span<const CallRecord> all,
                                                           uint32_t k,
                                                           std::vector<uint64_t>& recv_at) {
    const auto me = static_cast<size_t>(rank);
    const size_t region = k % kRegions;
    std::vector<uint64_t> recv_counts(static_cast<size_t>(world));
    for (size_t p = 0; p < recv_counts.size(); ++p) recv_counts[p] = all[p].part_bytes[me];
    for (size_t from = 0; from < all.size(); ++from) {
      for (size_t to = 0; to < all.size(); ++to) wire_links.add(from, to, all[from].part_bytes[to]);
    }
    recv_at = offsets_of(recv_counts);
    room(recv[region], recv_at.back() + recv_counts.back());
    return transport->start_alltoallv(send[region].data(), sent_bytes[region], send_at[region],
                                      recv[region].data(), recv_counts, recv_at);
  }

  // Decodes round k's slices (raw ones stay where they arrived), then hands them to on_round.
  // A round that starts after an earlier round failed to decode is skipped (one already under
  // way finishes); the verdict names the earliest round that failed, whatever order they ran in.
  void decode_round(const Call& call, std::span<const uint64_t> in_at, uint32_t k,
                    const std::vector<CallRecord>& all, const std::vector<uint64_t>& recv_at) {
    {
      std::lock_guard lock(tally);
      if (!verdict.ok && failed_round < k) return;
    }
    const auto start = Clock::now();
    const uint32_t value_bytes = dtype_info(call.dtype).value_bytes;
    const CodecConfig c = codec(call.dtype);
    std::vector<const std::byte*> slices(static_cast<size_t>(world));
    for (size_t p = 0; p < static_cast<size_t>(world); ++p) {
      if (static_cast<int>(p) == rank) {  // its own part, as sent to itself
        slices[p] = call.in + (in_at[p] + slice(call.send_values[p], k).begin) * value_bytes;
        continue;
      }
      const uint64_t raw = slice(call.recv_values[p], k).values * value_bytes;
      const uint64_t sent = all[p].part_bytes[static_cast<size_t>(rank)];
      slices[p] = recv[k % kRegions].data() + recv_at[p];
      if (sent == raw) continue;
      std::byte* to = call.destination(p, k);
      try {
        collectives::decode_slice(c, {slices[p], sent}, {to, raw});
      } catch (const Error& e) {
        std::lock_guard lock(tally);
        if (verdict.ok || k < failed_round) {
          verdict.ok = false;
          failed_round = k;
          verdict.message = "rank " + std::to_string(rank) +
                            " could not decode the part from rank " + std::to_string(p) +
                            " (round " + std::to_string(k) + "): " + e.what();
        }
        decode_s += seconds_since(start);
        return;
      }
      slices[p] = to;
    }
    const double seconds = seconds_since(start);
    call.on_round(k, slices);
    std::lock_guard lock(tally);
    decode_s += seconds;
  }

  // The call's number of rounds, from every rank's record of round 0 (`all`; every rank sees the
  // same, so every rank runs as many), and the busiest link's raw bytes into `stats`.
  uint32_t rounds_agreed(std::span<const CallRecord> all, DType dtype,
                         CollectiveStats& stats) const {
    uint64_t longest = 0;
    const uint32_t value_bytes = dtype_info(dtype).value_bytes;
    LinkLoad raw_links;
    raw_links.reset(world);
    for (size_t from = 0; from < all.size(); ++from) {
      const std::vector<uint64_t>& values = all[from].part_values;
      longest = std::max(longest, *std::max_element(values.begin(), values.end()));
      for (size_t to = 0; to < values.size(); ++to)
        raw_links.add(from, to, values[to] * value_bytes);
    }
    stats.busiest_link_raw_bytes = raw_links.busiest();
    const uint64_t rounds = collectives::rounds_of(longest, config.slice_values);
    if (rounds > UINT32_MAX) {
      throw ConfigError("lossless collectives: a part of " + std::to_string(longest) +
                        " values in slices of " + std::to_string(config.slice_values) +
                        " takes more than 2^32 rounds (raise CollectivesConfig.slice_values)");
    }
    return static_cast<uint32_t>(rounds);
  }

  // The rounds of one call (see the top of this file), then the verdicts. Throws on every rank
  // if any rank could not decode a slice.
  void run(const Call& call, CollectiveStats& stats) {
    const auto start = Clock::now();
    encode_s = decode_s = reduce_s = 0;
    control_bytes = 0;
    wire_links.reset(world);
    verdict = Verdict{};
    failed_round = 0;
    const std::vector<uint64_t> in_at = offsets_of(call.send_values);
    // Round k's tasks are in coding[k % kRegions] and decoding[k % kRegions]; the worker takes
    // them in the order submitted, so a round's decoding goes before the codings queued after it.
    TaskGroup coding[kRegions], decoding[kRegions];
    auto code = [&](uint32_t k) {
      pool.submit(coding[k % kRegions], [&, k] { code_round(call, in_at, k, stats); });
    };
    double exchange_s = 0;
    try {
      // The worker starts on the rounds after round 0 while this thread codes round 0 and waits
      // for the last rank to enter: so many of them as this rank's own parts take (each is a
      // round of the call, whose longest part is at least as long), up to kRegions - 1. A rank
      // that enters early enters with them coded, and the last one codes rounds 0 and 1 at once.
      const uint64_t own_longest =
          call.send_values.empty()
              ? 0
              : *std::max_element(call.send_values.begin(), call.send_values.end());
      const auto ahead = static_cast<uint32_t>(
          std::min<uint64_t>(collectives::rounds_of(own_longest, config.slice_values), kRegions));
      for (uint32_t k = 1; k < ahead; ++k) code(k);
      code_round(call, in_at, 0, stats);
      auto exchange_start = Clock::now();
      std::vector<CallRecord> all = exchange_records(call, 0);
      stats.arrival_wait_s = seconds_since(exchange_start);
      const uint32_t count = rounds_agreed(all, call.dtype, stats);
      for (uint32_t k = std::max(ahead, 1u); k < std::min(count, kRegions); ++k) code(k);
      // Round k's exchange in flight, and from the second round on round k + 1's behind it:
      // started as soon as its record is agreed, so that a rank whose round k ends early sends
      // on instead of waiting for the slowest rank to finish that round (each round would
      // otherwise leave the links idle for the spread of its ends plus the record exchange).
      struct Round {
        std::vector<CallRecord> all;
        std::vector<uint64_t> recv_at;
        std::unique_ptr<Transport::PendingExchange> exchange;
      };
      Round current{std::move(all), {}, nullptr}, next;
      if (count > 0) current.exchange = start_slices(current.all, 0, current.recv_at);
      exchange_s += seconds_since(exchange_start);  // round 0's record and start
      // Starts round k + 1's exchange: its record agreed, its receive region free.
      auto start_next = [&](uint32_t k) {
        const size_t region = (k + 1) % kRegions;
        pool.wait(coding[region]);  // round k + 1's sizes go into its record
        exchange_start = Clock::now();
        next.all = exchange_records(call, k + 1);
        // Round k + 1 - kRegions decoded: its receive region is round k + 1's. Not timed as
        // exchange: the wait may decode and reduce on this thread (decode_s and reduce_s).
        if (k + 1 >= kRegions) {
          exchange_s += seconds_since(exchange_start);
          pool.wait(decoding[region]);
          exchange_start = Clock::now();
        }
        next.exchange = start_slices(next.all, k + 1, next.recv_at);
        exchange_s += seconds_since(exchange_start);
      };
      for (uint32_t k = 0; k < count; ++k) {
        // Round k + 1 goes in behind round k as soon as it is coded, or after round k if round
        // k ends first (ranks may choose differently: every rank starts the exchanges in the
        // same order, and a start does not wait for the peers).
        // exchange_s: this thread's wait for the exchange, without what start_next() counts
        // itself or the coding coded_first() ran here (encode_s has it): counted twice, the
        // exchange time came out above the whole call's.
        auto x0 = Clock::now();
        double coded_here_s = 0;
        const bool behind = k + 1 < count && coded_first(*current.exchange,
                                                         coding[(k + 1) % kRegions], coded_here_s);
        if (behind) {
          exchange_s += seconds_since(x0) - coded_here_s;
          coded_here_s = 0;
          start_next(k);
          x0 = Clock::now();
        }
        current.exchange->finish();
        exchange_s += seconds_since(x0) - coded_here_s;
        pool.submit(decoding[k % kRegions],
                    [&, k, all = std::move(current.all), recv_at = std::move(current.recv_at)] {
                      decode_round(call, in_at, k, all, recv_at);
                    });
        if (k + kRegions < count) code(k + kRegions);  // into the send region round k freed
        if (!behind && k + 1 < count) start_next(k);
        current = std::move(next);
        next = Round{};
      }
      for (TaskGroup& group : decoding) pool.wait(group);
    } catch (...) {
      // The tasks use this call's buffers: let them finish before the error leaves.
      for (size_t r = 0; r < kRegions; ++r) {
        pool.settle(coding[r]);
        pool.settle(decoding[r]);
      }
      throw;
    }
    stats.compressed = call.compress;
    stats.busiest_link_wire_bytes = wire_links.busiest();
    stats.encode_s = encode_s;
    stats.exchange_s = exchange_s;
    stats.reduce_s = reduce_s;
    const auto verdict_start = Clock::now();
    exchange_verdicts(seconds_since(start));
    stats.decode_s = decode_s + seconds_since(verdict_start);
    stats.control_bytes = control_bytes;
  }

  // Waits until the round in `next` is coded (true) or `exchange` has completed (false),
  // whichever comes first, so that the next round's exchange starts behind this one's while its
  // bytes still move, not once they have (deciding once, when this round started, left the
  // links idle between rounds whenever the coding ended a little later: docs/benchmarks.md,
  // "The next round as soon as it is coded"). A coding no worker has started yet, this thread
  // runs itself: the transport moves the bytes meanwhile (Open MPI's TCP progress thread,
  // ciera::mpi_init).
  // `coded_here_s` gets the seconds this thread spent coding.
  bool coded_first(Transport::PendingExchange& exchange, TaskGroup& next, double& coded_here_s) {
    bool coded = false;
    poll_until(
        [&] {
          const auto ran = Clock::now();
          pool.run_queued(next);
          coded_here_s += seconds_since(ran);
          if (next.done()) return coded = true;
          return exchange.test();
        },
        std::chrono::milliseconds(0));
    return coded;
  }

  // Every rank's verdict; a rank that could not decode a slice makes every rank throw.
  void exchange_verdicts(double elapsed_s) {
    verdict.seconds = elapsed_s;
    const size_t bytes = collectives::verdict_bytes();
    std::vector<std::byte> own(bytes);
    collectives::write_verdict(verdict, own);
    allgather_control(own, verdicts);
    slowest_s = 0;
    for (int r = 0; r < world; ++r) {
      const Verdict v =
          collectives::read_verdict({verdicts.data() + bytes * static_cast<size_t>(r), bytes}, r);
      if (!v.ok) {
        throw FormatError("lossless collectives, call " + std::to_string(sequence) + ": " +
                          v.message);
      }
      slowest_s = std::max(slowest_s, v.seconds);
    }
  }

  void record_time(std::pair<size_t, uint64_t>* shape, bool compressed) {
    if (shape == nullptr) return;
    adaptive.record(shape->first, compressed, slowest_s);
    ++shape->second;
  }
};

LosslessCollectives::LosslessCollectives(std::shared_ptr<Transport> transport,
                                         CollectivesConfig config) {
  if (!transport) throw ConfigError("LosslessCollectives: no transport");
  config.validate();
  impl_ = std::make_unique<Impl>(config);
  impl_->transport = std::move(transport);
  impl_->user.emplace(*impl_->transport, "LosslessCollectives", /*exclusive=*/false);
  impl_->config = config;
  impl_->rank = impl_->transport->rank();
  impl_->world = impl_->transport->size();
}
LosslessCollectives::~LosslessCollectives() = default;
LosslessCollectives::Impl& LosslessCollectives::state() const {
  return live_state(impl_, "LosslessCollectives");
}
LosslessCollectives::LosslessCollectives(LosslessCollectives&&) noexcept = default;
LosslessCollectives& LosslessCollectives::operator=(LosslessCollectives&&) noexcept = default;

const CollectivesConfig& LosslessCollectives::config() const { return state().config; }
int LosslessCollectives::rank() const { return state().rank; }
int LosslessCollectives::size() const { return state().world; }

void LosslessCollectives::refuse_reduce_scatter(const std::string& reason) {
  Impl& m = state();
  const OneCaller one(m.in_call, "LosslessCollectives", "reduce_scatter");
  m.reject(CallKind::kReduceScatter, DType::kBF16,
           reason.empty() ? "reduce_scatter: refused by its caller" : reason);
}

void LosslessCollectives::refuse_alltoallv(const std::string& reason) {
  Impl& m = state();
  const OneCaller one(m.in_call, "LosslessCollectives", "alltoallv");
  m.reject(CallKind::kAlltoallv, DType::kBF16,
           reason.empty() ? "alltoallv: refused by its caller" : reason);
}

void LosslessCollectives::pass_through_reduce_scatter(const std::string& reason) {
  Impl& m = state();
  const OneCaller one(m.in_call, "LosslessCollectives", "reduce_scatter");
  m.pass_through(CallKind::kReduceScatter, reason);
}

CollectiveStats LosslessCollectives::reduce_scatter(DType dtype, ReduceOp op,
                                                    std::span<const std::byte> in,
                                                    std::span<std::byte> out) {
  Impl& m = state();
  const OneCaller one(m.in_call, "LosslessCollectives", "reduce_scatter");
  m.check_codes(CallKind::kReduceScatter, dtype, op, "reduce_scatter");
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  const auto world = static_cast<size_t>(m.world);
  if (out.size() % value_bytes != 0 || in.size() != out.size() * world) {
    m.reject(CallKind::kReduceScatter, dtype,
             "reduce_scatter: the input must be " + std::to_string(world) +
                 " parts of the output's " + std::to_string(out.size()) + " bytes (whole " +
                 std::string(dtype_name(dtype)) + " values), got " + std::to_string(in.size()) +
                 " bytes");
  }
  const uint64_t values = out.size() / value_bytes;
  const uint64_t slice_bytes = std::min<uint64_t>(values, m.config.slice_values) * value_bytes;
  const std::vector<uint64_t> per_peer(world, values);
  auto [compress, shape] = m.decide(CallKind::kReduceScatter, dtype, in.size());
  // Each round's coded slices are decoded into its region of `decoded` (one slice per peer), and
  // the round's sums go to `reduced`: the output is written only once every rank has decoded
  // everything.
  room(m.decoded, slice_bytes * world * kRegions);
  room(m.reduced, out.size());
  const Call call{CallKind::kReduceScatter,
                  dtype,
                  op,
                  in.data(),
                  per_peer,
                  per_peer,
                  compress,
                  [&](size_t p, uint32_t k) {
                    return m.decoded.data() + ((k % kRegions) * world + p) * slice_bytes;
                  },
                  [&](uint32_t k, std::span<const std::byte* const> slices) {
                    const auto start = Clock::now();
                    const auto [first, count] = m.slice(values, k);
                    collectives::reduce_in_rank_order(
                        dtype, op, slices, m.reduced.data() + first * value_bytes, count);
                    const double seconds = seconds_since(start);
                    std::lock_guard lock(m.tally);
                    m.reduce_s += seconds;
                  }};
  CollectiveStats stats;
  m.run(call, stats);
  if (!out.empty()) std::memcpy(out.data(), m.reduced.data(), out.size());
  m.record_time(shape, compress);
  ++m.sequence;
  return stats;
}

CollectiveStats LosslessCollectives::alltoallv(DType dtype, std::span<const std::byte> in,
                                               std::span<const uint64_t> send_values,
                                               std::span<std::byte> out,
                                               std::span<const uint64_t> recv_values) {
  Impl& m = state();
  const OneCaller one(m.in_call, "LosslessCollectives", "alltoallv");
  m.check_codes(CallKind::kAlltoallv, dtype, ReduceOp::kSum, "alltoallv");
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  const auto world = static_cast<size_t>(m.world);
  if (send_values.size() != world || recv_values.size() != world) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: send_values and recv_values need one count per rank (" +
                 std::to_string(world) + "), got " + std::to_string(send_values.size()) + " and " +
                 std::to_string(recv_values.size()));
  }
  const std::optional<uint64_t> sending = checked_scaled_sum(send_values, value_bytes);
  const std::optional<uint64_t> receiving = checked_scaled_sum(recv_values, value_bytes);
  if (!sending || !receiving) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: the " + std::string(sending ? "receive" : "send") +
                 " counts add up to more than 2^64 - 1 bytes of " + std::string(dtype_name(dtype)) +
                 " values");
  }
  if (in.size() != *sending || out.size() != *receiving) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: the input holds " + std::to_string(in.size()) + " bytes and the output " +
                 std::to_string(out.size()) + ", but the counts add up to " +
                 std::to_string(*sending / value_bytes) + " and " +
                 std::to_string(*receiving / value_bytes) + " " + std::string(dtype_name(dtype)) +
                 " values");
  }
  // Each round's parts are written to the output while later rounds still read the input: in
  // place, or overlapping, the exchange would read what it already wrote (wrong output, no
  // error, wherever the counts are not the same for every pair of ranks).
  if (ranges_overlap(in.data(), in.size(), out.data(), out.size())) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: the input and the output overlap; give the output a buffer of its own");
  }
  auto [compress, shape] = m.decide(CallKind::kAlltoallv, dtype, in.size());
  const std::vector<uint64_t> out_at = offsets_of(recv_values);  // in values
  auto place = [&, out_at](size_t p, uint32_t k) {
    return out.data() + (out_at[p] + m.slice(recv_values[p], k).begin) * value_bytes;
  };
  const Call call{CallKind::kAlltoallv,
                  dtype,
                  ReduceOp::kSum,
                  in.data(),
                  send_values,
                  recv_values,
                  compress,
                  place,
                  [&](uint32_t k, std::span<const std::byte* const> slices) {
                    // Raw slices (and this rank's own part) are where they arrived: copied to their
                    // place.
                    for (size_t p = 0; p < world; ++p) {
                      std::byte* to = place(p, k);
                      const uint64_t bytes = m.slice(recv_values[p], k).values * value_bytes;
                      if (bytes != 0 && slices[p] != to) std::memcpy(to, slices[p], bytes);
                    }
                  }};
  CollectiveStats stats;
  m.run(call, stats);
  m.record_time(shape, compress);
  ++m.sequence;
  return stats;
}

}  // namespace ciera
