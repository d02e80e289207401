// The host codec backend (include/ciera/backend.hpp): host memory and the CPU shard coders.
#include <stdexcept>
#include <string>

#include "ciera/backend.hpp"
#include "codec/peer_coders.hpp"

namespace ciera {

bool CodecBackend::codes(StreamKind kind) const {
  return kind == StreamKind::kExponentReuse || kind == StreamKind::kValueDelta;
}

std::unique_ptr<InputFence> CodecBackend::fence(uintptr_t stream) const {
  if (stream == 0) return nullptr;
  throw std::invalid_argument("start: the " + std::string(name()) +
                              " codec backend has no streams to wait on (pass stream 0)");
}

namespace {

class HostEncoder final : public PayloadEncoder {
 public:
  HostEncoder(const CodecConfig& config, uint64_t n, StreamIdentity id) : coder_(config, n, id) {}
  uint64_t encode(const std::byte* shard, uint64_t shard_bytes, std::byte* payload) override {
    return coder_.encode({shard, shard_bytes}, {payload, coder_.max_payload_bytes()}).payload_bytes;
  }
  void request_key_frame() override { coder_.request_key_frame(); }
  uint32_t epoch() const override { return coder_.epoch(); }
  size_t max_payload_bytes() const override { return coder_.max_payload_bytes(); }
  size_t cache_bytes() const override { return coder_.cache_bytes(); }

 private:
  ShardEncoder coder_;
};

class HostDecoder final : public PayloadDecoder {
 public:
  HostDecoder(const CodecConfig& config, uint64_t n, StreamIdentity id) : coder_(config, n, id) {}
  void decode(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
              uint64_t shard_bytes) override {
    coder_.decode({payload, payload_bytes}, {shard, shard_bytes});
  }
  void request_resync() override { coder_.request_resync(); }
  uint32_t epoch() const override { return coder_.epoch(); }
  size_t cache_bytes() const override { return coder_.cache_bytes(); }

 private:
  ShardDecoder coder_;
};

class HostBackend final : public CodecBackend {
 public:
  std::string_view name() const override { return "host"; }
  const MemoryOps& memory() const override { return host_memory_ops(); }
  bool host_memory() const override { return true; }
  bool codes(StreamKind kind) const override {
    return CodecBackend::codes(kind) || is_peer_stream(kind);
  }
  std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& config, uint64_t n,
                                               StreamIdentity id) const override {
    if (is_peer_stream(config.stream_kind)) return make_peer_encoder(config, n, id);
    return std::make_unique<HostEncoder>(config, n, id);
  }
  std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& config, uint64_t n,
                                               StreamIdentity id) const override {
    if (is_peer_stream(config.stream_kind)) return make_peer_decoder(config, n, id);
    return std::make_unique<HostDecoder>(config, n, id);
  }
};

}  // namespace

std::shared_ptr<const CodecBackend> host_codec_backend() {
  static const auto backend = std::make_shared<const HostBackend>();
  return backend;
}

}  // namespace ciera
