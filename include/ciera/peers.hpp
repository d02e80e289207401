// The gather schemes CIERA is compared with ("peer schemes"), as plain functions on one shard.
// The engine runs them as shard policies (ShardPolicy::kZeroppInt8, kSdp4bit, kStateless) with
// framed, checksummed payloads (docs/format.md, "Peer-scheme frames"); `ciera bench codec` and
// the tests call these functions directly.
//
// The two quantisers are LOSSY by design: they are the baselines "why not just quantise the
// gather?" is answered with. Their arithmetic is fixed (float32, round-to-nearest-even, no fused
// multiply-add), so every rank that runs the same build reconstructs the same bits.
//
// Values that are not finite (±Inf, NaN) cannot be scaled, nor can a group whose largest
// magnitude is so small (subnormal) that 127 / max or 7 / max overflows FP32: such a group
// travels raw (its values bit for bit, flagged by a NaN scale), so the quantisers never turn a
// finite weight into NaN, and never hide a NaN either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ciera/config.hpp"
#include "ciera/dtype.hpp"

namespace ciera::peers {

// ---- ZeRO++ qwZ: block-wise symmetric int8 -----------------------------------------------------
// DeepSpeed's quantiser for ZeRO++'s quantised weights (deepspeed/runtime/zero/
// partition_parameters.py, CUDAQuantizer) aims at groups of at most target_group_size = 8000
// values ("the optimal size is 4k, so we set the target to be below 8k"), symmetric, 8 bits, one
// FP32 scale per group. DeepSpeed picks a group count that divides the flattened partition; we
// cut each shard into groups of exactly kZeroppGroupValues (the last one short), which gives the
// same group sizes up to that rounding.
inline constexpr uint32_t kZeroppGroupValues = 8000;

// Bytes of a quantised shard of `values` values: per group an FP32 scale, then one int8 per value
// (a group that travels raw carries its value_bytes per value instead; this is the bound).
size_t int8_bound_bytes(DType dtype, uint64_t values, uint32_t group_values);
// Quantises `values` (dtype, little-endian) into `out` (int8_bound_bytes() bytes); returns the
// bytes written. scale = max|x| / 127 (FP32), q = round_half_even(x * (127 / max|x|)) in
// [-127, 127]; an all-zero group has scale 0 and decodes to +0.
size_t quantize_int8(DType dtype, std::span<const std::byte> values, uint32_t group_values,
                     std::span<std::byte> out);
// Reconstructs q * scale, rounded to nearest-even in `dtype`, into `values`. Throws FormatError
// if `in` is not exactly what quantize_int8 writes for values.size() values.
void dequantize_int8(DType dtype, std::span<const std::byte> in, uint32_t group_values,
                     std::span<std::byte> values);
// Whether `reconstructed` is what ZeRO++'s quantiser promises for `values`: in a group it scales,
// each value within one step (max|x| / 127) of its input (half a step of rounding, the rest
// margin for the FP32 scale and the dtype's rounding of the result, at most 2^-8 of a value no
// larger than max|x|); a group it sends raw (a non-finite value, or values too small to scale)
// bit for bit. What a benchmark's "verified" checks for this lossy scheme, beyond every receiver
// agreeing.
bool int8_within_bound(DType dtype, std::span<const std::byte> values,
                       std::span<const std::byte> reconstructed, uint32_t group_values);

// ---- SDP4Bit qWD: 4-bit quantisation of weight differences -------------------------------------
// SDP4Bit (Jia et al., NeurIPS 2024; its code, hpdps-group/SDP4Bit) quantises the difference
// between the new weights and the copy every rank holds, d = w_t - base, where base is the
// previous step's *reconstruction* (error feedback: one step's error is corrected by the next and
// never accumulates). Its settings, which we follow: groups of 2048 values (--wq-group-size), an
// FP32 scale per group, symmetric, scale = max|d| / 7 (levels -7..7; its comment: "we tried to use
// all 16 lattice, but the convergence at last phase is worse"), stochastic rounding. Receivers and
// the sender set base += q * scale. Two values per byte. Where we differ: the difference and the
// sum are computed in FP32 and rounded once to the dtype (SDP4Bit subtracts and adds in BF16), and
// the stochastic rounding draws from a counter-based hash of `seed` and the value's index, so a
// run is reproducible.
inline constexpr uint32_t kSdp4bitGroupValues = 2048;

size_t diff4_bound_bytes(DType dtype, uint64_t values, uint32_t group_values);
// Quantises values - base into `out` (diff4_bound_bytes() bytes) and moves `base` (values.size()
// bytes, dtype) on to the new reconstruction; returns the bytes written. q = floor(d / scale + u),
// u uniform in [0, 1) from (seed, index), clamped to [-7, 7].
size_t quantize_diff4(DType dtype, std::span<const std::byte> values, std::span<std::byte> base,
                      uint32_t group_values, uint64_t seed, std::span<std::byte> out);
// Adds what `in` carries to `base` (the receiver's side of quantize_diff4). Throws FormatError if
// `in` is not exactly what quantize_diff4 writes for base.size() bytes; `base` is then unchanged.
void apply_diff4(DType dtype, std::span<const std::byte> in, uint32_t group_values,
                 std::span<std::byte> base);

// Bound on one framed payload of a peer-scheme stream (`kind` one of StreamKind::kZeroppInt8,
// kSdp4bit, kStateless) of `values` values: what the engine allocates per shard.
size_t frame_bound_bytes(StreamKind kind, DType dtype, uint64_t values, uint32_t block_values);

}  // namespace ciera::peers
