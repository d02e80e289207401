// One call of a lossless collective, on every rank (docs/format.md, "Lossless collectives"):
//   1. code each part for a peer (or keep it raw), into the send buffer;
//   2. exchange call records (allgather) and check them: same call everywhere, sizes that match;
//   3. alltoallv of the parts as sent;
//   4. decode the peers' parts; exchange verdicts (allgather), so a part that did not decode is
//      an error on every rank, not a wrong result on one;
//   5. reduce-scatter only: add the parts in rank order (reduction.hpp).
// Both exchanges of records are small; the alltoallv carries the data.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/collectives.hpp"
#include "ciera/error.hpp"
#include "collectives/call_record.hpp"
#include "collectives/reduction.hpp"
#include "common/adaptive_switch.hpp"

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

std::vector<uint64_t> offsets_of(std::span<const uint64_t> sizes) {
  std::vector<uint64_t> offsets(sizes.size());
  std::exclusive_scan(sizes.begin(), sizes.end(), offsets.begin(), uint64_t{0});
  return offsets;
}

}  // namespace

struct LosslessCollectives::Impl {
  std::shared_ptr<Transport> transport;
  CollectivesConfig config;
  int rank = 0, world = 1;
  uint64_t sequence = 0;
  // The adaptive switch (kAuto), keyed by call shape: one per (kind, dtype, bytes) seen.
  AdaptiveSwitch adaptive;
  std::map<std::tuple<CallKind, DType, uint64_t>, std::pair<size_t, uint64_t>>
      shapes;  // -> (key, calls)
  std::vector<std::byte> send, recv, decoded, records, verdicts;
  std::vector<uint64_t> send_at;  // where each peer's part starts in `send`

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

  // Room for each part in `send` (rank order; none for this rank's own part, never sent): its
  // raw size, or the codec's bound where parts are coded.
  std::vector<uint64_t> part_room(DType dtype, std::span<const uint64_t> values,
                                  bool compress) const {
    const uint32_t value_bytes = dtype_info(dtype).value_bytes;
    std::vector<uint64_t> bound(values.size(), 0);
    for (size_t p = 0; p < values.size(); ++p) {
      if (static_cast<int>(p) == rank) continue;
      bound[p] = values[p] * value_bytes;
      if (compress)
        bound[p] =
            std::max<uint64_t>(bound[p], max_payload_bytes(dtype, values[p], config.block_values));
    }
    return bound;
  }

  // Step 1. Codes (or copies) the part for each peer into its room in `send`; `in` holds the
  // parts back to back in rank order. Returns the bytes of each part as sent.
  std::vector<uint64_t> code_parts(DType dtype, const std::byte* in,
                                   std::span<const uint64_t> values, bool compress,
                                   CollectiveStats& stats) {
    const auto start = Clock::now();
    const uint32_t value_bytes = dtype_info(dtype).value_bytes;
    const CodecConfig c = codec(dtype);
    const std::vector<uint64_t> bound = part_room(dtype, values, compress);
    send_at = offsets_of(bound);
    room(send, send_at.back() + bound.back());
    std::vector<uint64_t> sent(values.size(), 0);
    uint64_t offset = 0;
    for (size_t p = 0; p < values.size(); ++p) {
      const uint64_t raw = values[p] * value_bytes;
      const std::byte* part = in + offset;
      offset += raw;
      if (static_cast<int>(p) == rank || raw == 0) continue;
      std::byte* out = send.data() + send_at[p];
      FrameStats frame;
      frame.payload_bytes = raw;
      if (compress) frame = encode_stateless_frame(c, {part, raw}, {out, bound[p]});
      if (frame.payload_bytes >= raw) {  // not smaller: raw, and the receiver tells by the size
        std::memcpy(out, part, raw);
        sent[p] = raw;
      } else {
        sent[p] = frame.payload_bytes;
        ++stats.coded_parts;
        stats.coded_values += values[p];
        stats.coded_exponent_bytes += frame.payload_bytes - frame.sign_mantissa_bytes;
        stats.exponent_entropy_bits += frame.coded_symbols_entropy_bits;
      }
      stats.raw_bytes += raw;
      stats.wire_bytes += sent[p];
    }
    // Back to back, so that transports whose alltoallv takes split sizes (torch's
    // all_to_all_single) need no copy: each part moves left, in order, within `send`.
    uint64_t packed = 0;
    for (size_t p = 0; p < values.size(); ++p) {
      if (sent[p] != 0 && packed != send_at[p])
        std::memmove(send.data() + packed, send.data() + send_at[p], sent[p]);
      send_at[p] = packed;
      packed += sent[p];
    }
    stats.compressed = compress;
    stats.encode_s = seconds_since(start);
    return sent;
  }

  // Arguments this rank refuses still take part in the record exchange, so that its peers fail
  // at once with an error naming it instead of waiting for it until the timeout.
  [[noreturn]] void reject(CallKind kind, DType dtype, const std::string& problem) {
    const std::vector<uint64_t> none(static_cast<size_t>(world), 0);
    CallRecord mine{kind, dtype, ReduceOp::kSum, true, sequence, none, none, none};
    share_record(mine);
    throw ConfigError(problem);
  }

  void share_record(const CallRecord& mine) {
    const size_t bytes = collectives::call_record_bytes(world);
    std::vector<std::byte> own(bytes);
    collectives::write_call_record(mine, own);
    room(records, bytes * static_cast<size_t>(world));
    transport->allgather(own.data(), bytes, records.data());
  }

  // Step 2: every rank's record; throws on every rank if they disagree.
  std::vector<CallRecord> exchange_records(const CallRecord& mine) {
    share_record(mine);
    const size_t bytes = collectives::call_record_bytes(world);
    std::vector<CallRecord> all;
    for (int r = 0; r < world; ++r) {
      all.push_back(collectives::read_call_record(
          {records.data() + bytes * static_cast<size_t>(r), bytes}, world));
    }
    collectives::check_agreement(all);
    return all;
  }

  // Step 3: the parts as sent, from `send` (laid out by code_parts) into `recv`, rank order.
  // Returns where each peer's part starts in `recv`.
  std::vector<uint64_t> exchange_parts(std::span<const CallRecord> all) {
    const auto me = static_cast<size_t>(rank);
    std::vector<uint64_t> recv_counts(static_cast<size_t>(world));
    for (size_t p = 0; p < recv_counts.size(); ++p) recv_counts[p] = all[p].part_bytes[me];
    const std::vector<uint64_t> recv_at = offsets_of(recv_counts);
    room(recv, recv_at.back() + recv_counts.back());
    transport->alltoallv(send.data(), all[me].part_bytes, send_at, recv.data(), recv_counts,
                         recv_at);
    return recv_at;
  }

  // Step 4: decodes (or copies) each peer's part into out + out_at[p]; then every rank's verdict.
  // A part that does not decode, here or on any rank, throws FormatError on every rank.
  void decode_parts(DType dtype, std::span<const CallRecord> all, std::span<const uint64_t> recv_at,
                    std::span<std::byte* const> out, CollectiveStats& stats, double elapsed_s) {
    const auto start = Clock::now();
    const uint32_t value_bytes = dtype_info(dtype).value_bytes;
    const CodecConfig c = codec(dtype);
    Verdict mine;
    for (size_t p = 0; p < static_cast<size_t>(world) && mine.ok; ++p) {
      if (static_cast<int>(p) == rank) continue;
      const uint64_t raw = all[p].part_values[static_cast<size_t>(rank)] * value_bytes;
      const uint64_t sent = all[p].part_bytes[static_cast<size_t>(rank)];
      const std::byte* part = recv.data() + recv_at[p];
      if (sent == raw) {
        if (raw != 0 && out[p] != part) std::memcpy(out[p], part, raw);
        continue;
      }
      try {
        decode_stateless(c, {part, sent}, {out[p], raw});
      } catch (const Error& e) {
        mine.ok = false;
        mine.message = "rank " + std::to_string(rank) + " could not decode the part from rank " +
                       std::to_string(p) + ": " + e.what();
      }
    }
    stats.decode_s = seconds_since(start);
    mine.seconds = elapsed_s + stats.decode_s;
    const size_t bytes = collectives::verdict_bytes();
    std::vector<std::byte> own(bytes);
    collectives::write_verdict(mine, own);
    room(verdicts, bytes * static_cast<size_t>(world));
    transport->allgather(own.data(), bytes, verdicts.data());
    slowest_s = 0;
    for (int r = 0; r < world; ++r) {
      const Verdict v =
          collectives::read_verdict({verdicts.data() + bytes * static_cast<size_t>(r), bytes});
      if (!v.ok)
        throw FormatError("lossless collectives, call " + std::to_string(sequence) + ": " +
                          v.message);
      slowest_s = std::max(slowest_s, v.seconds);
    }
    stats.decode_s = seconds_since(start);
  }

  void record_time(std::pair<size_t, uint64_t>* shape, bool compressed) {
    if (shape == nullptr) return;
    adaptive.record(shape->first, compressed, slowest_s);
    ++shape->second;
  }

  double slowest_s = 0;  // the slowest rank's time for the current call, from the verdicts
};

LosslessCollectives::LosslessCollectives(std::shared_ptr<Transport> transport,
                                         CollectivesConfig config)
    : impl_(std::make_unique<Impl>()) {
  if (!transport) throw ConfigError("LosslessCollectives: no transport");
  config.validate();
  impl_->transport = std::move(transport);
  impl_->config = config;
  impl_->rank = impl_->transport->rank();
  impl_->world = impl_->transport->size();
}
LosslessCollectives::~LosslessCollectives() = default;
LosslessCollectives::LosslessCollectives(LosslessCollectives&&) noexcept = default;
LosslessCollectives& LosslessCollectives::operator=(LosslessCollectives&&) noexcept = default;

const CollectivesConfig& LosslessCollectives::config() const { return impl_->config; }
int LosslessCollectives::rank() const { return impl_->rank; }
int LosslessCollectives::size() const { return impl_->world; }

CollectiveStats LosslessCollectives::reduce_scatter(DType dtype, ReduceOp op,
                                                    std::span<const std::byte> in,
                                                    std::span<std::byte> out) {
  Impl& m = *impl_;
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
  const auto start = Clock::now();
  CollectiveStats stats;
  const std::vector<uint64_t> per_peer(world, values);
  auto [compress, shape] = m.decide(CallKind::kReduceScatter, dtype, in.size());
  CallRecord mine{CallKind::kReduceScatter, dtype, op, false, m.sequence, per_peer, {}, per_peer};
  mine.part_bytes = m.code_parts(dtype, in.data(), per_peer, compress, stats);
  const auto exchange_start = Clock::now();
  const std::vector<CallRecord> all = m.exchange_records(mine);
  const std::vector<uint64_t> recv_at = m.exchange_parts(all);
  stats.exchange_s = seconds_since(exchange_start);

  // Each peer's part decoded into its slot of `decoded` (raw parts are used where they arrived);
  // this rank's own part straight from `in`.
  room(m.decoded, out.size() * world);
  std::vector<std::byte*> slots(world);
  std::vector<const std::byte*> parts(world);
  for (size_t p = 0; p < world; ++p) {
    const bool raw = all[p].part_bytes[static_cast<size_t>(m.rank)] == out.size();
    slots[p] = raw ? m.recv.data() + recv_at[p] : m.decoded.data() + p * out.size();
    parts[p] = static_cast<int>(p) == m.rank ? in.data() + p * out.size() : slots[p];
  }
  m.decode_parts(dtype, all, recv_at, slots, stats, seconds_since(start));
  const auto reduce_start = Clock::now();
  collectives::reduce_in_rank_order(dtype, op, parts, out.data(), values);
  stats.reduce_s = seconds_since(reduce_start);
  m.record_time(shape, compress);
  ++m.sequence;
  return stats;
}

CollectiveStats LosslessCollectives::alltoallv(DType dtype, std::span<const std::byte> in,
                                               std::span<const uint64_t> send_values,
                                               std::span<std::byte> out,
                                               std::span<const uint64_t> recv_values) {
  Impl& m = *impl_;
  const uint32_t value_bytes = dtype_info(dtype).value_bytes;
  const auto world = static_cast<size_t>(m.world);
  if (send_values.size() != world || recv_values.size() != world) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: send_values and recv_values need one count per rank (" +
                 std::to_string(world) + "), got " + std::to_string(send_values.size()) + " and " +
                 std::to_string(recv_values.size()));
  }
  const uint64_t sending = std::accumulate(send_values.begin(), send_values.end(), uint64_t{0});
  const uint64_t receiving = std::accumulate(recv_values.begin(), recv_values.end(), uint64_t{0});
  if (in.size() != sending * value_bytes || out.size() != receiving * value_bytes) {
    m.reject(CallKind::kAlltoallv, dtype,
             "alltoallv: the input holds " + std::to_string(in.size()) + " bytes and the output " +
                 std::to_string(out.size()) + ", but the counts add up to " +
                 std::to_string(sending) + " and " + std::to_string(receiving) + " " +
                 std::string(dtype_name(dtype)) + " values");
  }
  const auto start = Clock::now();
  CollectiveStats stats;
  auto [compress, shape] = m.decide(CallKind::kAlltoallv, dtype, in.size());
  CallRecord mine{CallKind::kAlltoallv,
                  dtype,
                  ReduceOp::kSum,
                  false,
                  m.sequence,
                  {send_values.begin(), send_values.end()},
                  {},
                  {recv_values.begin(), recv_values.end()}};
  mine.part_bytes = m.code_parts(dtype, in.data(), send_values, compress, stats);
  const auto exchange_start = Clock::now();
  const std::vector<CallRecord> all = m.exchange_records(mine);
  const std::vector<uint64_t> recv_at = m.exchange_parts(all);
  stats.exchange_s = seconds_since(exchange_start);

  std::vector<uint64_t> recv_bytes(world);
  for (size_t p = 0; p < world; ++p) recv_bytes[p] = recv_values[p] * value_bytes;
  const std::vector<uint64_t> out_at = offsets_of(recv_bytes);
  std::vector<std::byte*> slots(world);
  for (size_t p = 0; p < world; ++p) slots[p] = out.data() + out_at[p];
  // This rank's own part: a copy from the input (it is never sent).
  const std::vector<uint64_t> in_at =
      offsets_of(std::vector<uint64_t>(send_values.begin(), send_values.end()));
  const auto own = static_cast<size_t>(m.rank);
  if (recv_bytes[own] != 0)
    std::memcpy(slots[own], in.data() + in_at[own] * value_bytes, recv_bytes[own]);
  m.decode_parts(dtype, all, recv_at, slots, stats, seconds_since(start));
  m.record_time(shape, compress);
  ++m.sequence;
  return stats;
}

}  // namespace ciera
