// Where a frame stands in its stream against a receiver's position (docs/format.md, "Streams"):
// the one rule the host decoder, the peer schemes' decoders and the device decoder apply, each
// turning a refusal into its own error (a FormatError's text, a device status).
#pragma once

#include <cstdint>

#include "ciera/codec.hpp"
#include "common/host_device.hpp"

namespace ciera::codec {

enum class StreamPosition : uint8_t {
  kNext,         // the next frame of the receiver's epoch (or its first frame)
  kResync,       // a key frame that starts a later epoch, which the receiver asked for
  kStale,        // an earlier frame, a repeat, a gap, or an earlier epoch
  kUnrequested,  // a key frame of a later epoch, which the receiver did not ask for
  kTooFarAhead,  // more than kMaxResyncEpochs epochs ahead: not this stream's resynchronisation
};

// The receiver is at `at_epoch`, having decoded `last_sequence` (if `decoded_any`). A frame that
// needs the receiver's state (`starts_over` false: a delta frame, one built on values the
// receiver holds) must be the next of the epoch; a key frame may also start a later epoch after
// a requested resynchronisation. `ahead` receives how many epochs ahead the frame is (epochs
// wrap mod 2^32: serial-number arithmetic, half the range ahead and half behind).
CIERA_HD inline StreamPosition stream_position(uint32_t epoch, uint64_t sequence, uint32_t at_epoch,
                                               uint64_t last_sequence, bool decoded_any,
                                               bool starts_over, bool resync_requested,
                                               uint32_t& ahead) {
  ahead = epoch - at_epoch;
  if (epoch == at_epoch && (!decoded_any || sequence == last_sequence + 1)) {
    return StreamPosition::kNext;
  }
  if (!starts_over || epoch == at_epoch || ahead > (uint32_t{1} << 31)) {
    return StreamPosition::kStale;
  }
  if (!resync_requested) return StreamPosition::kUnrequested;
  if (ahead > kMaxResyncEpochs) return StreamPosition::kTooFarAhead;
  return StreamPosition::kResync;
}

}  // namespace ciera::codec
