// xxHash's default XXH3 secret, taken from the system's xxhash.h at build time rather than
// copied into this repository (format/xxh3.hpp).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "format/xxh3.hpp"

namespace ciera::format::xxh3 {

static_assert(sizeof(XXH3_kSecret) == kSecretBytes);

const uint8_t* default_secret() { return XXH3_kSecret; }

}  // namespace ciera::format::xxh3
