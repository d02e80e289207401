"""The custom all-gather: FSDP2 hands CIERA each parameter group's flat input and output, and the
engine fills the output with exactly the bytes an uncompressed all-gather would produce.
Tensors cross into C++ as data pointers; no compiled torch extension is involved."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ciera import _ext
from ciera._dist import all_gather_single, refused_on_every_rank
from ciera.fsdp.layout import AllGather, Bucket

_DEBUG_TIMING = bool(os.environ.get("CIERA_DEBUG_TIMING"))


@dataclass
class GatherRecord:
    bucket: int
    seconds: float
    raw_bytes: int
    wire_bytes: int
    compressed: bool
    resynchronised: bool
    exposed_s: float = -1.0   # time the caller waited for it (overlapped gathers); -1: all of it
    started: float = 0.0      # time.perf_counter() when FSDP asked for it
    encode_s: float = 0.0     # change detection + encoding on this rank (the engine's encode_s)
    group: int = 0            # the kind of group it ran on (layout.GatherGroup.kind)
    ranks: tuple = ()         # that group's world ranks
    payload_bytes: int = 0    # what this rank sent (its own payload)
    control_bytes: int = 0    # all ranks' control records and verdicts, its share (GatherStats.control_bytes)


class RecordLog(list):
    """The records of a handle's calls (one per gather or reduce-scatter), of which it keeps the
    latest LIMIT: a long training that never takes them (take_records) would otherwise hold one
    per call for ever, gigabytes over a real model's run. `dropped` counts those let go."""

    LIMIT = 1 << 16

    def __init__(self, *records):
        super().__init__(*records)
        self.dropped = 0

    def append(self, record) -> None:
        super().append(record)
        if len(self) >= 2 * self.LIMIT:   # trimmed in halves: amortised O(1) per record
            extra = len(self) - self.LIMIT
            del self[:extra]
            self.dropped += extra


@dataclass
class Runtime:
    """What every bucket's all-gather shares: the engine, the layout, records and observers."""
    engine: object
    buckets: list[Bucket]
    modules: list
    verify: bool
    records: list[GatherRecord] = field(default_factory=RecordLog)
    wrong_bytes: int = 0
    verified_bytes: int = 0
    on_gather: object = None   # optional callback(bucket index, this rank's input) for statistics
    on_output: object = None   # optional callback(Bucket, gathered output) for statistics
    selector: object = None    # ciera.fsdp.selection.Selector when selecting under a budget
    overlap: bool = False      # return gathers in flight to FSDP (CCP) instead of finishing them
    groups: list = field(default_factory=list)   # layout.GatherGroup per kind, each with its engine
    _by_group: dict = field(default_factory=dict)  # id(process group) -> GatherGroup

    def group_of(self, process_group):
        """The GatherGroup (and engine) of the process group FSDP2 gathers on. ConfigError for a
        group enable() did not find in the model's meshes."""
        found = self._by_group.get(id(process_group))
        if found is None:
            ranks = tuple(dist.get_process_group_ranks(process_group))
            found = next((g for g in self.groups if g.ranks == ranks), None)
            if found is None:
                raise _ext.ConfigError(f"FSDP gathers on ranks {ranks}, a group enable() did not find in the "
                                       f"model's meshes ({', '.join(str(g.ranks) for g in self.groups)})")
            self._by_group[id(process_group)] = found
        return found

    def take_records(self) -> list[GatherRecord]:
        records, self.records = self.records, RecordLog()
        return records

    def gathered(self, bucket: Bucket, input_tensor, output_tensor, group, observe: bool = True) -> None:
        """After a gather of `bucket`: with `verify`, compare the output with torch's all-gather
        on `group` byte for byte; then (`observe`) tell the observers."""
        self.verified(input_tensor, output_tensor, group)
        if observe:
            self.observed(bucket, input_tensor, output_tensor)

    def verified(self, input_tensor, output_tensor, group) -> None:
        """With `verify`: the output compared with torch's all-gather on `group`, byte for byte.
        A difference on any rank is an error on every rank, raised before anything reads the
        output (wrong_bytes counts what differed here).
        Collective: every rank, for every gather, before any observer runs (an observer that
        raises on one rank must not leave its peers in the next of these all-gathers)."""
        if self.verify:
            reference = torch.empty_like(output_tensor)
            all_gather_single(reference, input_tensor, group=group)
            wrong = int((reference.view(torch.uint8) != output_tensor.view(torch.uint8)).sum())
            self.wrong_bytes += wrong
            self.verified_bytes += reference.numel() * reference.element_size()
            seen = torch.tensor([wrong], dtype=torch.int64, device=reference.device)
            dist.all_reduce(seen, group=group)
            if seen.item():
                raise _ext.Error(f"verify: CIERA's gather differs from torch.distributed's in {seen.item()} bytes "
                                 f"over the group's ranks ({wrong} on rank {dist.get_rank()})")

    def observed(self, bucket: Bucket, input_tensor, output_tensor) -> None:
        """The observers, told of a gather of `bucket` (local: no collective)."""
        if self.on_gather is not None:
            self.on_gather(bucket.index, input_tensor)
        if self.on_output is not None:
            self.on_output(bucket, output_tensor)


def check_input(bucket: Bucket, input_tensor, who: str) -> None:
    """ConfigError unless FSDP's all-gather input is what `who` registered for `bucket`."""
    if input_tensor.dtype != bucket.dtype or input_tensor.numel() != bucket.numel:
        raise _ext.ConfigError(
            f"FSDP all-gather input for {bucket.module_name or 'root'} is {input_tensor.numel()} x "
            f"{input_tensor.dtype}, but {who} registered {bucket.numel} x {bucket.dtype}")


class CieraAllGather(AllGather):
    """FSDP2 custom all-gather that fills FSDP's output with the CIERA engine's result."""

    def __init__(self, runtime: Runtime, bucket: Bucket):
        self.runtime = runtime
        self.bucket = bucket

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        gathering = self.runtime.group_of(group)
        b = gathering.buckets[self.bucket.index]

        def check():
            check_input(b, input_tensor, "CIERA")
            if not (output_tensor.is_contiguous() and input_tensor.is_contiguous()):
                raise _ext.ConfigError("CIERA needs contiguous all-gather buffers")
            if self.runtime.selector is not None:   # this rank's own work before the gather
                self.runtime.selector.observe(gathering.kind, b.index, input_tensor)

        # From here the gather's time runs: the selector's change detection in check() is on this
        # thread, on the critical path, as is start().
        start = time.perf_counter()
        # A rank whose gather is refused still takes part in it, so its peers fail at once.
        refused_on_every_rank(check, lambda reason: gathering.engine.refuse(b.index, reason))
        nbytes = input_tensor.numel() * input_tensor.element_size()
        # On CUDA, FSDP calls this on its all-gather stream, where the copy-in of the input is
        # ordered: the engine starts encoding once that stream gets here (an event), and this
        # thread does not wait for it.
        stream = torch.cuda.current_stream(input_tensor.device).cuda_stream if input_tensor.is_cuda else 0
        ticket = gathering.engine.start(b.index, input_tensor.data_ptr(), nbytes, output_tensor.data_ptr(),
                                        output_tensor.numel() * output_tensor.element_size(), stream,
                                        keep=(input_tensor, output_tensor))
        work = _GatherWork(self, gathering, ticket, start, output_tensor, input_tensor, group,
                           caller_s=time.perf_counter() - start)
        if self.runtime.overlap:
            return work  # FSDP waits on it right before the module runs (CCP, paper §3.3)
        work.wait()
        return None


class _GatherWork(dist.distributed_c10d.Work):
    """A CIERA gather in flight: encoding, exchange and decoding run on the engine's threads while
    FSDP2 goes on (prefetching gathers overlap the previous module's compute); FSDP waits on this
    before it reads the output. Waiting twice is harmless; a gather that failed fails again at
    every later wait (FSDP may wait on a work twice: after a failed step, its next unshard finds
    the result still pending and waits on it, and would otherwise copy out a buffer the gather
    never filled)."""

    def __init__(self, gather: CieraAllGather, gathering, ticket, start: float, output_tensor, input_tensor, group,
                 caller_s: float):
        super().__init__()
        self.gather, self.gathering, self.ticket, self.start = gather, gathering, ticket, start
        self.output_tensor, self.input_tensor, self.group = output_tensor, input_tensor, group
        self.caller_s = caller_s  # this thread's part before the work was handed back (exposed)
        self.done = False
        self.failure: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        if self.failure is not None:
            raise self.failure
        if self.done:
            return True
        self.done = True
        try:
            self._finish()
        except BaseException as error:
            self.failure = error
            self.output_tensor = self.input_tensor = None
            raise
        return True

    def _finish(self) -> None:
        runtime, b = self.gather.runtime, self.gather.bucket
        waited = time.perf_counter()
        stats = self.gathering.engine.wait(self.ticket)
        now = time.perf_counter()
        if _DEBUG_TIMING and dist.get_rank() == 0:
            print(f"ciera gather bucket {b.index}: {(now - self.start)*1e3:.1f} ms (waited {(now - waited)*1e3:.1f})"
                  f" = encode {stats.encode_s*1e3:.1f} exchange {stats.exchange_s*1e3:.1f} decode "
                  f"{stats.decode_s*1e3:.1f} wire {stats.wire_bytes} raw {stats.raw_bytes} "
                  f"compressed {stats.compressed}", flush=True)
        # Exposed: the caller's part before it got the work back, and the wait. A gather finished
        # before FSDP got it back is exposed in full (-1), start() included.
        exposed = self.caller_s + (now - waited) if runtime.overlap else -1.0
        runtime.records.append(GatherRecord(b.index, now - self.start, stats.raw_bytes, stats.wire_bytes,
                                            stats.compressed, stats.resynchronised, exposed, self.start,
                                            stats.encode_s, self.gathering.kind, self.gathering.ranks,
                                            stats.local_payload_bytes, stats.control_bytes))
        output_tensor, input_tensor = self.output_tensor, self.input_tensor
        self.output_tensor = self.input_tensor = None
        # Observers see the shard group's layout: a post-forward gather only when verifying.
        runtime.gathered(b, input_tensor, output_tensor, self.group, observe=self.gathering.kind == 0)
