// Decodes the fuzz input as a stream of CIERA payloads from one sender, fed to the decoder as is
// (payload_stream.hpp): the committed corpus (fuzz/corpus/fuzz_payload/, written by
// make_corpus) holds real streams of every frame kind, exponent section and dtype.
//
// Checksums would stop almost every mutation at the first check, so two of them are re-sealed:
//  * the header checksum, by the mutator, on every payload of 15 mutations in 16 (the 16th keeps
//    the checksum check itself covered): a mutated header field reaches the field checks, and
//    every input the fuzzer keeps or reports is decoded here exactly as it is;
//  * the content checksum, here: a sealed payload that fails to decode, carries a content
//    checksum and was reconstructed to other values (the decoder merges before it verifies:
//    docs/format.md, "Integrity") is decoded once more with the checksum of those values, so that a
//    mutated section's values reach the cache and the frames after it decode against them. Done
//    here rather than in the mutator so that a crash on the way is reported with its input.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "payload_stream.hpp"
#if defined(CIERA_FUZZ_DEVICE_DECODER)
#include "device_stream.hpp"  // fuzz_device_decode: the same inputs, the GPU decoder's steps beside
using StreamUnderTest = ciera::fuzz::DeviceCheckingReceiver;
#else
using StreamUnderTest = ciera::fuzz::StreamReceiver;
#endif

namespace {

using ciera::fuzz::Part;

// Whether the payload's header is sealed and announces a content checksum: only then can the
// decoder have got as far as the checksum.
bool sealed_with_content_checksum(std::span<const std::byte> payload) {
  if (payload.size() < ciera::wire::kHeaderBytes) return false;
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  return (ciera::load_le16(p + ciera::fuzz::kFlagsAt) & ciera::wire::kFlagContentChecksum) != 0 &&
         ciera::load_le32(p + ciera::fuzz::kHeaderChecksumAt) ==
             static_cast<uint32_t>(ciera::checksum64(p, ciera::fuzz::kHeaderChecksumAt));
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if (std::minstd_rand(seed)() % 16 == 0) return size;
  for (const Part& part : ciera::fuzz::split_payloads(data, size)) {
    if (part.bytes >= ciera::wire::kHeaderBytes) ciera::fuzz::reseal_header(data + part.offset);
  }
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  StreamUnderTest receiver(data, size);
  std::vector<std::byte> resealed;
  for (const Part& part : ciera::fuzz::split_payloads(data, size)) {
    const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data) + part.offset,
                                             part.bytes);
    if (receiver.receive(payload) || !sealed_with_content_checksum(payload)) continue;
    const auto shard = receiver.shard();
    const uint64_t reconstructed = ciera::content_checksum64(shard.data(), shard.size());
    auto* p = reinterpret_cast<const uint8_t*>(payload.data());
    if (ciera::load_le64(p + ciera::fuzz::kContentChecksumAt) == reconstructed) continue;
    resealed.assign(payload.begin(), payload.end());
    auto* q = reinterpret_cast<uint8_t*>(resealed.data());
    ciera::store_le64(q + ciera::fuzz::kContentChecksumAt, reconstructed);
    ciera::fuzz::reseal_header(q);
    receiver.receive(resealed);
  }
  return 0;
}
