// The engine protocol's version (docs/format.md, "Engine protocol"): carried by every control
// record and envelope, and part of the configuration every rank must agree on.
#pragma once

#include <cstdint>

namespace ciera {

// 2: control records and verdicts carry checksums (a damaged one is an error, not a decision).
// 3: the configuration agreement exchanges a marker and digests, the descriptions only where
// they differ (agreement.cpp); an older peer fails the agreement's first collective by name.
constexpr uint8_t kEngineProtocolVersion = 3;

}  // namespace ciera
