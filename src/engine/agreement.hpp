// Configuration agreement: at construction every rank describes what it will gather and how,
// and all ranks check that the descriptions are identical before the first gather, so that a
// mismatch is one clear error on every rank instead of garbled payloads or a hang later.
#pragma once

#include <string>
#include <vector>

#include "ciera/engine.hpp"
#include "ciera/transport.hpp"

namespace ciera {

// Exchanges every rank's description of `config` and `buckets` (two collectives on `transport`);
// throws ConfigError, with the same text on every rank, if any rank's `local_error` is non-empty
// (naming that rank) or any fact differs between ranks (naming the fact and which ranks hold
// which value).
void agree_on_configuration(Transport& transport, const EngineConfig& config,
                            const std::vector<BucketLayout>& buckets,
                            const std::string& local_error);

}  // namespace ciera
