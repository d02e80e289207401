// In-process transport: ranks are threads of one process. For tests and single-process demos.
#pragma once

#include <memory>

#include "ciera/memory.hpp"
#include "ciera/transport.hpp"

namespace ciera {

class LoopbackWorld;

// Creates the shared state for `size` thread-ranks; each thread then takes its own transport
// with make_loopback_transport(world, rank).
std::shared_ptr<LoopbackWorld> make_loopback_world(int size);
// `memory` moves the bytes (every buffer a rank passes is that memory, or host memory): host
// memory by default; a GPU's (ciera::cuda::codec_backend(d)->memory()) makes a loopback of ranks
// on one device. It must outlive the transport. Throws ConfigError for a rank outside the world
// or one that has a transport already (until that one is destroyed).
std::unique_ptr<Transport> make_loopback_transport(std::shared_ptr<LoopbackWorld> world, int rank,
                                                   const MemoryOps& memory = host_memory_ops());

}  // namespace ciera
