# Third-party dependencies, all from Debian packages, for the build (the installed
# cieraConfig.cmake looks for the xxHash library alone, which is all its consumers link).
#
# xxHash: the system library (libxxhash-dev), or, where only its header is at hand (the bare GPU
# machine of scripts/device-check.sh, CIERA_XXHASH_HEADER_DIR), a library compiled from that
# header (xxHash is header-only capable); then without its x86 runtime dispatch
# (CIERA_XXHASH_NO_DISPATCH), which lives only in the system library.
if(NOT TARGET ciera_deps::xxhash)
  set(CIERA_XXHASH_HEADER_DIR "" CACHE PATH "Build xxHash from the xxhash.h in this folder instead of the system library")
  if(CIERA_XXHASH_HEADER_DIR)
    add_library(ciera_xxhash_from_header STATIC ${CMAKE_CURRENT_LIST_DIR}/xxhash_from_header.cpp)
    target_include_directories(ciera_xxhash_from_header SYSTEM PUBLIC $<BUILD_INTERFACE:${CIERA_XXHASH_HEADER_DIR}>)
    target_compile_definitions(ciera_xxhash_from_header PUBLIC CIERA_XXHASH_NO_DISPATCH)
    set_target_properties(ciera_xxhash_from_header PROPERTIES POSITION_INDEPENDENT_CODE ON)
    add_library(ciera_deps::xxhash ALIAS ciera_xxhash_from_header)
  else()
    find_path(CIERA_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
    find_library(CIERA_XXHASH_LIBRARY NAMES xxhash REQUIRED)
    add_library(ciera_deps::xxhash UNKNOWN IMPORTED)
    set_target_properties(ciera_deps::xxhash PROPERTIES
      IMPORTED_LOCATION "${CIERA_XXHASH_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${CIERA_XXHASH_INCLUDE_DIR}")
  endif()
endif()
