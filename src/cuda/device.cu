// Whether this process can run the CUDA kernels (include/ciera/cuda.hpp).
#include <cuda_runtime.h>

#include <string>

#include "ciera/cuda.hpp"

namespace ciera::cuda {
namespace {

// Does nothing; compiled, as every kernel of ciera_cuda, for CMAKE_CUDA_ARCHITECTURES. Where
// the runtime finds no code of it the device can run (neither its machine code nor PTX to
// compile), none of the codec's kernels has any either, and their first launch would fail with
// "no kernel image is available".
__global__ void architecture_probe() {}

}  // namespace

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (why) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(e);
    return false;
  }
  if (count == 0) {
    if (why) *why = "no CUDA device";
    return false;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    if (why) *why = "cannot query the CUDA device";
    return false;
  }
  if (prop.major < 8) {
    if (why) {
      *why = std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
             std::to_string(prop.minor) + ") is older than sm_80, the oldest this build targets";
    }
    return false;
  }
  // A build for other architectures only (CIERA_CUDA_ARCHITECTURES=90-real, as scripts/test.sh
  // sets without a GPU) has no code for an sm_80 card: ask the runtime for a kernel's attributes,
  // which loads its code for this device (or fails) without running anything.
  cudaFuncAttributes attributes{};
  if (const cudaError_t loaded = cudaFuncGetAttributes(&attributes, architecture_probe);
      loaded != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no status for a later launch check
    if (why) {
      const std::string number = std::to_string(prop.major) + std::to_string(prop.minor);
      const std::string device_name = std::string(prop.name) + " (sm_" + number + ")";
      if (loaded == cudaErrorInvalidDeviceFunction || loaded == cudaErrorNoKernelImageForDevice) {
        *why = device_name + ": this build has no code for sm_" + number +
               " (rebuild with CIERA_CUDA_ARCHITECTURES, or CMAKE_CUDA_ARCHITECTURES, naming it: " +
               number + "-real)";
      } else {
        *why = "cannot load this build's kernels on " + device_name + ": " +
               cudaGetErrorString(loaded);
      }
    }
    return false;
  }
  return true;
}

}  // namespace ciera::cuda
