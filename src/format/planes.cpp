#include "format/planes.hpp"

#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "ciera/error.hpp"

namespace ciera::format {
namespace {

// FP16 stores 3 bits per value packed LSB-first (docs/format.md, "Sign-mantissa plane").
void pack3(const uint8_t* hi3, uint64_t first, size_t count, uint8_t* plane) {
  size_t i = 0;
  // Head: values before the next multiple of 8 share bytes with neighbouring values.
  for (; i < count && ((first + i) & 7) != 0; ++i) {
    const uint64_t bit = 3 * (first + i);
    for (unsigned b = 0; b < 3; ++b) {
      const uint64_t pos = bit + b;
      const uint8_t mask = static_cast<uint8_t>(1u << (pos & 7));
      plane[pos >> 3] = static_cast<uint8_t>((plane[pos >> 3] & ~mask) |
                                             (((hi3[i] >> b) & 1u) ? mask : 0));
    }
  }
  // Body: 8 values fill exactly 3 bytes.
  for (; i + 8 <= count; i += 8) {
    uint32_t word = 0;
    for (unsigned j = 0; j < 8; ++j) word |= uint32_t{hi3[i + j] & 7u} << (3 * j);
    uint8_t* out = plane + (3 * (first + i)) / 8;
    out[0] = static_cast<uint8_t>(word);
    out[1] = static_cast<uint8_t>(word >> 8);
    out[2] = static_cast<uint8_t>(word >> 16);
  }
  for (; i < count; ++i) {
    const uint64_t bit = 3 * (first + i);
    for (unsigned b = 0; b < 3; ++b) {
      const uint64_t pos = bit + b;
      const uint8_t mask = static_cast<uint8_t>(1u << (pos & 7));
      plane[pos >> 3] = static_cast<uint8_t>((plane[pos >> 3] & ~mask) |
                                             (((hi3[i] >> b) & 1u) ? mask : 0));
    }
  }
}

void unpack3(const uint8_t* plane, uint64_t first, size_t count, uint8_t* hi3) {
  size_t i = 0;
  auto read_one = [&](size_t idx) {
    const uint64_t bit = 3 * (first + idx);
    uint8_t v = 0;
    for (unsigned b = 0; b < 3; ++b) {
      const uint64_t pos = bit + b;
      v = static_cast<uint8_t>(v | (((plane[pos >> 3] >> (pos & 7)) & 1u) << b));
    }
    hi3[idx] = v;
  };
  for (; i < count && ((first + i) & 7) != 0; ++i) read_one(i);
  for (; i + 8 <= count; i += 8) {
    const uint8_t* in = plane + (3 * (first + i)) / 8;
    const uint32_t word = uint32_t{in[0]} | (uint32_t{in[1]} << 8) | (uint32_t{in[2]} << 16);
    for (unsigned j = 0; j < 8; ++j) hi3[i + j] = static_cast<uint8_t>((word >> (3 * j)) & 7u);
  }
  for (; i < count; ++i) read_one(i);
}

}  // namespace

void stream_fence() {
#if defined(CIERA_HAVE_X86_TARGETS)
  __builtin_ia32_sfence();
#endif
}

SignMantissaLayout::SignMantissaLayout(DType d, uint64_t n) : dtype(d), num_values(n) {
  switch (d) {
    case DType::kBF16:
      first_plane_bytes = n;
      second_plane_bytes = 0;
      break;
    case DType::kFP16:
      first_plane_bytes = n;
      second_plane_bytes = (3 * n + 7) / 8;
      break;
    case DType::kFP32:
      first_plane_bytes = n;
      second_plane_bytes = 2 * n;
      break;
  }
  total_bytes_ = first_plane_bytes + second_plane_bytes;
}

void split_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* values,
                  uint64_t first, size_t count, uint8_t* exps, uint8_t* sm_plane) {
  switch (layout.dtype) {
    case DType::kBF16:
      k.split_bf16(values, count, exps, sm_plane + first);
      return;
    case DType::kFP16: {
      std::array<uint8_t, 2048> hi3;
      for (size_t done = 0; done < count; done += hi3.size()) {
        const size_t part = std::min(hi3.size(), count - done);
        k.split_fp16(values + 2 * done, part, exps + done, sm_plane + first + done, hi3.data());
        pack3(hi3.data(), first + done, part, sm_plane + layout.first_plane_bytes);
      }
      return;
    }
    case DType::kFP32:
      k.split_fp32(values, count, exps, sm_plane + first,
                   sm_plane + layout.first_plane_bytes + 2 * first);
      return;
  }
}

void merge_values(const SignMantissaLayout& layout, const PlaneKernels& k, const uint8_t* exps,
                  const uint8_t* sm_plane, uint64_t first, size_t count, uint8_t* values) {
  switch (layout.dtype) {
    case DType::kBF16:
      k.merge_bf16(exps, sm_plane + first, count, values);
      return;
    case DType::kFP16: {
      std::array<uint8_t, 2048> hi3;
      for (size_t done = 0; done < count; done += hi3.size()) {
        const size_t part = std::min(hi3.size(), count - done);
        unpack3(sm_plane + layout.first_plane_bytes, first + done, part, hi3.data());
        k.merge_fp16(exps + done, sm_plane + first + done, hi3.data(), part, values + 2 * done);
      }
      return;
    }
    case DType::kFP32:
      k.merge_fp32(exps, sm_plane + first, sm_plane + layout.first_plane_bytes + 2 * first, count,
                   values);
      return;
  }
}

void extract_exponents(DType dtype, const PlaneKernels& k, const uint8_t* values, size_t count,
                       uint8_t* exps) {
  switch (dtype) {
    case DType::kBF16: k.exponents_bf16(values, count, exps); return;
    case DType::kFP16: k.exponents_fp16(values, count, exps); return;
    case DType::kFP32: k.exponents_fp32(values, count, exps); return;
  }
}

namespace reference {

namespace {
uint32_t read_value(DType dtype, const uint8_t* p) {
  uint32_t x = 0;
  for (uint32_t b = 0; b < dtype_info(dtype).value_bytes; ++b) x |= uint32_t{p[b]} << (8 * b);
  return x;
}
void write_value(DType dtype, uint8_t* p, uint32_t x) {
  for (uint32_t b = 0; b < dtype_info(dtype).value_bytes; ++b) p[b] = static_cast<uint8_t>(x >> (8 * b));
}
uint32_t get_bit(const uint8_t* plane, uint64_t pos) { return (plane[pos / 8] >> (pos % 8)) & 1u; }
void put_bit(uint8_t* plane, uint64_t pos, uint32_t bit) {
  plane[pos / 8] = static_cast<uint8_t>((plane[pos / 8] & ~(1u << (pos % 8))) | (bit << (pos % 8)));
}
}  // namespace

void split(DType dtype, const uint8_t* values, uint64_t n, uint8_t* exps, uint8_t* sm_plane) {
  const SignMantissaLayout layout(dtype, n);
  const uint32_t vb = dtype_info(dtype).value_bytes;
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t x = read_value(dtype, values + vb * i);
    switch (dtype) {
      case DType::kBF16:
        exps[i] = static_cast<uint8_t>((x >> 7) & 0xFF);
        sm_plane[i] = static_cast<uint8_t>(((x >> 15) << 7) | (x & 0x7F));
        break;
      case DType::kFP16: {
        exps[i] = static_cast<uint8_t>((x >> 10) & 0x1F);
        sm_plane[i] = static_cast<uint8_t>(x & 0xFF);
        const uint32_t hi = ((x >> 15) << 2) | ((x >> 8) & 0x3);
        for (uint32_t b = 0; b < 3; ++b) put_bit(sm_plane + layout.first_plane_bytes, 3 * i + b, (hi >> b) & 1u);
        break;
      }
      case DType::kFP32:
        exps[i] = static_cast<uint8_t>((x >> 23) & 0xFF);
        sm_plane[i] = static_cast<uint8_t>(((x >> 31) << 7) | ((x >> 16) & 0x7F));
        sm_plane[n + 2 * i] = static_cast<uint8_t>(x & 0xFF);
        sm_plane[n + 2 * i + 1] = static_cast<uint8_t>((x >> 8) & 0xFF);
        break;
    }
  }
  // Padding bits of the FP16 packed plane are zero.
  if (dtype == DType::kFP16) {
    for (uint64_t pos = 3 * n; pos < 8 * layout.second_plane_bytes; ++pos) {
      put_bit(sm_plane + layout.first_plane_bytes, pos, 0);
    }
  }
}

void merge(DType dtype, const uint8_t* exps, const uint8_t* sm_plane, uint64_t n,
           uint8_t* values) {
  const SignMantissaLayout layout(dtype, n);
  const uint32_t vb = dtype_info(dtype).value_bytes;
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t x = 0;
    switch (dtype) {
      case DType::kBF16:
        x = ((sm_plane[i] >> 7) << 15) | (uint32_t{exps[i]} << 7) | (sm_plane[i] & 0x7F);
        break;
      case DType::kFP16: {
        uint32_t hi = 0;
        for (uint32_t b = 0; b < 3; ++b) hi |= get_bit(sm_plane + layout.first_plane_bytes, 3 * i + b) << b;
        x = ((hi >> 2) << 15) | (uint32_t{exps[i] & 0x1Fu} << 10) | ((hi & 3) << 8) | sm_plane[i];
        break;
      }
      case DType::kFP32:
        x = (static_cast<uint32_t>(sm_plane[i] >> 7) << 31) | (uint32_t{exps[i]} << 23) |
            (static_cast<uint32_t>(sm_plane[i] & 0x7F) << 16) | (uint32_t{sm_plane[n + 2 * i + 1]} << 8) |
            sm_plane[n + 2 * i];
        break;
    }
    write_value(dtype, values + vb * i, x);
  }
}

}  // namespace reference
}  // namespace ciera::format
