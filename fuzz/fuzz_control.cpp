// Feeds the fuzz input to rank 0 as the results of one round's control and verdict exchanges
// (docs/format.md, "Engine protocol", steps 1 and 4): `world` RoundControls (1040 bytes each,
// every rank's, rank-major, as the allgather delivers them), then `world` RoundVerdicts (1024
// bytes each). `world` is the input's length in whole ranks (1..kMaxWorld); missing bytes are
// zero. They go through the engine's own checks in the order its exchange_controls and
// exchange_verdicts (src/engine/scheduler.cpp) call them: gathers_ready, then check_records and
// agreed_step per gather ready, then failure_text per gather. Each may throw only the errors it
// documents; none may crash or read past a record's text fields.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ciera/error.hpp"
#include "engine_fixture.hpp"

namespace {

using namespace ciera;

constexpr size_t kRankBytes = sizeof(RoundControl) + sizeof(RoundVerdicts);

struct World {
  std::vector<BucketLayout> buckets;
  std::vector<std::vector<uint64_t>> max_envelope_bytes;  // [bucket][rank]
};

const World& world_of(int ranks) {
  static const std::vector<World> worlds = [] {
    std::vector<World> all(fuzz::kMaxWorld + 1);
    for (int w = 1; w <= fuzz::kMaxWorld; ++w) {
      all[w].buckets = fuzz::control_buckets(w);
      for (const BucketLayout& layout : all[w].buckets) {
        all[w].max_envelope_bytes.push_back(fuzz::max_envelope_bytes(layout));
      }
    }
    return all;
  }();
  return worlds[ranks];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int world = static_cast<int>(std::clamp<size_t>(size / kRankBytes, 1, fuzz::kMaxWorld));
  std::vector<uint8_t> bytes(world * kRankBytes);
  std::memcpy(bytes.data(), data, std::min(size, bytes.size()));
  std::vector<RoundControl> controls(world);
  std::vector<RoundVerdicts> verdicts(world);
  std::memcpy(controls.data(), bytes.data(), world * sizeof(RoundControl));
  std::memcpy(verdicts.data(), bytes.data() + world * sizeof(RoundControl),
              world * sizeof(RoundVerdicts));
  const World& setup = world_of(world);
  // Sealed as the engine seals them, so that the input reaches the checks behind the checksums
  // (the checksums themselves: tests/test_engine.cpp).
  for (RoundControl& c : controls) seal(c);
  for (RoundVerdicts& v : verdicts) seal(v);

  size_t ready = 0;
  try {
    ready = gathers_ready(controls);
  } catch (const CommError&) {
    return 0;
  }
  for (size_t i = 0; i < ready; ++i) {
    // This rank's own record names the bucket it started; the engine writes it, so it is a
    // bucket that exists.
    const size_t bucket = controls[fuzz::kReceiver].records[i].bucket % setup.buckets.size();
    std::vector<ControlRecord> records(world);
    for (int r = 0; r < world; ++r) records[r] = controls[r].records[i];
    try {
      // No error of its own: a local error is read from its record, as the peers read it.
      check_records(records, bucket, setup.buckets[bucket], fuzz::kReceiver,
                    setup.max_envelope_bytes[bucket], "");
    } catch (const CommError&) {
      return 0;
    } catch (const ConfigError&) {
      ready = i;  // this gather and those after it wait for the next round
      break;
    }
    const uint64_t step = agreed_step(records);
    for (const ControlRecord& c : records) {
      if (c.step > step) std::abort();
    }
  }
  check_sealed(verdicts);
  for (size_t i = 0; i < ready; ++i) {
    const std::string bucket_name = setup.buckets[0].name;
    const std::string failure = failure_text(verdicts, i, bucket_name);
    const bool any_failed =
        std::any_of(verdicts.begin(), verdicts.end(),
                    [i](const RoundVerdicts& v) { return v.verdicts[i].failed; });
    if (failure.empty() == any_failed) std::abort();
  }
  return 0;
}
