// fuzz_device_decode: fuzz_payload's stream of payloads (payload_stream.hpp), decoded by the CPU
// decoder and, beside it, by the GPU decoder's steps run on the host (codec/device_decode.hpp via
// its emulation): both must accept and refuse the same payloads, reconstruct the same bytes and
// hold the same cache, and a refused payload must leave the device cache as it was. Under
// AddressSanitizer this also checks that no step reads or writes outside its buffers, for any
// input: the host's counterpart of compute-sanitizer on the kernels.
#pragma once

#include <cstdlib>
#include <span>
#include <vector>

#include "codec/device_decode_emulation.hpp"
#include "payload_stream.hpp"

namespace ciera::fuzz {

class DeviceCheckingReceiver {
 public:
  DeviceCheckingReceiver(const uint8_t* input, size_t size)
      : cpu_(input, size),
        device_(cpu_.receiver().config, cpu_.receiver().num_values, cpu_.receiver().identity),
        out_(cpu_.shard().size()) {}

  bool receive(std::span<const std::byte> payload) {
    const std::vector<uint8_t> cache(device_.cache().begin(), device_.cache().end());
    const bool cpu_ok = cpu_.receive(payload);
    const uint32_t status = device_.decode(
        {reinterpret_cast<const uint8_t*>(payload.data()), payload.size()}, out_);
    const bool device_ok = status == codec::device::kOk;
    if (cpu_ok != device_ok) std::abort();  // the decoders disagree about this payload
    if (device_ok) {
      const auto shard = cpu_.shard();
      if (!std::equal(out_.begin(), out_.end(), reinterpret_cast<const uint8_t*>(shard.data()))) {
        std::abort();  // different bytes reconstructed
      }
      const auto cpu_cache = cpu_.decoder().cached_exponents();
      if (!std::equal(cpu_cache.begin(), cpu_cache.end(), device_.cache().begin())) std::abort();
    } else {
      if (!std::equal(cache.begin(), cache.end(), device_.cache().begin())) std::abort();
      device_.request_resync();  // as the CPU receiver does after a refusal
    }
    return cpu_ok;
  }

  std::span<std::byte> shard() { return cpu_.shard(); }

 private:
  StreamReceiver cpu_;
  codec::device::EmulatedDecoder device_;
  std::vector<uint8_t> out_;
};

}  // namespace ciera::fuzz
