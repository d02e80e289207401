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


@dataclass
class Runtime:
    """What every bucket's all-gather shares: the engine, the layout, records and observers."""
    engine: object
    buckets: list[Bucket]
    modules: list
    verify: bool
    records: list[GatherRecord] = field(default_factory=list)
    wrong_bytes: int = 0
    verified_bytes: int = 0
    on_gather: object = None   # optional callback(bucket index, this rank's input) for statistics
    on_output: object = None   # optional callback(Bucket, gathered output) for statistics
    selector: object = None    # ciera.fsdp.selection.Selector when selecting under a budget
    overlap: bool = False      # return gathers in flight to FSDP (CCP) instead of finishing them

    def take_records(self) -> list[GatherRecord]:
        records, self.records = self.records, []
        return records

    def gathered(self, bucket: Bucket, input_tensor, output_tensor, group) -> None:
        """After a gather of `bucket`: with `verify`, compare the output with torch's all-gather
        on `group` byte for byte; then tell the observers."""
        if self.verify:
            reference = torch.empty_like(output_tensor)
            dist.all_gather_into_tensor(reference, input_tensor, group=group)
            self.wrong_bytes += int((reference.view(torch.uint8) != output_tensor.view(torch.uint8)).sum())
            self.verified_bytes += reference.numel() * reference.element_size()
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
        b = self.bucket
        check_input(b, input_tensor, "CIERA")
        if not (output_tensor.is_contiguous() and input_tensor.is_contiguous()):
            raise _ext.ConfigError("CIERA needs contiguous all-gather buffers")
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if self.runtime.selector is not None:
            self.runtime.selector.tracker(b.index, input_tensor)
        start = time.perf_counter()
        # On CUDA, FSDP calls this on its all-gather stream, where the copy-in of the input is
        # ordered: the engine starts encoding once that stream gets here (an event), and this
        # thread does not wait for it.
        stream = torch.cuda.current_stream(input_tensor.device).cuda_stream if input_tensor.is_cuda else 0
        ticket = self.runtime.engine.start(b.index, input_tensor.data_ptr(), nbytes, output_tensor.data_ptr(),
                                           output_tensor.numel() * output_tensor.element_size(), stream)
        work = _GatherWork(self, ticket, start, output_tensor, input_tensor, group)
        if self.runtime.overlap:
            return work  # FSDP waits on it right before the module runs (CCP, paper §3.3)
        work.wait()
        return None


class _GatherWork(dist.distributed_c10d.Work):
    """A CIERA gather in flight: encoding, exchange and decoding run on the engine's threads while
    FSDP2 goes on (prefetching gathers overlap the previous module's compute); FSDP waits on this
    before it reads the output. Waiting twice is harmless."""

    def __init__(self, gather: CieraAllGather, ticket, start: float, output_tensor, input_tensor, group):
        super().__init__()
        self.gather, self.ticket, self.start = gather, ticket, start
        self.output_tensor, self.input_tensor, self.group = output_tensor, input_tensor, group
        self.done = False

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        self.done = True
        runtime, b = self.gather.runtime, self.gather.bucket
        waited = time.perf_counter()
        stats = runtime.engine.wait(self.ticket)
        now = time.perf_counter()
        if _DEBUG_TIMING and dist.get_rank() == 0:
            print(f"ciera gather bucket {b.index}: {(now - self.start)*1e3:.1f} ms (waited {(now - waited)*1e3:.1f})"
                  f" = encode {stats.encode_s*1e3:.1f} exchange {stats.exchange_s*1e3:.1f} decode "
                  f"{stats.decode_s*1e3:.1f} wire {stats.wire_bytes} raw {stats.raw_bytes} "
                  f"compressed {stats.compressed}", flush=True)
        # A gather finished before FSDP got it back is exposed in full (-1), start() included.
        exposed = now - waited if runtime.overlap else -1.0
        runtime.records.append(GatherRecord(b.index, now - self.start, stats.raw_bytes, stats.wire_bytes,
                                            stats.compressed, stats.resynchronised, exposed, self.start,
                                            stats.encode_s))
        output_tensor, input_tensor = self.output_tensor, self.input_tensor
        self.output_tensor = self.input_tensor = None
        runtime.gathered(b, input_tensor, output_tensor, self.group)
        return True
