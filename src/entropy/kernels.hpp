// The entropy layer's kernel table: byte-symbol counting, and sixteen interleaved rANS states
// coded in one register, compiled once per SIMD target (kernels_impl.inc) and chosen as every
// layer's kernels are (common::chosen_simd_target()). Symbols and words only: the entropy coder
// never sees a float.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/simd_targets.hpp"
#include "entropy/rans_core.hpp"

namespace ciera::entropy {

// How many consecutive byte values EntropyKernels::count_symbols counts by vector.
inline constexpr unsigned kCountWindow = 16;

struct EntropyKernels {
  const char* target;  // common::simd_target_name()
  // Adds how often each byte value occurs among symbols[0, n) to the four tables together (how
  // the counts are split among them is the kernel's; SymbolCounter sums them). Symbols in
  // [window, window + kCountWindow) may be counted by vector, the others one by one: `window`
  // (at most 256 - kCountWindow) changes the speed, never the counts. The caller keeps every
  // table entry below 2^32 (SymbolCounter folds them into 64 bits first).
  void (*count_symbols)(const uint8_t* symbols, size_t n, unsigned window, uint32_t (*tables)[256]);
  // rANS-encodes `groups` groups of kRansStates symbols, the last group first, exactly as
  // rans_put would one symbol at a time: symbols[kRansStates * g + j] uses states[j] and is
  // below kRansGroupSymbols. Words go below *out, which moves down; the caller guarantees 2
  // bytes of room per symbol, and any of that room below the words may be written (a kernel
  // may store a vector's worth ending where its words end).
  void (*encode_groups)(const RansGroupTables& tables, uint32_t* states, const uint8_t* symbols,
                        size_t groups, uint8_t** out);
  // encode_groups on two independent streams at once (two segments of one stream), `groups`
  // groups of each: the same words and states as two encode_groups calls.
  void (*encode_groups2)(const RansGroupTables& tables, uint32_t* states_a,
                         const uint8_t* symbols_a, uint8_t** out_a, uint32_t* states_b,
                         const uint8_t* symbols_b, uint8_t** out_b, size_t groups);
  // encode_groups and encode_groups2 for any byte symbols (tables.all set for every symbol
  // present, tables.window for those in [tables.base, tables.base + tables.width)).
  void (*encode_wide_groups)(const RansWideTables& tables, uint32_t* states, const uint8_t* symbols,
                             size_t groups, uint8_t** out);
  void (*encode_wide_groups2)(const RansWideTables& tables, uint32_t* states_a,
                              const uint8_t* symbols_a, uint8_t** out_a, uint32_t* states_b,
                              const uint8_t* symbols_b, uint8_t** out_b, size_t groups);
  // rANS-decodes `groups` groups of kRansStates symbols: symbol kRansStates * g + j from
  // states[j], through the decoder's 4096-slot table (symbol | (freq - 1) << 8 | start << 20).
  // Renormalisation words are read from *in, which moves forward; the caller guarantees 32
  // readable bytes per group left.
  void (*decode_groups)(const uint32_t* slots, uint32_t* states, const uint8_t** in, uint8_t* out,
                        size_t groups);
  // decode_groups on two independent streams at once (two segments of one stream), `groups`
  // groups of each: the same symbols, states and input positions as two decode_groups calls.
  void (*decode_groups2)(const uint32_t* slots, uint32_t* states_a, const uint8_t** in_a, uint8_t* out_a,
                         uint32_t* states_b, const uint8_t** in_b, uint8_t* out_b, size_t groups);
};

// The kernels of the process's SIMD target.
const EntropyKernels& entropy_kernels();
// The kernels of `target`, which must be available (tests run every available target).
const EntropyKernels& entropy_kernels_for(common::SimdTarget target);

}  // namespace ciera::entropy
