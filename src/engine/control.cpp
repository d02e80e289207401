// Checks of control records and verdicts (docs/format.md, "Engine protocol", steps 1 and 4). The
// texts they throw are built from exchanged facts only, so every rank words them alike.
#include "engine/control.hpp"

#include <algorithm>
#include <cstring>

#include "ciera/error.hpp"
#include "common/checksum.hpp"
#include "common/text.hpp"
#include "engine/protocol.hpp"

namespace ciera {

namespace {

uint64_t checksum_of(RoundControl round) {
  round.checksum = 0;
  return checksum64(&round, sizeof round);
}

uint32_t checksum_of(Verdict verdict) {
  verdict.checksum = 0;
  return static_cast<uint32_t>(checksum64(&verdict, sizeof verdict));
}

std::string damaged(const char* what, size_t rank) {
  return std::string("the ") + what + " from rank " + std::to_string(rank) +
         " arrived damaged (its checksum does not match): the transport corrupted it";
}

}  // namespace

void seal(RoundControl& round) { round.checksum = checksum_of(round); }

void seal(RoundVerdicts& round) {
  for (Verdict& v : round.verdicts) v.checksum = checksum_of(v);
}

void check_sealed(std::span<const RoundVerdicts> all) {
  for (size_t r = 0; r < all.size(); ++r) {
    for (const Verdict& v : all[r].verdicts) {
      if (v.checksum != checksum_of(v)) throw CommError(damaged("verdict record", r));
    }
  }
}

void write_text(char* field, size_t capacity, const std::string& text) {
  std::memset(field, 0, capacity);
  const std::string kept = shortened(text, capacity - 1);
  std::memcpy(field, kept.data(), kept.size());
}

void record_failure(Verdict& verdict, int peer, int param, const std::string& reason) {
  if (verdict.failed && (verdict.peer < peer || (verdict.peer == peer && verdict.param <= param))) {
    return;
  }
  verdict.failed = 1;
  verdict.peer = peer;
  verdict.param = param;
  write_text(verdict.reason, sizeof verdict.reason, reason);
}

uint64_t policy_digest(const BucketLayout& layout) {
  return checksum64(layout.policy.data(), layout.policy.size() * sizeof(ShardPolicy));
}

size_t gathers_ready(std::span<const RoundControl> all) {
  size_t ready = kMaxRoundGathers;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].checksum != checksum_of(all[r])) throw CommError(damaged("control record", r));
    if (all[r].magic != kControlMagic || all[r].count == 0 || all[r].count > kMaxRoundGathers) {
      throw CommError("rank " + std::to_string(r) + " sent a malformed control record");
    }
    ready = std::min<size_t>(ready, all[r].count);
  }
  return ready;
}

void check_records(std::span<const ControlRecord> records, size_t bucket,
                   const BucketLayout& layout, int my_rank,
                   std::span<const uint64_t> max_envelope_bytes, const std::string& my_error) {
  const int world = static_cast<int>(records.size());
  if (records[static_cast<size_t>(my_rank)].bucket != bucket) {  // this rank's own, as it sent it
    throw CommError("rank " + std::to_string(my_rank) + "'s control record names bucket " +
                    std::to_string(records[static_cast<size_t>(my_rank)].bucket) +
                    ", not the bucket " + std::to_string(bucket) + " it gathers");
  }
  for (int r = 0; r < world; ++r) {
    const ControlRecord& c = records[r];
    if (c.magic != kControlMagic || c.version != kEngineProtocolVersion) {
      throw CommError("rank " + std::to_string(r) + " speaks another CIERA protocol version");
    }
    // Against rank 0's record, not this rank's: every rank names the same two.
    if (c.bucket != records[0].bucket) {
      throw CommError("gathers out of order: rank " + std::to_string(r) + " is gathering bucket " +
                      std::to_string(c.bucket) + " while rank 0 gathers bucket " +
                      std::to_string(records[0].bucket) +
                      " (start() must be called in the same order on every rank)");
    }
  }
  for (int r = 0; r < world; ++r) {
    if (records[r].flags & kLocalError) {
      const std::string text =
          r == my_rank && !my_error.empty()
              ? my_error
              : std::string(records[r].error_text, strnlen(records[r].error_text, kErrorTextBytes));
      throw ConfigError("rank " + std::to_string(r) + " rejected its gather of bucket '" +
                        layout.name + "': " + text);
    }
  }
  for (int r = 0; r < world; ++r) {
    if (records[r].policy_digest != records[0].policy_digest) {
      throw ConfigError("shard policies of bucket '" + layout.name +
                        "' differ between rank 0 and rank " + std::to_string(r) +
                        " (set_policy must be called the same way on every rank)");
    }
    if (records[r].envelope_bytes > max_envelope_bytes[r]) {
      throw CommError("rank " + std::to_string(r) + " announced an envelope of " +
                      std::to_string(records[r].envelope_bytes) + " bytes, above its bound of " +
                      std::to_string(max_envelope_bytes[r]));
    }
  }
}

uint64_t agreed_step(std::span<const ControlRecord> records) {
  uint64_t step = 0;
  for (const ControlRecord& c : records) step = std::max(step, c.step);
  return step;
}

std::string failure_text(std::span<const RoundVerdicts> all, size_t gather,
                         const std::string& bucket_name) {
  for (size_t r = 0; r < all.size(); ++r) {
    const Verdict& v = all[r].verdicts[gather];
    if (!v.failed) continue;
    return "rank " + std::to_string(r) + " could not reconstruct rank " + std::to_string(v.peer) +
           "'s " +
           (v.param >= 0 ? "shard of parameter " + std::to_string(v.param)
                         : std::string("envelope")) +
           " in bucket '" + bucket_name +
           "': " + std::string(v.reason, strnlen(v.reason, sizeof v.reason));
  }
  return "";
}

}  // namespace ciera
