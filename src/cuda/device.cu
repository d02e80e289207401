// Whether this process can run the CUDA kernels (include/ciera/cuda.hpp).
#include <cuda_runtime.h>

#include <string>

#include "ciera/cuda.hpp"

namespace ciera::cuda {

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
  return true;
}

}  // namespace ciera::cuda
