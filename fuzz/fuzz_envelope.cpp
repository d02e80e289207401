// Feeds arbitrary bytes to rank 0 of a two-rank engine as the rounds rank 1 sends it: control
// records and envelopes, received through the engine's own checks and the receiver's
// ShardDecoders (envelope_receiver.hpp). The corpus (fuzz/corpus/fuzz_envelope/, written by
// make_corpus) holds real rounds: raw envelopes, key frames, unchanged, fine and block deltas, a
// cold restart, a peer ahead, several buckets. Must not crash, hang, read outside an envelope or
// write outside rank 1's part of the output.
#include <cstddef>
#include <cstdint>

#include "envelope_receiver.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciera::fuzz::receive_rounds(data, size);
  return 0;
}
