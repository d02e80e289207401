// NCCL transport (library target ciera::nccl, built with the CUDA codec when nccl.h is found;
// src/comm/nccl/README.md). It loads libnccl.so.2 when first needed rather than linking it, so
// that inside a PyTorch process it uses the NCCL torch already loaded; CIERA_NCCL_LIBRARY names
// another file. Collectives are enqueued on a stream of the transport's own and polled against
// the timeout: a dead or stalled peer is a CommError on every surviving rank, never a hang.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "ciera/transport.hpp"

namespace ciera::nccl {

// An ncclUniqueId: made by one rank (make_unique_id), copied to every other rank by any means
// (a file, MPI, torch.distributed's store), then passed by all to make_transport.
struct UniqueId {
  std::array<std::byte, 128> bytes{};
};

// Rank 0's half of the set-up. Throws CommError if NCCL cannot be loaded or fails.
UniqueId make_unique_id();

// Whether NCCL loads (and is new enough) and a CUDA device exists; if not, `why` names
// everything that is missing.
bool available(std::string* why = nullptr);

// The loaded NCCL's version, "2.21.5". Throws CommError if NCCL cannot be loaded.
std::string library_version();

struct Options {
  int device = 0;  // the CUDA device of this rank
  // Longest the set-up, and then each collective (Transport::set_timeout), waits for peers;
  // zero waits forever, a negative timeout is std::invalid_argument.
  std::chrono::milliseconds timeout{120000};
};

// This rank's transport of a communicator of `size` ranks: collective, every rank calls it with
// the same id. Buffers passed to its collectives may be device memory of `options.device` (used
// in place) or anything else (host memory, another device's: staged through a device buffer the
// transport owns). Several ranks on one GPU need NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 in
// the environment before the first communicator is made.
// Throws std::invalid_argument if rank, size or device are out of range or the timeout is
// negative, CommError if NCCL or the device is unusable or the peers do not join within the
// timeout.
std::unique_ptr<Transport> make_transport(const UniqueId& id, int rank, int size,
                                          Options options = {});

}  // namespace ciera::nccl
