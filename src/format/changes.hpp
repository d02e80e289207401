// Changed exponents as the format layer finds them (split_detect_bf16, find_changes): a change's
// position in its block, tagged with its step class. Fine coding (codec/kernels.hpp) turns
// tagged positions into the wire format's change symbols; the classes are the format's, the
// alphabet is the codec's (codec/fine_alphabet.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ciera::format {

// How an exponent moved from one send to the next: almost always by one (a crossing of a power
// of two), so +1 and -1 need no step stored.
enum StepClass : unsigned { kStepUp = 0, kStepDown = 1, kStepEscape = 2 };

// The step class of an exponent step (mod 2^E, `mask` = 2^E - 1), without branches: this runs
// once per changed value and its input is unpredictable.
inline unsigned step_class_of(uint8_t step, uint8_t mask) {
  return kStepEscape - 2u * (step == 1) - (step == mask);
}

// Extra entries split_detect_bf16 may write past the changes and escapes it reports.
inline constexpr size_t kChangeSlack = 64;

// A change's tagged position: its position in the block (below 4096) in bits 0..11, its step
// class (StepClass: +1, -1 or escaped) in bits 13..14, and kBlockStartFlag on a block's
// first change (set by the encoder).
inline constexpr unsigned kStepClassShift = 13;
inline constexpr uint16_t kPositionMask = 0x0FFF;
inline constexpr uint16_t kBlockStartFlag = 0x8000;
inline uint16_t tag_change(uint32_t position, unsigned step_class) {
  return static_cast<uint16_t>(position | step_class << kStepClassShift);
}
// A change at `position` whose exponent moved by `step` (mod 2^E, `mask` = 2^E - 1): its tagged
// position, with the step appended to `escapes` at `escape_count` when it is escaped (branch-free:
// the step is always stored, and counted only then; `escapes` needs room for one more).
inline uint16_t tag_step(uint32_t position, uint8_t step, uint8_t mask, uint8_t* escapes,
                         size_t& escape_count) {
  const unsigned step_class = step_class_of(step, mask);
  escapes[escape_count] = step;
  escape_count += step_class == kStepEscape;
  return tag_change(position, step_class);
}

}  // namespace ciera::format
