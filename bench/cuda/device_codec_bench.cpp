#include "device_codec_bench.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "ciera/codec.hpp"
#include "ciera/cuda.hpp"
#include "ciera/error.hpp"
#include "format/planes.hpp"
#include "trajectory.hpp"

#if defined(CIERA_WITH_NVCOMP)
#include <nvcomp/ans.h>
#endif

namespace ciera::bench {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Seconds between two events recorded around work on one stream.
struct Timer {
  explicit Timer(cudaStream_t s) : stream(s) {
    check(cudaEventCreate(&start), "event");
    check(cudaEventCreate(&stop), "event");
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  void begin() { check(cudaEventRecord(start, stream), "record"); }
  double end() {
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    return ms / 1e3;
  }
  cudaStream_t stream;
  cudaEvent_t start, stop;
};

#if defined(CIERA_WITH_NVCOMP)
// nvCOMP's batched ANS over `bytes` bytes in 64 KiB chunks: one compression and one
// decompression, timed; the round trip checked.
class NvcompAns {
 public:
  NvcompAns(nvcompType_t type, size_t bytes, cudaStream_t stream) : bytes_(bytes), stream_(stream) {
    chunks_ = (bytes + kChunk - 1) / kChunk;
    copts_ = nvcompBatchedANSCompressDefaultOpts;
    copts_.data_type = type;
    size_t ctemp = 0, dtemp = 0;
    if (nvcompBatchedANSCompressGetMaxOutputChunkSize(kChunk, copts_, &max_out_) != nvcompSuccess ||
        nvcompBatchedANSCompressGetTempSize(chunks_, kChunk, copts_, &ctemp, bytes, stream) != nvcompSuccess ||
        nvcompBatchedANSDecompressGetTempSize(chunks_, kChunk, nvcompBatchedANSDecompressDefaultOpts, &dtemp,
                                              bytes, stream) != nvcompSuccess) {
      throw Error("nvCOMP ANS: size queries failed");
    }
    out_ = std::make_unique<DeviceBuffer>(chunks_ * max_out_);
    back_ = std::make_unique<DeviceBuffer>(bytes);
    ctmp_ = std::make_unique<DeviceBuffer>(ctemp);
    dtmp_ = std::make_unique<DeviceBuffer>(dtemp);
    for (auto* b : {&in_ptrs_, &out_ptrs_, &back_ptrs_, &in_sizes_, &out_sizes_, &back_sizes_, &status_}) {
      *b = std::make_unique<DeviceBuffer>(chunks_ * 8);
    }
    std::vector<void*> outs(chunks_), backs(chunks_);
    std::vector<size_t> sizes(chunks_);
    for (size_t c = 0; c < chunks_; ++c) {
      outs[c] = out_->as<uint8_t>() + c * max_out_;
      backs[c] = back_->as<uint8_t>() + c * kChunk;
      sizes[c] = std::min(kChunk, bytes - c * kChunk);
    }
    check(cudaMemcpy(out_ptrs_->p, outs.data(), chunks_ * 8, cudaMemcpyHostToDevice), "H2D");
    check(cudaMemcpy(back_ptrs_->p, backs.data(), chunks_ * 8, cudaMemcpyHostToDevice), "H2D");
    check(cudaMemcpy(in_sizes_->p, sizes.data(), chunks_ * 8, cudaMemcpyHostToDevice), "H2D");
  }

  // Codes `data` (device memory): adds one frame's times and size to `coder`.
  void run(const void* data, DeviceCoder& coder) {
    std::vector<const void*> ins(chunks_);
    for (size_t c = 0; c < chunks_; ++c) ins[c] = static_cast<const uint8_t*>(data) + c * kChunk;
    check(cudaMemcpy(in_ptrs_->p, ins.data(), chunks_ * 8, cudaMemcpyHostToDevice), "H2D");
    Timer t(stream_);
    t.begin();
    if (nvcompBatchedANSCompressAsync(in_ptrs_->as<const void* const>(), in_sizes_->as<const size_t>(), kChunk,
                                      chunks_, ctmp_->p, ctmp_->size, out_ptrs_->as<void* const>(),
                                      out_sizes_->as<size_t>(), copts_, status_->as<nvcompStatus_t>(),
                                      stream_) != nvcompSuccess) {
      throw Error("nvCOMP ANS compression failed to launch");
    }
    coder.encode_s.push_back(t.end());
    t.begin();
    if (nvcompBatchedANSDecompressAsync(out_ptrs_->as<const void* const>(), out_sizes_->as<const size_t>(),
                                        in_sizes_->as<const size_t>(), back_sizes_->as<size_t>(), chunks_,
                                        dtmp_->p, dtmp_->size, back_ptrs_->as<void* const>(),
                                        nvcompBatchedANSDecompressDefaultOpts, status_->as<nvcompStatus_t>(),
                                        stream_) != nvcompSuccess) {
      throw Error("nvCOMP ANS decompression failed to launch");
    }
    coder.decode_s.push_back(t.end());
    std::vector<size_t> sizes(chunks_);
    check(cudaMemcpy(sizes.data(), out_sizes_->p, chunks_ * 8, cudaMemcpyDeviceToHost), "D2H");
    for (size_t s : sizes) coder.wire_bytes += static_cast<double>(s);
    ++coder.frames;
    std::vector<uint8_t> a(bytes_), b(bytes_);
    check(cudaMemcpy(a.data(), data, bytes_, cudaMemcpyDeviceToHost), "D2H");
    check(cudaMemcpy(b.data(), back_->p, bytes_, cudaMemcpyDeviceToHost), "D2H");
    if (a != b) throw Error("nvCOMP ANS round trip differs");
  }

 private:
  static constexpr size_t kChunk = 64 * 1024;
  size_t bytes_, chunks_ = 0, max_out_ = 0;
  cudaStream_t stream_;
  nvcompBatchedANSCompressOpts_t copts_;
  std::unique_ptr<DeviceBuffer> out_, back_, ctmp_, dtmp_, in_ptrs_, out_ptrs_, back_ptrs_, in_sizes_,
      out_sizes_, back_sizes_, status_;
};
#endif

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) : size(bytes) {
  check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
}

DeviceCodecResult measure_device_codec(const DeviceCodecRequest& r) {
  std::string why;
  if (!cuda::device_available(&why)) throw Error(why);
  DeviceCodecResult result;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  result.gpu = prop.name;
  result.values = r.values;
  const uint32_t value_bytes = dtype_info(r.config.dtype).value_bytes;
  result.shard_bytes = r.values * value_bytes;
  result.ciera.name = "ciera-" + std::string(exponent_coding_name(r.config.coding));
  result.key_frames.name = "warmup key frames";

  tools::TrajectoryOptions topts;
  topts.num_values = r.values;
  topts.dtype = r.config.dtype;
  topts.learning_rate = r.learning_rate;
  topts.seed = r.seed;
  tools::AdamTrajectory trajectory(topts);

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  ShardEncoder cpu(r.config, r.values, {1, 7});
  cuda::ShardEncoder encoder(r.config, r.values, {1, 7});
  cuda::ShardDecoder decoder(r.config, r.values, {1, 7});
  DeviceBuffer d_shard(result.shard_bytes), d_copy(result.shard_bytes), d_out(result.shard_bytes),
      d_payload(encoder.max_payload_bytes()), d_length(8), d_exponents(r.values), d_plane(r.values * 3);
  std::vector<std::byte> expected(cpu.max_payload_bytes()), payload, back(result.shard_bytes);
  Timer timer(stream);
#if defined(CIERA_WITH_NVCOMP)
  result.nvcomp_built = true;
  // The paper's stateless peer: every exponent ANS-coded each step, the sign-mantissa plane sent
  // as it is (its bytes are counted in the size, its split is not timed); and ANS on the raw shard.
  result.peers.push_back({"stateless: nvCOMP ANS exponents + plane", {}, {}, 0, 0});
  result.peers.push_back({"nvCOMP ANS on the raw shard", {}, {}, 0, 0});
  const uint64_t plane_bytes = format::SignMantissaLayout(r.config.dtype, r.values).total_bytes();
  NvcompAns ans_exponents(NVCOMP_TYPE_UCHAR, r.values, stream);
  NvcompAns ans_shard(r.config.dtype == DType::kFP32 ? NVCOMP_TYPE_FLOAT32 : NVCOMP_TYPE_FLOAT16,
                      result.shard_bytes, stream);
#endif
  const auto fail = [&](std::string what) {
    if (result.verified) result.failure = std::move(what);
    result.verified = false;
  };
  for (uint32_t step = 0; step < r.steps; ++step) {
    if (r.progress) r.progress(step, r.steps);
    trajectory.step();
    const auto values = trajectory.values();
    check(cudaMemcpy(d_shard.p, values.data(), values.size(), cudaMemcpyHostToDevice), "H2D");
    const uint64_t cpu_bytes = cpu.encode(values, expected).payload_bytes;
    timer.begin();
    encoder.encode(d_shard.p, d_payload.p, d_length.as<uint64_t>(), stream);
    const double encode_s = timer.end();
    const uint64_t bytes = encoder.payload_bytes();
    payload.resize(bytes);
    check(cudaMemcpy(payload.data(), d_payload.p, bytes, cudaMemcpyDeviceToHost), "D2H");
    if (bytes != cpu_bytes || std::memcmp(payload.data(), expected.data(), bytes) != 0) {
      fail("step " + std::to_string(step) + ": the GPU payload differs from the CPU encoder's");
    }
    timer.begin();
    decoder.decode(d_payload.p, bytes, d_out.p, stream);
    const double decode_s = timer.end();
    try {
      decoder.check();
    } catch (const FormatError& e) {
      fail("step " + std::to_string(step) + ": the GPU decoder refused the frame: " + e.what());
    }
    check(cudaMemcpy(back.data(), d_out.p, back.size(), cudaMemcpyDeviceToHost), "D2H");
    if (std::memcmp(back.data(), values.data(), values.size()) != 0) {
      fail("step " + std::to_string(step) + ": the GPU decoder's shard differs from the one sent");
    }
    if (step < r.config.warmup_steps) {
      result.key_frames.wire_bytes += static_cast<double>(bytes);
      ++result.key_frames.frames;
      continue;
    }
    timer.begin();
    check(cudaMemcpyAsync(d_copy.p, d_shard.p, result.shard_bytes, cudaMemcpyDeviceToDevice, stream), "memcpy");
    result.memcpy_s.push_back(timer.end());
    result.ciera.encode_s.push_back(encode_s);
    result.ciera.decode_s.push_back(decode_s);
    result.ciera.wire_bytes += static_cast<double>(bytes);
    ++result.ciera.frames;
#if defined(CIERA_WITH_NVCOMP)
    if ((step - r.config.warmup_steps) % r.nvcomp_every == 0) {
      cuda::split(r.config.dtype, d_shard.p, r.values, d_exponents.as<uint8_t>(), d_plane.as<uint8_t>(), stream);
      check(cudaStreamSynchronize(stream), "split");
      ans_exponents.run(d_exponents.p, result.peers[0]);
      result.peers[0].wire_bytes += static_cast<double>(plane_bytes);
      ans_shard.run(d_shard.p, result.peers[1]);
    }
#endif
  }
  cudaStreamDestroy(stream);
  return result;
}

}  // namespace ciera::bench
