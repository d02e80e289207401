// Which frames a sender makes key frames (docs/format.md, "Streams"): the first, the first
// `warmup` ones, and the one after a resynchronisation request, which also moves the epoch on.
// One definition for the CPU encoder and the GPU encoder's host side, so that both send the same
// sequence of frames.
#pragma once

#include <cstdint>

namespace ciera::codec {

struct FrameSchedule {
  uint32_t warmup = 0;
  uint32_t epoch = 0;
  uint64_t sequence = 0;  // of the next frame
  uint64_t frames = 0;    // encoded so far
  bool key_requested = false;

  bool next_is_key() const { return frames == 0 || key_requested || frames < warmup; }
  // After a frame is encoded.
  void advance() {
    ++sequence;
    ++frames;
    key_requested = false;
  }
  void request_key_frame() {
    ++epoch;
    key_requested = true;
  }
};

}  // namespace ciera::codec
