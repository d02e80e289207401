# find_package(ciera) from outside the tree, as a C++ user meets it: installs the build under test
# into a prefix of its own, configures and builds examples/ (the README's programs) against that
# prefix alone, and runs them: the codec round trip, and on two MPI ranks (where the build has
# ciera::mpi) the engine and the lossless reduce-scatter. Then compiles each installed header on
# its own. Run by ctest as
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
