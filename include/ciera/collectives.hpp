// Lossless compressed collectives beyond the allgather (ZipCCL's other two): a reduce-scatter of
// gradients and an alltoallv of activations. Every part a rank sends a peer is coded with the
// stateless exponent code (a CIERA key frame: the exponents entropy-coded with a table of the
// part's own, sign and mantissa raw) when that makes it smaller, and sent raw otherwise; the
// receiver gets the part back bit for bit. Gradients have no cross-step exponent reuse, but their
// exponents are far from uniform, so even this one-shot code shrinks every part.
//
// The reduction is deterministic and documented (docs/format.md, "Lossless collectives"): a
// reduce-scatter adds the ranks' parts in rank order 0, 1, ..., W - 1, whatever the transport or
// the coding, so a compressed run and an uncompressed one (CollectiveCoding::kRaw, the same code
// and order) are comparable bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ciera/config.hpp"
#include "ciera/dtype.hpp"
#include "ciera/transport.hpp"

namespace ciera {

enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,  // the sum divided by the number of ranks, before the one rounding
};
// "sum" | "avg"
std::string_view reduce_op_name(ReduceOp op);

enum class CollectiveCoding : uint8_t {
  kRaw = 0,       // every part raw: the uncompressed twin of the same collective
  kExponent = 1,  // every part exponent-coded where that is smaller
  kAuto = 2,      // whichever of the two the ranks measure faster (AdaptiveSwitch), agreed
};
// "raw" | "exponent" | "auto"
std::string_view collective_coding_name(CollectiveCoding coding);
// Accepts the names above; throws ConfigError otherwise.
CollectiveCoding parse_collective_coding(std::string_view name);

struct CollectivesConfig {
  CollectiveCoding coding = CollectiveCoding::kExponent;
  // XXH3-64 of every coded part's values in its payload, checked by the receiver. Must match on
  // every rank (checked at each call). Off, a bit flipped in transit in a coded part's sign or
  // mantissa bytes gives a wrong value with no error (damage to its exponent stream still fails
  // to decode), as in a raw part: what the checksum buys.
  bool content_checksum = true;
  // Values per block of the coded parts' frames (the stateless code ignores blocks but the
  // frame header records them, and a decoder takes only its own); any value CodecConfig
  // accepts. Must match on every rank (checked at each call).
  uint32_t block_values = 512;
  // Parts move in rounds of slices of this many values, so that a worker thread codes the
  // rounds ahead (up to two) and decodes the rounds behind while the transport moves this one.
  // Each rank keeps four rounds' slices of every peer in each direction (send, receive and, for
  // a reduce-scatter, decoded). Must match on every rank. 2^18 (from 2^20 until 2026-12-04): a
  // first and last slice of 2^16 leave less coding and decoding outside the transfers, which
  // on four ranks sharing two cores at 1 Gbit/s took the synthetic BF16 reduce-scatter of a
  // training call from 114-119 to 99-102 ms coded, its uncoded twin from 136-139 to 132-134
  // (docs/benchmarks.md, "Slices of 2^18"); 2^17 and 2^16 slowed the twin with their rounds.
  uint64_t slice_values = uint64_t{1} << 18;
  // A coded slice is frames of at most this many values, each with an rANS table of its own
  // (docs/format.md, "Lossless collectives"), so that the tables follow exponent statistics that
  // change along a buffer, as a gradient's do from one parameter to the next: the BF16
  // gradients of the FSDP2 training in docs/benchmarks.md take 9.95 bits per value in frames of
  // 2^17 values (10.07 in frames of 2^18) against 10.58 in one frame per 2^20-value slice, and
  // encoding them took about half the time there, for some 120 bytes per frame. At least 1;
  // need not match across ranks (every frame carries its size).
  uint64_t frame_values = uint64_t{1} << 17;
  // Threads that code and decode beside the caller's thread (at most kMaxWorkerThreads); 0:
  // everything on the caller's thread, one round after another.
  unsigned worker_threads = 1;
  // The workers' nice value (Linux; 0..19, higher is lower priority). Above 0 they give way to
  // the thread that drives the transport: where ranks share cores, coding that holds a core
  // while a rank's transport waits to be scheduled leaves its links idle. A task the workers
  // have not started when the caller needs it, the caller runs itself. Four ranks on two
  // cores at 1 Gbit/s, BF16: speedup over the uncoded twin 1.13x at 0, 1.25-1.31x at 19
  // (docs/benchmarks.md).
  int worker_niceness = 19;

  // Throws ConfigError naming the offending field.
  void validate() const;
};

// What one call did on this rank. Bytes count what it sent its peers (its own part excluded).
struct CollectiveStats {
  uint64_t raw_bytes = 0;    // the parts as values
  uint64_t wire_bytes = 0;   // the parts as sent
  // The call records (one a round, at least one) and the verdict this rank sent (docs/format.md,
  // "Lossless collectives"), each counted once however many peers it reaches, as
  // GatherStats::control_bytes counts the engine's. A plain reduce-scatter or alltoallv sends
  // none; wire_bytes + control_bytes is all this rank sent for the call.
  uint64_t control_bytes = 0;
  uint32_t coded_slices = 0;  // slices of parts sent coded (the others went raw)
  // Over the parts sent coded: their values, the bytes of their frames beyond the raw sign and
  // mantissa plane (exponent section, header, tables, checksum), and the order-0 entropy of their
  // exponents (each part's own: each is coded with a table of its own), in bits.
  uint64_t coded_values = 0;
  uint64_t coded_exponent_bytes = 0;
  double exponent_entropy_bits = 0;
  bool compressed = false;  // whether this call coded its parts (kAuto decides per call)
  double encode_s = 0;      // coding this rank's parts
  double exchange_s = 0;    // the size agreement and the alltoallv
  double decode_s = 0;      // decoding the peers' parts, and checking that every rank succeeded
  double reduce_s = 0;      // the reduction (reduce-scatter only)
  // The first record exchange: until the last rank entered the call and coded its first round
  // (and the exchange's own round trip). What is left of the call's time without it is the
  // collective's own, from the moment every rank was in it; in a training job the rest is other
  // ranks' compute.
  double arrival_wait_s = 0;
  // The call's busiest link: the most bytes one rank sent, or one rank received, in it (the same
  // on every rank: every rank reads every record), as sent and had every part gone raw. A call
  // takes at least its busiest link's bytes over the link rate, so where the parts compress
  // unevenly (one rank's shard of a gradient better than another's) the speedup the links allow
  // is busiest_link_raw_bytes / busiest_link_wire_bytes, below the byte ratio of the mean link
  // (raw_bytes / wire_bytes summed over ranks).
  uint64_t busiest_link_raw_bytes = 0;
  uint64_t busiest_link_wire_bytes = 0;
};

// Reduce-scatter and alltoallv among the ranks of `transport`. Collective: every rank makes the
// same calls in the same order, with matching dtype, op and sizes; a disagreement, a part that
// does not decode, or a dead peer raises on every rank (ConfigError, FormatError, CommError). A
// failed reduce-scatter leaves its output untouched; a failed alltoallv's output holds whatever
// parts arrived. Host memory only. Buffers grow to the largest call and are reused. One thread
// at a time: a call made while another thread's call on the same object is in flight is a
// std::logic_error.
class LosslessCollectives {
 public:
  LosslessCollectives(std::shared_ptr<Transport> transport, CollectivesConfig config = {});
  ~LosslessCollectives();
  LosslessCollectives(LosslessCollectives&&) noexcept;
  LosslessCollectives& operator=(LosslessCollectives&&) noexcept;

  // `in` holds size() parts of `out.size()` bytes each, rank-major (torch's reduce_scatter_tensor
  // layout); `out` receives, on rank r, the sum (or average) of every rank's part r. BF16 and
  // FP16 values are added in FP32, FP32 values in FP32; either way in rank order, and rounded to
  // `dtype` once at the end.
  CollectiveStats reduce_scatter(DType dtype, ReduceOp op, std::span<const std::byte> in,
                                 std::span<std::byte> out);

  // Sends send_values[p] values to each rank p (the parts lie back to back in `in`, rank order)
  // and receives recv_values[p] values from p (back to back in `out`, rank order). recv_values[p]
  // must equal what p sends here: checked, on every rank. `in` and `out` must not overlap (not
  // in place): refused on every rank.
  CollectiveStats alltoallv(DType dtype, std::span<const std::byte> in,
                            std::span<const uint64_t> send_values, std::span<std::byte> out,
                            std::span<const uint64_t> recv_values);

  // Take part in the next reduce-scatter (alltoallv) only to refuse it: every rank's call fails
  // with a ConfigError naming this rank, and this rank's with `reason`. For arguments that a
  // layer above finds wrong before it has buffers to pass (a tensor of the wrong kind, a null
  // pointer): thrown on this rank alone, they would leave its peers waiting for it until the
  // timeout.
  [[noreturn]] void refuse_reduce_scatter(const std::string& reason);
  [[noreturn]] void refuse_alltoallv(const std::string& reason);
  // Take part in the next reduce-scatter only to say that this rank leaves it to a reduce-scatter
  // of its caller's own (`reason`: why, in words). Returns once every rank has said so (one call
  // record exchanged; the caller then runs its own); if some ranks run the call instead, throws
  // ConfigError on every rank naming the ranks that ran it and those that did not, with their
  // reasons, at once rather than at the timeout.
  void pass_through_reduce_scatter(const std::string& reason);

  const CollectivesConfig& config() const;
  int rank() const;
  int size() const;

 private:
  struct Impl;
  Impl& state() const;  // std::logic_error once moved from
  std::unique_ptr<Impl> impl_;
};

}  // namespace ciera
