// The GPU codec's building blocks (include/ciera/cuda.hpp) against the CPU codec, on a device:
// every byte the kernels write must equal the CPU's. Without a usable device every test is
// reported skipped (GTEST_SKIP, which ctest shows as "Skipped"), never passed.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "ciera/cuda.hpp"
#include "cuda/cuda_test_util.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "entropy/rans.hpp"
#include "entropy/symbol_stream.hpp"
#include "format/planes.hpp"
#include "test_util.hpp"

namespace ciera::cuda {
namespace {

using testing::DeviceVector;

void check(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

using ciera::testing::random_bytes;

size_t value_bytes(DType dtype) { return dtype == DType::kFP32 ? 4 : 2; }

TEST(CudaKernels, SplitAndMergeEqualTheCpuPlanesForEveryDtypeAndSize) {
  SKIP_WITHOUT_DEVICE();
  for (const DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (const uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{9}, uint64_t{100003},
                             uint64_t{1} << 24}) {
      const size_t vb = value_bytes(dtype);
      const auto values = random_bytes(n * vb, n);
      const format::SignMantissaLayout layout(dtype, n);
      std::vector<uint8_t> cpu_exps(n), cpu_sm(layout.total_bytes());
      for (uint64_t first = 0; first < n; first += format::kMaxChunkValues) {
        const size_t count = static_cast<size_t>(std::min<uint64_t>(format::kMaxChunkValues, n - first));
        format::split_values(layout, format::kernels(), values.data() + first * vb, first, count,
                             cpu_exps.data() + first, cpu_sm.data());
      }
      DeviceVector<uint8_t> d_values(values), d_exps(n), d_sm(layout.total_bytes()), d_back(n * vb);
      split(dtype, d_values.get(), n, d_exps.get(), d_sm.get(), nullptr);
      merge(dtype, d_exps.get(), d_sm.get(), n, d_back.get(), nullptr);
      check(cudaDeviceSynchronize(), "split/merge");
      const std::string where = std::string(dtype_name(dtype)) + " n " + std::to_string(n);
      EXPECT_EQ(d_exps.host(), cpu_exps) << where;
      EXPECT_EQ(d_sm.host(), cpu_sm) << where;
      EXPECT_EQ(d_back.host(), values) << where;
    }
  }
}

TEST(CudaKernels, ChangedBlocksEqualTheCpuBitmap) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(5);
  for (const uint32_t block : {64u, 512u, 4096u}) {
    for (const uint64_t n : {uint64_t{1}, uint64_t{block} * 37 + 5, uint64_t{1} << 22}) {
      auto before = random_bytes(n, n + block);
      auto now = before;
      for (int k = 0; k < 50; ++k) now[rng() % n] ^= 1;
      const uint64_t blocks = (n + block - 1) / block;
      std::vector<uint8_t> expected((blocks + 7) / 8, 0);
      for (uint64_t i = 0; i < n; ++i) {
        if (now[i] != before[i]) expected[i / block / 8] |= static_cast<uint8_t>(1u << (i / block % 8));
      }
      DeviceVector<uint8_t> d_now(now), d_before(before), d_bitmap(std::vector<uint8_t>(expected.size(), 0xA5));
      changed_blocks(d_now.get(), d_before.get(), n, block, d_bitmap.get(), nullptr);
      check(cudaDeviceSynchronize(), "changed_blocks");
      EXPECT_EQ(d_bitmap.host(), expected) << "B " << block << " n " << n;
    }
  }
}

TEST(CudaKernels, ContentChecksumEqualsTheCpuDefinition) {
  SKIP_WITHOUT_DEVICE();
  for (const uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{16383}, uint64_t{16384},
                           uint64_t{16385}, uint64_t{(1u << 25) + 3}}) {
    const auto data = random_bytes(n, n + 11);
    const uint64_t chunks = checksum_chunks(n);
    DeviceVector<uint8_t> d_data(data), d_scratch(8 * chunks + 1);
    DeviceVector<uint64_t> d_digests(chunks + 1), d_result(1);
    content_checksum(d_data.get(), n, d_digests.get(), d_scratch.get(), d_result.get(), nullptr);
    check(cudaDeviceSynchronize(), "content_checksum");
    EXPECT_EQ(d_result.host()[0], content_checksum64(data.data(), n)) << "bytes " << n;
  }
}

TEST(CudaKernels, RansSegmentsDecodeAsTheCpuEncodedThemAndCorruptionIsCaught) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(9);
  const uint64_t n = 64 * entropy::kRansSegmentSymbols + 777;
  std::vector<uint8_t> symbols(n);
  for (auto& s : symbols) s = static_cast<uint8_t>(118 + (rng() % 16 == 0 ? rng() % 12 : rng() % 3));
  entropy::ArraySource source(symbols);
  std::vector<uint8_t> scratch;
  const auto hist = entropy::histogram_of(source, scratch);
  std::vector<uint8_t> stream(entropy::symbol_stream_bound(n, 8));
  const auto stats = entropy::write_symbol_stream(source, hist, 8, stream.data(), stream.size(), scratch);
  ASSERT_EQ(stats.method, entropy::StreamMethod::kRans);
  stream.resize(stats.bytes);
  ByteReader in(stream.data(), stream.size(), "test");
  in.u8();
  in.u8();
  const uint64_t body = in.u64();
  ByteReader b(in.cursor(), body, "test");
  const auto model = entropy::RansModel::read_table(b, 255, "test");
  const uint64_t count = entropy::rans_segment_count(n);
  const uint8_t* lengths = b.cursor();
  const uint8_t* first = lengths + 4 * (count - 1);
  std::vector<uint64_t> offsets{0};
  for (uint64_t j = 0; j + 1 < count; ++j) offsets.push_back(offsets.back() + load_le32(lengths + 4 * j));
  offsets.push_back(static_cast<uint64_t>(stream.data() + stream.size() - first));
  std::vector<uint32_t> slots(entropy::kRansTotal);
  for (unsigned s = 0; s < 256; ++s) {
    for (uint32_t slot = model.start[s]; slot < model.start[s] + model.freq[s]; ++slot) {
      slots[slot] = entropy::rans_slot_entry(s, model.freq[s], model.start[s]);
    }
  }
  std::vector<uint8_t> segments(first, static_cast<const uint8_t*>(stream.data() + stream.size()));
  DeviceVector<uint32_t> d_slots(slots), d_failed(std::vector<uint32_t>{0});
  DeviceVector<uint64_t> d_offsets(offsets);
  DeviceVector<uint8_t> d_segments(segments), d_out(n);
  rans_decode(d_slots.get(), d_segments.get(), d_offsets.get(), n, d_out.get(), d_failed.get(), nullptr);
  check(cudaDeviceSynchronize(), "rans_decode");
  EXPECT_EQ(d_failed.host()[0], 0u);
  EXPECT_EQ(d_out.host(), symbols);
  segments[offsets[7] + 100] ^= 0x21;  // a word of segment 7
  DeviceVector<uint8_t> d_bad(segments);
  DeviceVector<uint32_t> d_bad_failed(std::vector<uint32_t>{0});
  rans_decode(d_slots.get(), d_bad.get(), d_offsets.get(), n, d_out.get(), d_bad_failed.get(), nullptr);
  check(cudaDeviceSynchronize(), "rans_decode (corrupt)");
  EXPECT_EQ(d_bad_failed.host()[0], 1u);
}

}  // namespace
}  // namespace ciera::cuda
