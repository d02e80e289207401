# find_package(ciera) from outside the tree, as a C++ user meets it: installs the build under test
# into a prefix of its own, configures and builds examples/ (the README's programs) against that
# prefix alone, and runs them: the codec round trip, and on two MPI ranks (where the build has
# ciera::mpi) the engine and the lossless reduce-scatter. Then compiles each installed header on
# its own, checks the version file (find_package(ciera <major>.<minor>) takes this package, a later
# version does not) and runs the installed tool. Run by ctest as
#   cmake -DBUILD=<build> -DEXAMPLES=<examples> -DWORK=<dir> -DGENERATOR=... -DCXX=...
#         -DMPIRUN=<mpirun;args> -P consumer.cmake
file(REMOVE_RECURSE ${WORK})

# Each step within 240 s, so that a hung mpirun is ended here (ctest's own limit would leave
# the ranks behind).
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 240)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${what} failed (${status}):\n${out}\n${err}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD} --prefix ${WORK}/prefix)
step("configuring examples/ against the install"
     ${CMAKE_COMMAND} -S ${EXAMPLES} -B ${WORK}/build -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
     -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     -DCMAKE_CXX_FLAGS=-Werror)
step("building examples/" ${CMAKE_COMMAND} --build ${WORK}/build)

# The version file: examples/ asks for 0.1; a later minor or another major version must not be
# taken for this package (SameMinorVersion: before 1.0 a minor version may break its users).
load_cache(${BUILD} READ_WITH_PREFIX built_ CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_BINDIR CMAKE_INSTALL_DATADIR
           CMAKE_INSTALL_DATAROOTDIR CIERA_BUILD_TOOLS CIERA_CUDA_ONLY CMAKE_PROJECT_VERSION)
set(version_file ${WORK}/prefix/${built_CMAKE_INSTALL_LIBDIR}/cmake/ciera/cieraConfigVersion.cmake)
if(NOT EXISTS ${version_file})
  message(FATAL_ERROR "the install has no version file (${version_file}): find_package(ciera 0.1) cannot work")
endif()
file(STRINGS ${version_file} version_line REGEX "^set\\(PACKAGE_VERSION ")
if(NOT version_line MATCHES "\"(([0-9]+)\\.([0-9]+)\\.[0-9]+)\"")
  message(FATAL_ERROR "no version in ${version_file}: ${version_line}")
endif()
set(version ${CMAKE_MATCH_1})
set(major ${CMAKE_MATCH_2})
set(minor ${CMAKE_MATCH_3})
if(NOT version STREQUAL built_CMAKE_PROJECT_VERSION)
  message(FATAL_ERROR "the installed version file says ${version}, the build is ${built_CMAKE_PROJECT_VERSION}")
endif()
math(EXPR next_minor "${minor} + 1")
math(EXPR next_major "${major} + 1")
# A later minor and a later major are refused by any compatibility mode; an earlier minor is what
# SameMinorVersion refuses and SameMajorVersion would take.
set(refused ${major}.${next_minor} ${next_major}.0)
if(minor GREATER 0)
  math(EXPR previous_minor "${minor} - 1")
  list(APPEND refused ${major}.${previous_minor})
endif()
file(WRITE ${WORK}/versions/CMakeLists.txt "cmake_minimum_required(VERSION 3.22)
project(versions LANGUAGES CXX)
foreach(request ${refused})
  find_package(ciera \${request} QUIET)
  if(ciera_FOUND)
    message(FATAL_ERROR \"find_package(ciera \${request}) took version \${ciera_VERSION}\")
  endif()
endforeach()
find_package(ciera ${major}.${minor} REQUIRED)
if(NOT ciera_VERSION STREQUAL \"${version}\")
  message(FATAL_ERROR \"find_package(ciera) gave version \${ciera_VERSION}, the version file says ${version}\")
endif()
")
step("find_package(ciera <version>) against the version file"
     ${CMAKE_COMMAND} -S ${WORK}/versions -B ${WORK}/versions/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)

# A consumer of the core library alone needs neither MPI nor the CUDA toolkit: with both hidden,
# find_package(ciera) still gives ciera::ciera (and examples/ builds without its MPI programs);
# asked for the mpi component, it fails, saying why.
step("configuring examples/ with MPI and the CUDA toolkit hidden"
     ${CMAKE_COMMAND} -S ${EXAMPLES} -B ${WORK}/core-only -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
     -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
step("building the core-only examples/" ${CMAKE_COMMAND} --build ${WORK}/core-only --target codec_roundtrip)
file(WRITE ${WORK}/wants-mpi/CMakeLists.txt "cmake_minimum_required(VERSION 3.22)
project(wants_mpi LANGUAGES CXX)
find_package(ciera REQUIRED COMPONENTS mpi)
")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK}/wants-mpi -B ${WORK}/wants-mpi/build -G ${GENERATOR}
                        -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
                        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
if(status EQUAL 0 OR NOT err MATCHES "component mpi: ")
  message(FATAL_ERROR "find_package(ciera REQUIRED COMPONENTS mpi) without MPI did not fail naming why "
                      "(${status}):\n${out}\n${err}")
endif()

# Without the xxHash library (its folder hidden) the package is not found: a QUIET search goes on
# with ciera_FOUND false, a REQUIRED one fails naming xxHash; neither stops at an internal path.
load_cache(${BUILD} READ_WITH_PREFIX built_ CIERA_XXHASH_LIBRARY)
if(built_CIERA_XXHASH_LIBRARY)  # not when the build compiled xxHash from its header
  # Its folder under every name (/lib is /usr/lib on a merged /usr).
  get_filename_component(xxhash_dir ${built_CIERA_XXHASH_LIBRARY} DIRECTORY)
  string(REGEX REPLACE "^/usr/" "/" xxhash_dir_merged ${xxhash_dir})
  foreach(mode QUIET REQUIRED)
    file(WRITE ${WORK}/no-xxhash-${mode}/CMakeLists.txt "cmake_minimum_required(VERSION 3.22)
project(no_xxhash LANGUAGES CXX)
set(CMAKE_IGNORE_PATH ${xxhash_dir} ${xxhash_dir_merged})
find_package(ciera ${mode})
if(ciera_FOUND)
  message(FATAL_ERROR \"ciera found without the xxHash library\")
endif()
")
    execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK}/no-xxhash-${mode} -B ${WORK}/no-xxhash-${mode}/build
                            -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
                            -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
                    RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
    if(mode STREQUAL "QUIET" AND NOT status EQUAL 0)
      message(FATAL_ERROR "find_package(ciera QUIET) without xxHash stopped the configure:\n${out}\n${err}")
    endif()
    if(mode STREQUAL "REQUIRED" AND (status EQUAL 0 OR NOT err MATCHES "ciera needs the xxHash library"))
      message(FATAL_ERROR "find_package(ciera REQUIRED) without xxHash did not fail naming it "
                          "(${status}):\n${out}\n${err}")
    endif()
  endforeach()
endif()

# Every installed header compiles on its own, with only the include paths its targets export.
file(GLOB headers RELATIVE ${WORK}/prefix/include ${WORK}/prefix/include/ciera/*.hpp)
set(sources "")
foreach(header IN LISTS headers)
  string(MAKE_C_IDENTIFIER ${header} name)
  file(WRITE ${WORK}/headers/${name}.cpp "#include <${header}>\n")
  list(APPEND sources ${name}.cpp)
endforeach()
file(WRITE ${WORK}/headers/CMakeLists.txt "cmake_minimum_required(VERSION 3.22)
project(ciera_headers LANGUAGES CXX)
find_package(ciera REQUIRED)
add_library(headers OBJECT ${sources})
# ciera::ciera's exported include path as this project's own (-I): through the imported target it
# would be -isystem, where no warning in an installed header could fail the build. mpi.h stays a
# system header (MPI::MPI_CXX), as Open MPI's own warnings are not ours.
get_target_property(includes ciera::ciera INTERFACE_INCLUDE_DIRECTORIES)
target_include_directories(headers PRIVATE \${includes})
target_compile_features(headers PRIVATE cxx_std_20)
if(TARGET ciera::mpi)
  target_link_libraries(headers PRIVATE MPI::MPI_CXX)
endif()
target_compile_options(headers PRIVATE -Wall -Wextra -Wshadow -Werror)
")
step("configuring a project of one file per installed header"
     ${CMAKE_COMMAND} -S ${WORK}/headers -B ${WORK}/headers/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
step("compiling each installed header on its own" ${CMAKE_COMMAND} --build ${WORK}/headers/build)

step("codec_roundtrip" ${WORK}/build/codec_roundtrip)
message(STATUS "${output}")
if(NOT output MATCHES "every one bitwise exact")
  message(FATAL_ERROR "codec_roundtrip did not report every step exact:\n${output}")
endif()

# The installed tool runs from the prefix, names this version, and its codec bench verifies.
if(built_CIERA_BUILD_TOOLS AND NOT built_CIERA_CUDA_ONLY)
  set(tool ${WORK}/prefix/${built_CMAKE_INSTALL_BINDIR}/ciera)
  if(NOT EXISTS ${tool})
    message(FATAL_ERROR "the build has the tool (CIERA_BUILD_TOOLS), but its install has no ${tool}")
  endif()
  # GNUInstallDirs caches DATADIR empty, meaning DATAROOTDIR.
  if(NOT built_CMAKE_INSTALL_DATADIR)
    set(built_CMAKE_INSTALL_DATADIR ${built_CMAKE_INSTALL_DATAROOTDIR})
  endif()
  foreach(script linklab.sh linklab-agent.sh)  # what `--link-gbit` runs, found beside the tool
    if(NOT EXISTS ${WORK}/prefix/${built_CMAKE_INSTALL_DATADIR}/ciera/${script})
      message(FATAL_ERROR "the install has the tool but not the link lab's ${script} in "
                          "${built_CMAKE_INSTALL_DATADIR}/ciera (the tool would look in the build's sources)")
    endif()
  endforeach()
  # The tool finds the lab where it was installed: a stand-in lab there answers for it (77, the
  # lab's refusal, which the tool passes on), not the build's sources.
  file(WRITE ${WORK}/prefix/${built_CMAKE_INSTALL_DATADIR}/ciera/linklab.sh
       "#!/bin/sh\necho \"the installed link lab ran\" >&2\nexit 77\n")
  file(CHMOD ${WORK}/prefix/${built_CMAKE_INSTALL_DATADIR}/ciera/linklab.sh
       PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=CIERA_LINKLAB
                          ${tool} bench allgather --ranks 2 --link-gbit 1 --quiet
                  RESULT_VARIABLE lab_status ERROR_VARIABLE lab_output OUTPUT_QUIET)
  if(NOT lab_status EQUAL 77 OR NOT lab_output MATCHES "the installed link lab ran")
    message(FATAL_ERROR "the installed tool did not run the installed link lab (status ${lab_status}):\n"
                        "${lab_output}")
  endif()
  step("ciera --version (installed)" ${tool} --version)
  if(NOT output MATCHES "^ciera ${version} \\(commit ")
    message(FATAL_ERROR "the installed tool did not name version ${version}:\n${output}")
  endif()
  step("ciera bench codec (installed)" ${tool} bench codec --values 4096 --steps 4 --warmup 1 --json --quiet)
  if(NOT output MATCHES "\"verified\": true" OR output MATCHES "\"verified\": false")
    message(FATAL_ERROR "the installed tool's codec bench did not verify every row:\n${output}")
  endif()
endif()

if(MPIRUN)
  foreach(example "mpi_allgather:MPI_Allgatherv" "mpi_reduce_scatter:the raw twin")
    string(REPLACE ":" ";" example "${example}")
    list(GET example 0 program)
    list(GET example 1 reference)
    if(NOT EXISTS ${WORK}/build/${program})
      message(FATAL_ERROR "the build has ciera::mpi, but examples/ built no ${program} against its install")
    endif()
    step("${program} on two ranks" ${MPIRUN} -np 2 ${WORK}/build/${program})
    message(STATUS "${output}")
    if(NOT output MATCHES "every one identical to ${reference}")
      message(FATAL_ERROR "${program} did not report every result identical to ${reference}:\n${output}")
    endif()
  endforeach()
endif()
file(REMOVE_RECURSE ${WORK})
