# The layering the build enforces (cmake/CieraLayers.cmake), checked from outside: each line of
# the table compiles a one-line file against a layer's include root and expects it to compile
# (an include the layer may make) or to fail with "No such file" (an upward or sideways include).
# Run by ctest as: cmake -DCXX=... -DROOTS=<build>/layers -DWORK=<dir> -P check_layers.cmake
set(allowed
  "format:format/planes.hpp" "format:common/bits.hpp" "format:ciera/dtype.hpp"
  "entropy:entropy/rans.hpp" "entropy:common/bytes.hpp"
  "codec:codec/wire.hpp" "codec:format/planes.hpp" "codec:entropy/symbol_stream.hpp" "codec:ciera/codec.hpp"
  "engine:ciera/engine.hpp" "engine:codec/wire.hpp" "engine:ciera/transport.hpp"
  "selection:ciera/selection.hpp" "selection:ciera/codec.hpp" "selection:format/planes.hpp"
  "analysis:ciera/analysis.hpp" "analysis:format/planes.hpp"
  "comm:ciera/transport.hpp" "sim:sim/sim.hpp" "sim:ciera/selection.hpp"
  "collectives:ciera/collectives.hpp" "collectives:codec/wire.hpp" "collectives:common/adaptive_switch.hpp")
set(forbidden
  "common:format/planes.hpp" "common:ciera/codec.hpp"
  "format:codec/wire.hpp" "format:entropy/rans_core.hpp" "format:ciera/codec.hpp"
  "entropy:format/planes.hpp" "entropy:codec/wire.hpp"
  "codec:ciera/engine.hpp" "codec:engine/scheduler.hpp" "codec:ciera/selection.hpp" "codec:ciera/transport.hpp"
  "engine:ciera/selection.hpp" "engine:selection/selector.cpp"
  "selection:ciera/engine.hpp" "selection:engine/scheduler.hpp"
  "comm:codec/wire.hpp" "comm:ciera/engine.hpp"
  "analysis:codec/wire.hpp" "analysis:entropy/rans.hpp" "analysis:ciera/selection.hpp"
  "sim:ciera/engine.hpp"
  "collectives:ciera/engine.hpp" "collectives:engine/scheduler.hpp" "collectives:ciera/selection.hpp"
  "engine:ciera/collectives.hpp" "engine:collectives/reduction.hpp")
# The CUDA layer (src/cuda) sits on codec, beside engine and selection; its root exists when the
# build found nvcc.
if(EXISTS ${ROOTS}/cuda)
  list(APPEND allowed "cuda:ciera/cuda.hpp" "cuda:codec/wire.hpp" "cuda:entropy/rans_segment.hpp")
  list(APPEND forbidden "cuda:ciera/engine.hpp" "cuda:engine/scheduler.hpp" "cuda:ciera/transport.hpp")
endif()

file(MAKE_DIRECTORY ${WORK})
set(failures 0)
function(try_include layer header expect_ok)
  set(probe ${WORK}/probe.cpp)
  file(WRITE ${probe} "#include \"${header}\"\n")
  execute_process(COMMAND ${CXX} -std=c++20 -fsyntax-only -I${ROOTS}/${layer} ${probe}
                  RESULT_VARIABLE status ERROR_VARIABLE errors OUTPUT_QUIET)
  if(expect_ok AND NOT status EQUAL 0)
    message(SEND_ERROR "layer ${layer} should see ${header}, but:\n${errors}")
  elseif(NOT expect_ok AND status EQUAL 0)
    message(SEND_ERROR "layer ${layer} can include ${header}: an upward include compiles")
  elseif(NOT expect_ok AND NOT errors MATCHES "No such file")
    message(SEND_ERROR "layer ${layer} including ${header} failed for another reason:\n${errors}")
  else()
    message(STATUS "${layer} -> ${header}: ${expect_ok}")
  endif()
endfunction()
foreach(expect_ok TRUE FALSE)
  if(expect_ok)
    set(table ${allowed})
  else()
    set(table ${forbidden})
  endif()
  foreach(pair IN LISTS table)
    string(REPLACE ":" ";" parts ${pair})
    list(GET parts 0 layer)
    list(GET parts 1 header)
    try_include(${layer} ${header} ${expect_ok})
  endforeach()
endforeach()
