// Guard bytes around every output a fuzz target hands the library: the library must never write
// them (reliability test 2: no write outside the output, whatever the input).
#pragma once

#include <cstddef>

namespace ciera::fuzz {

inline constexpr size_t kGuardBytes = 64;
inline constexpr std::byte kGuard{0xA5};

}  // namespace ciera::fuzz
