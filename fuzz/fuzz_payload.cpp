// Decodes the fuzz input as a stream of CIERA payloads from one sender, fed to the decoder as is
// (payload_stream.hpp): the committed corpus (fuzz/corpus/fuzz_payload/, written by
// make_corpus) holds real streams of every frame kind, exponent section and dtype.
//
// The mutator re-seals what a mutation broke, so that mutations reach the decoder's field and
// section checks instead of stopping at a checksum: the header checksum of every payload always
// (but for one mutation in 16, which keeps the checksum checks covered), and on every other
// mutation the content checksum of each payload whose reconstruction no longer matches it.
// Because the mutator does the re-sealing, every input the fuzzer keeps or reports decodes here
// exactly as it is.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>

#include "payload_stream.hpp"

namespace {

using ciera::fuzz::Part;

// Re-seals the content checksum of each payload that failed to decode, from the values the
// decoder reconstructed (it merges before it verifies: docs/format.md, "Integrity"), and keeps
// the new checksum if the payload then decodes. Decodes as the target does, so that the
// decoder's state before each payload is the target's.
void reseal_content(uint8_t* data, size_t size, const std::vector<Part>& parts) {
  ciera::fuzz::StreamReceiver receiver(data, size);
  for (const Part& part : parts) {
    uint8_t* p = data + part.offset;
    const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(p), part.bytes);
    if (receiver.receive(payload)) continue;
    if (part.bytes < ciera::wire::kHeaderBytes ||
        (ciera::load_le16(p + ciera::fuzz::kFlagsAt) & ciera::wire::kFlagContentChecksum) == 0) {
      continue;
    }
    uint8_t header[ciera::wire::kHeaderBytes];
    std::memcpy(header, p, sizeof header);
    const auto shard = receiver.shard();
    ciera::store_le64(p + ciera::fuzz::kContentChecksumAt,
                      ciera::checksum64(shard.data(), shard.size()));
    ciera::fuzz::reseal_header(p);
    if (!receiver.receive(payload)) std::memcpy(p, header, sizeof header);
  }
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  std::minstd_rand random(seed);
  if (random() % 16 == 0) return size;
  const std::vector<Part> parts = ciera::fuzz::split_payloads(data, size);
  for (const Part& part : parts) {
    if (part.bytes >= ciera::wire::kHeaderBytes) ciera::fuzz::reseal_header(data + part.offset);
  }
  if (random() % 2 == 0) reseal_content(data, size, parts);
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciera::fuzz::StreamReceiver receiver(data, size);
  for (const Part& part : ciera::fuzz::split_payloads(data, size)) {
    receiver.receive({reinterpret_cast<const std::byte*>(data) + part.offset, part.bytes});
  }
  return 0;
}
