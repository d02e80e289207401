// Configuration agreement: at construction every rank describes what it will gather and how,
// and all ranks check that the descriptions are identical before the first gather, so that a
// mismatch is one clear error on every rank instead of garbled payloads or a hang later.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ciera/engine.hpp"
#include "ciera/transport.hpp"

namespace ciera {

// Agrees every rank's description of `config` and `buckets`: two collectives of 8 and 32 bytes
// per rank on `transport` where they match, a third of the differing descriptions where not
// (docs/format.md, "Engine protocol"); throws ConfigError, with the same text on every rank, if
// any rank's `local_error` is non-empty (naming that rank) or any fact differs between ranks
// (naming the fact and which ranks hold which value).
void agree_on_configuration(Transport& transport, const EngineConfig& config,
                            const std::vector<BucketLayout>& buckets,
                            const std::string& local_error);

// Every rank's stream epoch for this engine (one collective): each rank draws its own
// (new_stream_epoch()), so that no payload of an earlier engine — a restarted job — can pass for
// one of this engine's streams (docs/format.md, "Streams"). Returns them in rank order.
std::vector<uint32_t> exchange_stream_epochs(Transport& transport, uint32_t mine);

// After each rank has made its buckets' codec state (memory that one rank may lack alone):
// whether every rank could (one small collective; a second, of the texts, where one could not).
// Throws ConfigError on every rank, naming the lowest rank that failed and its `local_error`:
// thrown on that rank alone, its peers would wait for it in their first gather until the
// timeout.
void agree_on_set_up(Transport& transport, const std::string& local_error);

}  // namespace ciera
