# The layers of the library (docs/architecture.md, "Layers"), each its own target that links only
# downwards, and each compiled against an include root that holds only what it may see:
#
#   common <- {format, entropy} <- codec <- {engine, selection, collectives};  comm beside them
#   (uses common; engine and collectives use it);
#   analysis uses format;  sim uses selection and the codec's public size functions.
#
# A layer's include root (build/layers/<layer>/) is made of links: one to src/<dep> for the layer
# itself and each layer below it, and one to each public header (include/ciera/) those layers
# own. So `#include "codec/wire.hpp"` from format, or `#include "ciera/engine.hpp"` from
# selection, is "file not found" at compile time, not a remark in review. Code above the layers
# (tools, tests, benchmarks, fuzzers, the Python binding) sees everything.

set(CIERA_LAYER_ROOTS ${CMAKE_BINARY_DIR}/layers)

# ciera_layer(<layer> [TARGET <name>] [KIND OBJECT|STATIC] SOURCES ... [DEPENDS <layer>...]
#             [PUBLIC_HEADERS <header>...] [LINK <library>...])
# Declares layer <layer> (sources under src/<layer>/) and its target, ciera_layer_<layer> by
# default. PUBLIC_HEADERS names the headers of include/ciera/ the layer owns; DEPENDS the layers
# directly below it (those below them come along). A second target of a layer already declared
# (TARGET given, as the MPI transport in comm) shares its include root.
function(ciera_layer layer)
  cmake_parse_arguments(L "" "TARGET;KIND" "SOURCES;DEPENDS;PUBLIC_HEADERS;LINK" ${ARGN})
  if(NOT L_TARGET)
    set(L_TARGET ciera_layer_${layer})
  endif()
  if(NOT L_KIND)
    set(L_KIND OBJECT)
  endif()

  get_property(declared GLOBAL PROPERTY CIERA_LAYER_${layer}_VISIBLE SET)
  if(NOT declared)
    set(visible ${layer})
    foreach(dep IN LISTS L_DEPENDS)
      get_property(known GLOBAL PROPERTY CIERA_LAYER_${dep}_VISIBLE SET)
      if(NOT known)
        message(FATAL_ERROR "layer ${layer} depends on ${dep}, which is not declared before it")
      endif()
      get_property(below GLOBAL PROPERTY CIERA_LAYER_${dep}_VISIBLE)
      list(APPEND visible ${below})
    endforeach()
    list(REMOVE_DUPLICATES visible)
    set_property(GLOBAL PROPERTY CIERA_LAYER_${layer}_VISIBLE ${visible})
    set_property(GLOBAL PROPERTY CIERA_LAYER_${layer}_HEADERS ${L_PUBLIC_HEADERS})
    set_property(GLOBAL PROPERTY CIERA_LAYER_${layer}_DEPENDS ${L_DEPENDS})
    _ciera_layer_root(${layer} "${visible}")
  endif()

  _ciera_no_relative_includes(${layer})
  add_library(${L_TARGET} ${L_KIND} ${L_SOURCES})
  set_target_properties(${L_TARGET} PROPERTIES CIERA_LAYER ${layer})
  target_include_directories(${L_TARGET} PRIVATE ${CIERA_LAYER_ROOTS}/${layer})
  if(L_KIND STREQUAL "OBJECT")
    # Usage requirements only (definitions, third-party includes): object libraries link no
    # objects, which reach a binary through the umbrella library `ciera`. A second target of a
    # layer links `ciera` itself (LINK) instead.
    get_property(deps GLOBAL PROPERTY CIERA_LAYER_${layer}_DEPENDS)
    foreach(dep IN LISTS deps)
      target_link_libraries(${L_TARGET} PUBLIC ciera_layer_${dep})
    endforeach()
  endif()
  if(L_LINK)
    target_link_libraries(${L_TARGET} PUBLIC ${L_LINK})
  endif()
  target_compile_options(${L_TARGET} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${CIERA_WARNINGS}>")
  target_compile_features(${L_TARGET} PUBLIC cxx_std_20)
  if(L_KIND STREQUAL "OBJECT")
    set_property(GLOBAL APPEND PROPERTY CIERA_CORE_LAYER_TARGETS ${L_TARGET})
  endif()
endfunction()

function(_ciera_layer_root layer visible)
  set(root ${CIERA_LAYER_ROOTS}/${layer})
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/ciera)
  foreach(seen IN LISTS visible)
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${seen} ${root}/${seen} SYMBOLIC)
    get_property(headers GLOBAL PROPERTY CIERA_LAYER_${seen}_HEADERS)
    foreach(header IN LISTS headers)
      if(NOT EXISTS ${PROJECT_SOURCE_DIR}/include/ciera/${header})
        message(FATAL_ERROR "layer ${seen}: no public header include/ciera/${header}")
      endif()
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/ciera/${header} ${root}/ciera/${header} SYMBOLIC)
    endforeach()
  endforeach()
endfunction()

# ciera_layer_kernels(<target> <layer> TABLE <type> HEADER <header> ACCESSOR <name>): compiles
# src/<layer>/kernels_impl.inc once per SIMD target (scalar, and on x86 SSE2, AVX2, AVX-512), as
# Highway does. Each copy defines the table `k<Target>Kernels` of type <type> through the .inc's
# make_kernels(); a generated registry defines <name>() (the table of the process's target,
# common::chosen_simd_target()) and <name>_for(target), both declared in <header>.
# src/<layer>/kernels_prelude.hpp holds what must be included outside the anonymous namespace
# the .inc is compiled in, and names the table type `Kernels`.
function(ciera_layer_kernels target layer)
  cmake_parse_arguments(K "" "TABLE;HEADER;ACCESSOR" "" ${ARGN})
  set(simd_targets scalar)
  if(CIERA_X86)
    list(APPEND simd_targets sse2 avx2 avx512)  # the order of common::SimdTarget
  endif()
  set(flags_scalar "-fno-tree-vectorize")
  set(flags_sse2 "")
  set(flags_avx2 "-mavx2;-mbmi;-mbmi2;-mpopcnt")
  set(flags_avx512 "-mavx512f;-mavx512bw;-mavx512cd;-mavx512vl;-mavx512vbmi;-mavx512vbmi2;-mavx2;-mbmi;-mbmi2;-mpopcnt;-mprefer-vector-width=512")
  set(CIERA_KERNEL_LAYER ${layer})
  set(CIERA_KERNEL_TYPE ${K_TABLE})
  set(CIERA_KERNEL_HEADER ${K_HEADER})
  set(CIERA_KERNEL_ACCESSOR ${K_ACCESSOR})
  set(CIERA_KERNEL_EXTERNS "")
  set(pointers "")
  foreach(simd IN LISTS simd_targets)
    set(CIERA_KERNEL_SIMD ${simd})
    string(SUBSTRING ${simd} 0 1 first)
    string(TOUPPER ${first} first)
    string(SUBSTRING ${simd} 1 -1 rest)
    set(CIERA_KERNEL_TABLE "k${first}${rest}Kernels")
    string(APPEND CIERA_KERNEL_EXTERNS "extern const ${K_TABLE} ${CIERA_KERNEL_TABLE};\n")
    list(APPEND pointers "&${CIERA_KERNEL_TABLE}")
    set(CIERA_KERNEL_TARGET_DEFINE "// Compiled with this target's flags (ciera_layer_kernels).")
    if(simd STREQUAL "scalar")
      set(CIERA_KERNEL_TARGET_DEFINE
          "#define CIERA_SCALAR_ONLY 1  // no intrinsics, no auto-vectorisation: the portable fallback")
    endif()
    set(out ${CMAKE_BINARY_DIR}/generated/${layer}/kernels_${simd}.cpp)
    configure_file(${PROJECT_SOURCE_DIR}/cmake/kernels_target.cpp.in ${out} @ONLY)
    target_sources(${target} PRIVATE ${out})
    set_source_files_properties(${out} PROPERTIES COMPILE_OPTIONS "${flags_${simd}}")
  endforeach()
  string(REPLACE "\\n" "\n" CIERA_KERNEL_EXTERNS "${CIERA_KERNEL_EXTERNS}")
  list(JOIN pointers ", " CIERA_KERNEL_POINTERS)
  set(registry ${CMAKE_BINARY_DIR}/generated/${layer}/kernels_registry.cpp)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/kernels_registry.cpp.in ${registry} @ONLY)
  target_sources(${target} PRIVATE ${registry})
endfunction()

# An include that climbs out of its folder ("../codec/wire.hpp") would find a file the include
# root hides; none is allowed in src/.
function(_ciera_no_relative_includes layer)
  file(GLOB_RECURSE files ${PROJECT_SOURCE_DIR}/src/${layer}/*.hpp ${PROJECT_SOURCE_DIR}/src/${layer}/*.cpp
                          ${PROJECT_SOURCE_DIR}/src/${layer}/*.inc)
  foreach(file IN LISTS files)
    file(STRINGS ${file} climbing REGEX "^[ \t]*#[ \t]*include[ \t]*\"\\.\\./")
    if(climbing)
      message(FATAL_ERROR "${file}: an #include with \"../\" reaches past the layer's include root")
    endif()
  endforeach()
endfunction()
