"""ZipNN as an FSDP2 gather scheme: a peer scheme CIERA is compared with, side by side (issue 18).

ZipNN (Hershcovitch et al., "ZipNN: Lossless Compression for AI Models"; PyPI ``zipnn``) groups
the bytes of each float and entropy-codes the exponent bytes with Huffman, every call on its own:
lossless and stateless. It has no public C API, so unlike CIERA's own schemes (the engine's shard
policies) it runs here, in Python: each rank compresses its shard of a parameter group, the
compressed bytes of every rank are all-gathered on a dedicated gloo group (sizes and checksums
first, then the bytes padded to the largest, as CIERA's torch transport moves its payloads over
gloo), and each peer's bytes are decompressed into its slot of FSDP's output. The result is bitwise what a plain
all-gather produces; with ``verify`` every gather is compared with one.

Install it with ``pip install 'ciera[peers]'`` (zipnn and xxhash); ``import ciera.fsdp`` does not
need it.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import all_gather_single, checked_on_every_rank, parameter_shapes, refused_on_every_rank
from ciera.fsdp import lifecycle
from ciera.fsdp.api import Handle
from ciera.fsdp.gather import CieraAllGather, GatherRecord, Runtime, check_input
from ciera.fsdp.layout import (AllGather, Bucket, DefaultAllGather, all_gather_comm, describe_buckets, describe_groups,
                               lone_shard_group)
from ciera.fsdp.transport import group_beside

# The names ZipNN's byte interface gives the dtypes FSDP may all-gather (ciera.fsdp.layout.DTYPES).
_ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Bytes each rank sends in the exchange that precedes the payloads (its size and XXH3-64, int64).
_FRAME_BYTES = 16

_INSTALL_HINT = "pip install 'ciera[peers]'"


class ZipnnUnavailable(ImportError):
    """enable_zipnn() was called where the zipnn package is not installed."""


def _zipnn_class():
    try:
        from zipnn import ZipNN
    except ImportError as error:
        raise ZipnnUnavailable(f"enable_zipnn() needs the zipnn package: {_INSTALL_HINT}") from error
    return ZipNN


def _require_peers() -> None:
    """ZipnnUnavailable unless the peers extra's two packages are there: zipnn, and xxhash for
    the gathers' checksums (ZipnnCoder alone, as `ciera bench codec` uses it, needs no xxhash)."""
    _zipnn_class()
    try:
        import xxhash  # noqa: F401
    except ImportError as error:
        raise ZipnnUnavailable(f"enable_zipnn() needs the xxhash package: {_INSTALL_HINT}") from error


def _checksum(payload: bytes) -> int:
    """XXH3-64 of a payload (the xxhash package, which the peers extra installs with zipnn)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(payload)


class ZipnnCoder:
    """ZipNN's byte interface for one dtype, single-threaded (ranks share the machine's cores with
    the training; ZipNN's default takes up to 16 threads per call). Stateless: nothing carries over
    from one call to the next but ZipNN's header scratch, so one coder serves every call."""

    def __init__(self, dtype: torch.dtype):
        if dtype not in _ZIPNN_DTYPES:
            raise TypeError(f"ZipNN codes bf16, fp16 and fp32 values, not {dtype}")
        zipnn = _zipnn_class()
        name = _ZIPNN_DTYPES[dtype]
        self.dtype = dtype
        self._compressor = zipnn(input_format="byte", bytearray_dtype=name, threads=1)
        self._decompressor = zipnn(input_format="byte", bytearray_dtype=name, threads=1)

    def compress(self, values: torch.Tensor) -> bytes:
        """ZipNN's bytes for a contiguous CPU tensor of this coder's dtype, which stays unchanged.
        ZipNN 0.5.4 reorders the bits of its input buffer in place (bf16, fp32) before it codes
        them, so it is handed a copy."""
        return self.compress_scratch(bytearray(memoryview(values.detach().view(torch.uint8).numpy())))

    def compress_scratch(self, scratch: bytearray) -> bytes:
        """ZipNN's bytes for the values in `scratch`, which ZipNN overwrites (a buffer of the
        caller's that it no longer needs: `ciera bench codec` times this call alone)."""
        return bytes(self._compressor.compress(scratch))

    def decompress_bytes(self, payload: bytes) -> bytearray:
        """The values' bytes `payload` carries."""
        return self._decompressor.decompress(payload)

    def decompress(self, payload: bytes, out: torch.Tensor) -> None:
        """Writes the values `payload` carries into `out` (a contiguous CPU uint8 tensor); a
        FormatError if they are not exactly out.numel() bytes."""
        values = self.decompress_bytes(payload)
        if len(values) != out.numel():
            raise _ext.FormatError(f"ZipNN payload decompressed to {len(values)} bytes, expected {out.numel()}")
        if out.numel():
            out.copy_(torch.frombuffer(values, dtype=torch.uint8))


class ZipnnAllGather(AllGather):
    """FSDP2 custom all-gather: ZipNN-compressed shards exchanged on `group`, decompressed into
    FSDP's output. Synchronous: the output is complete when the call returns.

    Each payload travels with its XXH3-64, exchanged with the sizes, and a receiver checks it
    before ZipNN sees the bytes: ZipNN 0.5.4's decoder aborts the process (free(): invalid
    pointer) on a payload one byte short. The round ends with every rank's outcome, as the
    engine's does, so a payload one rank cannot decompress fails the gather on every rank."""

    def __init__(self, runtime: Runtime, bucket: Bucket, group):
        self.runtime = runtime
        self.bucket = bucket
        self._group = lifecycle.held_weakly(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._ranks = tuple(dist.get_process_group_ranks(group))  # for the records (inter-node bytes)
        self.coder = ZipnnCoder(bucket.dtype)
        self._failed_peer = self.rank   # whose payload the last failure to decompress was

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        b = self.bucket
        start = time.perf_counter()
        payload = None

        def check_and_compress():
            nonlocal payload
            check_input(b, input_tensor, "enable_zipnn()")
            if input_tensor.device.type != "cpu" or output_tensor.device.type != "cpu":
                raise _ext.ConfigError("enable_zipnn(): ZipNN codes host memory; the all-gather buffers are on "
                                       f"{input_tensor.device}")
            if not (output_tensor.is_contiguous() and input_tensor.is_contiguous()):
                raise _ext.ConfigError("enable_zipnn() needs contiguous all-gather buffers")
            payload = self.coder.compress(input_tensor)

        # A rank that cannot take part sends a size of -1: every rank's gather fails at once.
        refused_on_every_rank(check_and_compress, lambda reason: self._frames(-1, 0))
        encode_s = time.perf_counter() - start
        frames = self._exchange(payload)
        failure = None
        try:
            self._decompress_peers(frames, output_tensor, input_tensor)
        except Exception as error:  # noqa: BLE001 - ZipNN raises whatever its C code raises
            failure = error
        self._agree(failure)
        now = time.perf_counter()
        runtime = self.runtime
        raw_bytes = output_tensor.numel() * output_tensor.element_size()
        # As the engine counts: every rank's payload, plus the exchange of sizes and checksums
        # (the padding gloo needs to gather unequal sizes is the transport's, not the scheme's).
        wire_bytes = int(frames[:, 0].sum()) + _FRAME_BYTES * self.world
        runtime.records.append(GatherRecord(b.index, now - start, raw_bytes, wire_bytes, True, False, -1.0, start,
                                            encode_s, ranks=self._ranks,
                                            payload_bytes=int(frames[self.rank, 0]) + _FRAME_BYTES))
        runtime.gathered(b, input_tensor, output_tensor, group)
        return None

    def _frames(self, length: int, checksum: int) -> torch.Tensor:
        """Every rank's payload size and XXH3-64 (int64, a row per rank). A rank that refused its
        gather sends a size of -1, and the gather fails on every rank, naming it."""
        frames = torch.empty(self.world, 2, dtype=torch.int64)
        mine = torch.tensor([length, checksum - (1 << 64) if checksum >= 1 << 63 else checksum], dtype=torch.int64)
        all_gather_single(frames.view(-1), mine, group=self._group())
        refused = [r for r, n in enumerate(frames[:, 0].tolist()) if n < 0]
        if refused:
            raise _ext.ConfigError(f"enable_zipnn(): rank {refused[0]} refused its gather of "
                                   f"{self.bucket.module_name or 'root'} (its error says why)")
        return frames

    def _exchange(self, payload: bytes) -> torch.Tensor:
        """All ranks' payloads, sizes and checksums first; returns those (int64, a row per rank)
        and keeps the padded bytes in self._received until they are decompressed."""
        frames = self._frames(len(payload), _checksum(payload))
        largest = int(frames[:, 0].max())
        send = torch.zeros(largest, dtype=torch.uint8)
        if payload:
            send[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._received = torch.empty(largest * self.world, dtype=torch.uint8)
        all_gather_single(self._received, send, group=self._group())
        return frames

    def _decompress_peers(self, frames: torch.Tensor, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        """Every peer's payload into its slot of the output, each checked against its checksum
        first; on an error, self._failed_peer is the rank whose payload raised it."""
        out = output_tensor.view(torch.uint8)
        shard_bytes = input_tensor.numel() * input_tensor.element_size()
        received, self._received = self._received, None
        self._failed_peer = self.rank
        largest = received.numel() // self.world
        for r, (length, checksum) in enumerate(frames.tolist()):
            slot = out[r * shard_bytes : (r + 1) * shard_bytes]
            if r == self.rank:
                slot.copy_(input_tensor.view(torch.uint8))  # a plain all-gather's own slot is the input
                continue
            self._failed_peer = r
            payload = received[r * largest : r * largest + length].numpy().tobytes()
            if _checksum(payload) != checksum % (1 << 64):
                raise _ext.FormatError(f"the {length} bytes received do not match their XXH3-64")
            self.coder.decompress(payload, slot)

    def _agree(self, failure: Exception | None) -> None:
        """Every rank's outcome of decompressing (one int64 each: 0, or 1 + the rank whose payload
        it could not decompress); a FormatError on every rank, naming the first in rank order,
        if any rank failed. The failing rank's own error is the cause of its exception."""
        code = 0 if failure is None else 1 + self._failed_peer
        codes = torch.empty(self.world, dtype=torch.int64)
        all_gather_single(codes, torch.tensor([code], dtype=torch.int64), group=self._group())
        failed = [(r, c - 1) for r, c in enumerate(codes.tolist()) if c > 0]
        if not failed:
            return
        receiver, sender = failed[0]
        detail = f": {type(failure).__name__}: {failure}" if failure is not None and receiver == self.rank else ""
        what = "its own shard into the output" if sender == receiver else f"rank {sender}'s payload"
        raise _ext.FormatError(f"enable_zipnn(): rank {receiver} could not decompress {what} of "
                               f"{self.bucket.module_name or 'root'}{detail}") from failure


class ZipnnHandle(Handle):
    """What enable_zipnn() returns: the attributes of enable()'s Handle that the training harness
    reads (records, observers, buckets, wrong_bytes, ...), and disable(). ZipNN keeps no state
    between gathers, so cache_bytes is 0; there is no engine and no selector."""

    def __init__(self, runtime: Runtime, group):
        super().__init__(runtime)
        self._group = lifecycle.held_weakly(group)

    @property
    def cache_bytes(self) -> int:
        return 0

    def disable(self) -> None:
        """Restores FSDP2's default all-gather on every module and releases the exchange group."""
        for module in self._runtime.modules:
            module.set_custom_all_gather(DefaultAllGather())
        if self._group is not None:
            group = self._group()
            self._group = None
            lifecycle.destroy_group(group)


def _check_model(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_zipnn(): model must be a torch.nn.Module, got {type(model).__name__}")
    devices = sorted({str(p.device) for p in model.parameters() if p.device.type != "cpu"})
    if devices:
        raise _ext.ConfigError(f"enable_zipnn(): ZipNN codes host memory; the model has parameters on "
                               f"{', '.join(devices)} (CPU tensors only)")


def enable_zipnn(model: torch.nn.Module, *, process_group=None, verify: bool = False) -> ZipnnHandle:
    """Routes every FSDP2 parameter group's all-gather of `model` (CPU, bf16/fp16/fp32) through
    ZipNN: each rank's shard is compressed, the compressed bytes of all ranks are exchanged on a
    dedicated gloo group beside `process_group` (default: the world, or the mesh's group for a
    model sharded on a mesh of some ranks only, as enable()'s), and each peer's are
    decompressed into its slot; the output is bitwise a plain all-gather's. With `verify`, every
    gather is also done by torch.distributed and compared byte for byte (a difference is an error
    on every rank; wrong_bytes).

    Collective: every rank calls it with the same model structure. Raises ZipnnUnavailable (an
    ImportError) when zipnn is not installed (pip install 'ciera[peers]'), and refuses a model
    whose all-gathers already go through CIERA or ZipNN, or whose parameters are not on the CPU."""

    if process_group is None:
        # As enable(): a model sharded on a mesh of some ranks only agrees over that mesh.
        process_group = lone_shard_group(model)

    def checked():
        _check_model(model)
        _require_peers()  # a missing package is one clear error, before anything is set up
        described = describe_buckets(model)
        if not described:
            raise _ext.ConfigError("enable_zipnn(): the model has no FSDP2 (fully_shard) parameter groups")
        if any(isinstance(all_gather_comm(module), (CieraAllGather, ZipnnAllGather)) for module, _ in described):
            raise ValueError("enable_zipnn(): the model's all-gathers already go through CIERA or ZipNN; call "
                             "disable() on the Handle of that call first")
        # ZipNN exchanges on one group, `process_group`'s ranks: FSDP2 must gather on exactly those.
        # An HSDP mesh (a shard group per node) or partial resharding (backward gathers on a
        # sub-group) would have its all-gather output sized for fewer ranks than take part.
        groups = describe_groups(described)
        ranks = tuple(dist.get_process_group_ranks(process_group) if process_group is not None
                      else range(dist.get_world_size()))
        shapes = [kind.partition for kind in groups]
        if len(groups) != 1 or groups[0].partition != (ranks,):
            raise _ext.ConfigError(
                f"enable_zipnn(): FSDP2 gathers this model on the groups {shapes}, but ZipNN exchanges on one "
                f"group of ranks {ranks} (an HSDP mesh or reshard_after_forward=N is not supported)")
        return described

    # On every rank at once (zipnn missing on one node, say), and with the same `verify`, which
    # adds a collective to every gather: one rank alone would leave the others waiting.
    try:
        described = checked_on_every_rank("enable_zipnn()", checked, process_group, same={"verify": bool(verify)},
                                          parameters=lambda: parameter_shapes(model))
    except ZipnnUnavailable:
        raise
    except ImportError as missing:   # a peer's ZipnnUnavailable, as every rank raises it
        raise ZipnnUnavailable(str(missing)) from None
    # The engine's timeout (one source of truth): a new group would otherwise wait torch's
    # default 30 minutes for a stopped peer.
    group = group_beside(process_group, "gloo", datetime.timedelta(seconds=_ext.EngineConfig().timeout_s))
    # new_group can return on one rank while a peer is still connecting to it; a rank that then
    # destroyed the group (disable() at once, or its exit) would fail the peer's connect
    # ("Connection closed by peer", seen in CI). The barrier returns once every rank is in.
    dist.barrier(group=group)
    runtime = Runtime(None, [b for _, b in described], [m for m, _ in described], verify, overlap=False)
    for module, bucket in described:
        module.set_custom_all_gather(ZipnnAllGather(runtime, bucket, group))
    return ZipnnHandle(runtime, group)
