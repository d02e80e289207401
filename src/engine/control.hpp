// The engine's control records and verdicts (docs/format.md, "Engine protocol", steps 1 and 4):
// fixed-size host records that every rank allgathers before and after each round's payload
// exchange, so that all ranks take the same decisions from the same facts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ciera/engine.hpp"

namespace ciera {

constexpr uint32_t kControlMagic = 0x43454943;  // "CIEC"
constexpr size_t kErrorTextBytes = 80;
// Gathers of one round share one control exchange, one batched payload exchange and one verdict
// exchange; this many at most.
constexpr size_t kMaxRoundGathers = 8;

enum ControlFlags : uint32_t { kCold = 1, kLocalError = 2, kKeyRound = 4, kRaw = 8 };

struct ControlRecord {  // 128 bytes, little-endian host layout
  uint32_t magic;
  uint32_t version;
  uint32_t bucket;
  uint32_t flags;
  uint64_t step;
  uint64_t envelope_bytes;
  uint64_t policy_digest;
  uint32_t previous_us;          // this rank's duration of its previous gather of the bucket
  uint32_t previous_compressed;  // whether that gather was compressed
  char error_text[kErrorTextBytes];
};
static_assert(sizeof(ControlRecord) == 128);

// One rank's records for the gathers it has ready, in start order.
struct RoundControl {
  uint32_t magic;
  uint32_t count;     // 1..kMaxRoundGathers
  uint64_t checksum;  // XXH3-64 of the 1040 bytes, this field 0 (seal)
  ControlRecord records[kMaxRoundGathers];
};
static_assert(sizeof(RoundControl) == 1040);

struct Verdict {   // 128 bytes
  int32_t failed;  // 0: every shard decoded exactly
  int32_t peer;
  int32_t param;      // -1: the envelope itself
  uint32_t checksum;  // low 32 bits of XXH3-64 of the 128 bytes, this field 0 (seal)
  char reason[112];
};
static_assert(sizeof(Verdict) == 128);

struct RoundVerdicts {
  Verdict verdicts[kMaxRoundGathers];
};

// Sets the checksum of `round` (of each of its verdicts), last, before it is sent. The records
// decide what every rank does next (the raw flag moves inputs straight into the output): one
// the transport damaged must be an error, never a decision.
void seal(RoundControl& round);
void seal(RoundVerdicts& round);

// Throws CommError naming the sender unless every rank's verdicts arrived as sealed.
void check_sealed(std::span<const RoundVerdicts> all);

// Writes `text` NUL-padded into a fixed field of `capacity` bytes; a text too long is cut and
// ends in "..." (shortened()), so a reader sees that it was.
void write_text(char* field, size_t capacity, const std::string& text);

// Records a decode failure in `verdict`, keeping the lowest (peer, parameter) one, so that the
// report does not depend on which worker thread failed first. Not thread-safe.
void record_failure(Verdict& verdict, int peer, int param, const std::string& reason);

// XXH3-64 of the bucket's parameter policies, which every rank must have set alike.
uint64_t policy_digest(const BucketLayout& layout);

// How many leading gathers every rank has ready, from every rank's RoundControl; throws
// CommError if one is malformed or arrived damaged (its checksum).
size_t gathers_ready(std::span<const RoundControl> all);

// Checks every rank's record for this rank's gather of `bucket` (`my_rank` started it):
// protocol, start order and envelope sizes (CommError), local errors and policies
// (ConfigError, which fails this gather alone). A rank's local error is named in its record's
// text (cut to kErrorTextBytes - 1 bytes, marked "..."), or on its own rank in full: `my_error`.
void check_records(std::span<const ControlRecord> records, size_t bucket,
                   const BucketLayout& layout, int my_rank,
                   std::span<const uint64_t> max_envelope_bytes, const std::string& my_error);

// The largest step any rank reports: the step a gather runs at (a restarted rank catches up).
uint64_t agreed_step(std::span<const ControlRecord> records);

// "" if every rank reconstructed gather `gather` of the round exactly, else the first failure in
// rank order, worded the same on every rank.
std::string failure_text(std::span<const RoundVerdicts> all, size_t gather,
                         const std::string& bucket_name);

}  // namespace ciera
