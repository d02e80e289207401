"""FSDP2's own collectives, timed exactly as CIERA's gathers are, for the baseline of a
comparison: the same calls FSDP2 makes, so results are unchanged."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ciera._dist import all_gather_single, reduce_scatter_single
from ciera.fsdp.gather import GatherRecord
from ciera.fsdp.layout import DefaultAllGather, ReduceScatter, describe_buckets, is_hsdp, prefetch_forward


class TimedAllGather(DefaultAllGather):
    """FSDP2's own all-gather (torch.distributed), timed the same way, for the baseline. With
    `overlap` it is left in flight like CIERA's, so both sides get the same chance to overlap."""

    def __init__(self, records: list, index: int, observer=None, overlap: bool = False):
        self.records = records
        self.index = index
        self.observer = observer
        self.overlap = overlap
        self.groups: dict = {}   # id(process group) -> its world ranks

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        start = time.perf_counter()
        work = all_gather_single(output_tensor, input_tensor, group=group, async_op=self.overlap)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        record = GatherRecord(self.index, 0.0, nbytes, nbytes, False, False, started=start,
                              ranks=self._ranks(group), payload_bytes=input_tensor.numel() * input_tensor.element_size())
        if not self.overlap:
            _until_done(output_tensor)
            record.seconds = record.exposed_s = time.perf_counter() - start
            self.records.append(record)
        if self.observer is not None:  # statistics, outside the timed part (as CIERA's)
            self.observer(self.index, input_tensor)
        if not self.overlap:
            return None
        return _TimedWork(work, self.records, record, start, output_tensor)

    def _ranks(self, group) -> tuple:
        ranks = self.groups.get(id(group))
        if ranks is None:
            ranks = self.groups[id(group)] = tuple(dist.get_process_group_ranks(group))
        return ranks


def _until_done(tensor: torch.Tensor) -> None:
    """On CUDA a collective returns once enqueued; CIERA's gathers are timed until their output is
    complete, so the baseline's are too: wait for the stream the output is produced on."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


class _TimedWork(dist.distributed_c10d.Work):
    def __init__(self, work, records: list, record: GatherRecord, start: float, output: torch.Tensor):
        super().__init__()
        self.work, self.records, self.record, self.start, self.output = work, records, record, start, output

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            waited = time.perf_counter()
            self.work.wait()
            _until_done(self.output)
            self.output = None
            now = time.perf_counter()
            self.record.seconds, self.record.exposed_s = now - self.start, now - waited
            self.records.append(self.record)
            self.work = None
        return True


@dataclass
class ReduceScatterRecord:
    bucket: int
    started: float
    seconds: float
    input_bytes: int


class TimedReduceScatter(ReduceScatter):
    """FSDP2's own reduce-scatter of gradients, timed (for the allgather share of communication
    time, the paper's O1, and for traces)."""

    def __init__(self, records: list, index: int):
        self.records = records
        self.index = index

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        start = time.perf_counter()
        reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
        _until_done(output_tensor)
        self.ended = time.perf_counter()
        self.records.append(ReduceScatterRecord(self.index, start, self.ended - start,
                                                input_tensor.numel() * input_tensor.element_size()))
        return None


class _TimedAllReduce:
    """HSDP's all-reduce of a group's reduced gradients across replicas, timed: FSDP2 runs it right
    after the reduce-scatter and calls the all-reduce hook right after it (on CPU ranks both are
    synchronous), so it took from the reduce-scatter's end to the hook."""

    def __init__(self, records: list, scatter: TimedReduceScatter):
        self.records, self.scatter = records, scatter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        _until_done(reduce_output)
        now = time.perf_counter()
        self.records.append(ReduceScatterRecord(self.scatter.index, self.scatter.ended, now - self.scatter.ended,
                                                reduce_output.numel() * reduce_output.element_size()))


def time_reduce_scatters(model: torch.nn.Module, all_reduces: list | None = None) -> list:
    """Times FSDP2's gradient reduce-scatters; returns the list records accumulate in. With
    `all_reduces`, HSDP's all-reduces across replicas are timed into it too (as
    ReduceScatterRecords whose bytes are the all-reduce's per rank)."""
    records: list = []
    for module, bucket in describe_buckets(model):
        scatter = TimedReduceScatter(records, bucket.index)
        module.set_custom_reduce_scatter(scatter)
        if all_reduces is not None and is_hsdp(module):
            module.set_all_reduce_hook(_TimedAllReduce(all_reduces, scatter))
    return records


def time_plain_all_gathers(model: torch.nn.Module, observer=None, overlap: bool = False) -> list:
    """Times FSDP2's own all-gathers (the baseline); returns the list records accumulate in."""
    records: list = []
    for module, bucket in describe_buckets(model):
        module.set_custom_all_gather(TimedAllGather(records, bucket.index, observer, overlap))
    if overlap:
        prefetch_forward(model)
    return records
