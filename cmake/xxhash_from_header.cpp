// xxHash's functions compiled from its header, for machines that have xxhash.h but not the
// library (cmake/CieraDependencies.cmake, CIERA_XXHASH_HEADER_DIR).
#define XXH_STATIC_LINKING_ONLY
#define XXH_IMPLEMENTATION
#include <xxhash.h>
