#pragma once

namespace ciera {
// Library version (semantic versioning) and the wire-format version it writes and reads.
inline constexpr const char* kLibraryVersion = "0.1.0";
inline constexpr unsigned kFormatVersion = 5;
}  // namespace ciera
