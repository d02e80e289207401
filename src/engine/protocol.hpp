// The engine protocol's version (docs/format.md, "Engine protocol"): carried by every control
// record and envelope, and part of the configuration every rank must agree on.
#pragma once

#include <cstdint>

namespace ciera {

// 2: control records and verdicts carry checksums (a damaged one is an error, not a decision).
constexpr uint8_t kEngineProtocolVersion = 2;

}  // namespace ciera
