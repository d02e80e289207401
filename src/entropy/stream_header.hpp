// A symbol stream's header (docs/format.md, "Symbol stream"): the method (1 byte), its argument
// (1 byte: a packed stream's width, a constant stream's symbol, 0 for rANS) and the body's
// length (u64), then the body. Without the coders, for the device decoder's plan.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ciera::entropy {

enum class StreamMethod : uint8_t { kPacked = 0, kConstant = 1, kRans = 2 };
inline constexpr size_t kStreamHeaderBytes = 10;
inline constexpr size_t kStreamArgumentAt = 1;
inline constexpr size_t kStreamBodyBytesAt = 2;

}  // namespace ciera::entropy
