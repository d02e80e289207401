# Third-party dependencies, all from Debian packages. Included by the build and by the installed
# cieraConfig.cmake, so that find_package(ciera) consumers resolve the same imported targets.
if(NOT TARGET ciera_deps::xxhash)
  find_path(CIERA_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
  find_library(CIERA_XXHASH_LIBRARY NAMES xxhash REQUIRED)
  add_library(ciera_deps::xxhash UNKNOWN IMPORTED)
  set_target_properties(ciera_deps::xxhash PROPERTIES
    IMPORTED_LOCATION "${CIERA_XXHASH_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CIERA_XXHASH_INCLUDE_DIR}")
endif()
