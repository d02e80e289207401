// In-process transport: ranks are threads of one process. For tests and single-process demos.
#pragma once

#include <memory>

#include "ciera/transport.hpp"

namespace ciera {

class LoopbackWorld;

// Creates the shared state for `size` thread-ranks; each thread then takes its own transport
// with make_loopback_transport(world, rank).
std::shared_ptr<LoopbackWorld> make_loopback_world(int size);
std::unique_ptr<Transport> make_loopback_transport(std::shared_ptr<LoopbackWorld> world, int rank);

}  // namespace ciera
