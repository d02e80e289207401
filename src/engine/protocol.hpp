// The engine protocol's version (docs/format.md, "Engine protocol"): carried by every control
// record and envelope, and part of the configuration every rank must agree on.
#pragma once

#include <cstdint>

namespace ciera {

constexpr uint8_t kEngineProtocolVersion = 1;

}  // namespace ciera
