"""ZeRO-1/2 parameter sync through CIERA, and FP32 master weights for BF16 parameters.

PyTorch's :class:`torch.distributed.optim.ZeroRedundancyOptimizer` shards the optimizer state:
each rank steps only its partition of the parameters, then ``_sync_params`` broadcasts every
rank's partition to all others, so that the parameters are replicated again. From one step to
the next those parameters move by a few units in the last place, and the broadcasts carry all
16 bits of every BF16 value. :class:`ZeroRedundancyOptimizer` here is PyTorch's, with that sync
replaced by one CIERA gather per device: with policy ``delta`` every receiver keeps the previous
values of each peer's partition and the sender sends the exact step-to-step differences (about
2 bits per BF16 value at lr 1e-4). Every parameter ends bitwise identical to PyTorch's sync, or
the step raises on every rank.

    from ciera.zero import ZeroRedundancyOptimizer, fp32_master

    model = DistributedDataParallel(model.to(torch.bfloat16))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), fp32_master(torch.optim.AdamW), lr=1e-4)
    ...
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    optimizer.last_sync          # SyncStats: wire bytes, raw bytes, seconds of the last sync
    optimizer.close()            # collective

:func:`fp32_master` wraps any ``torch.optim.Optimizer`` class so that it keeps FP32 master copies of
its (BF16) parameters, as DeepSpeed's BF16 optimizer does; given to ZeRO as ``optimizer_class``,
the masters exist only for this rank's partition.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import threading
import time
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass
from itertools import chain

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZero
from torch.optim import Optimizer

from ciera import _ext
from ciera._dist import (checked_on_every_rank, refuse_each, refused_on_every_rank, set_up_on_every_rank, start_each,
                         wait_each)
from ciera._tensors import refuse_negated, short_storage
from ciera.fsdp import lifecycle
from ciera.fsdp.layout import DTYPES
from ciera.fsdp.transport import check_engine_config, check_transport, group_beside, make_transport

__all__ = ["CieraZeroRedundancyOptimizer", "FP32MasterOptimizer", "SyncStats", "ZeroRedundancyOptimizer",
           "fp32_master"]

# PyTorch's private ZeroRedundancyOptimizer members this class overrides (its constructor, step
# and add_param_group call them) or uses (torch 2.13 here, 2.11 on the GPU image). Were one renamed,
# PyTorch's own per-parameter broadcasts would run in place of CIERA's sync, silently: refused here.
_TORCH_MEMBERS = ("_init_local_optimizer", "_build_param_buckets", "_local_step", "_sync_params",
                  "_get_is_trainable_mask", "_verify_and_init_params", "_verify_same_dense_param_type",
                  "_device_to_params_per_rank")
_missing = [name for name in _TORCH_MEMBERS if not hasattr(_TorchZero, name)]
if _missing:
    raise ImportError(f"ciera.zero: torch {torch.__version__}'s ZeroRedundancyOptimizer has no "
                      f"{', '.join(_missing)}, which ciera.zero overrides or uses (tested with torch 2.11 and 2.13)")


# --- FP32 master weights -------------------------------------------------------------------------


class _MasterState(MutableMapping):
    """The wrapper's ``state``, keyed by its own (BF16) parameters as every optimizer's is, backed
    by the inner optimizer's state of the masters. Reading gives the inner optimizer's live dict
    (ZeRO's load_state_dict edits it in place); assigning imports a saved entry, its "master" too."""

    def __init__(self, owner: "FP32MasterOptimizer"):
        self._owner = owner

    def _inner(self) -> dict:
        return self._owner.inner.state if self._owner.inner is not None else {}

    def __getitem__(self, param):
        return self._inner()[self._owner._master_of(param)]

    def __setitem__(self, param, value):
        self._owner._import_state(param, value)

    def __delitem__(self, param):
        del self._inner()[self._owner._master_of(param)]

    def __iter__(self):
        inner = self._inner()
        return (p for p, m in self._owner._masters.items() if inner.get(m))

    def __len__(self):
        return sum(1 for _ in self)


class FP32MasterOptimizer(Optimizer):
    """An optimizer over BF16 (or FP16) parameters that keeps an FP32 master copy of each: on
    step() it takes the parameters' gradients in FP32, steps the inner optimizer (`inner_class`,
    e.g. torch.optim.AdamW) on the masters, and writes the masters back into the parameters,
    rounded to the nearest even (torch's copy_). Small updates accumulate in the masters instead
    of vanishing in BF16's 8-bit mantissa. FP32 parameters are their own masters (no copy).

    Hyperparameters set on this optimizer's param_groups (lr by a scheduler, or by ZeRO, which
    syncs param_groups both ways) reach the inner optimizer at the next step. state_dict() holds
    the inner state of every parameter plus its "master"; load_state_dict() restores both.
    Use fp32_master(inner_class) for a class that ZeroRedundancyOptimizer can construct."""

    inner_class: type[Optimizer] | None = None   # set by fp32_master()

    def __init__(self, params, inner_class: type[Optimizer] | None = None, **defaults):
        inner_class = inner_class or type(self).inner_class
        _check_inner_class(inner_class)
        self._masters: dict[torch.Tensor, torch.Tensor] = {}   # parameter -> its FP32 master
        self.inner: Optimizer | None = None                     # built once the groups are known
        super().__init__(params, defaults)   # calls add_param_group per group (masters made below)
        self.inner = inner_class([self._inner_group(g) for g in self.param_groups], **defaults)
        # The inner optimizer's defaults (betas, eps, ...) fill in what the caller left out, in
        # the groups and in `defaults` (which schedulers read: OneCycleLR's cycle_momentum looks
        # for "betas" or "momentum" there, and groups added later take them from it).
        _copy_hyperparameters(self.inner.param_groups, self.param_groups)
        self.defaults = {**self.inner.defaults, **self.defaults}

    # Optimizer.__init__ assigns an empty state; the state lives in the inner optimizer.
    @property
    def state(self):
        return _MasterState(self)

    @state.setter
    def state(self, value):
        if value:
            raise AttributeError("FP32MasterOptimizer.state is the inner optimizer's; use load_state_dict()")

    def _master_of(self, param: torch.Tensor) -> torch.Tensor:
        try:
            return self._masters[param]
        except KeyError:
            raise KeyError("not a parameter of this FP32MasterOptimizer") from None

    def _make_master(self, param: torch.Tensor) -> torch.Tensor:
        if not param.is_floating_point():
            raise TypeError(f"FP32MasterOptimizer: parameters must be floating point, got {param.dtype}")
        if param.dtype in (torch.float32, torch.float64):
            return param   # already at least FP32: it is its own master
        return param.detach().to(torch.float32, copy=True)

    def _inner_group(self, group: dict) -> dict:
        for p in group["params"]:
            if p not in self._masters:
                self._masters[p] = self._make_master(p)
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [self._masters[p] for p in group["params"]]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self.inner is not None:   # after construction (ZeRO adds groups this way)
            self.inner.add_param_group(self._inner_group(self.param_groups[-1]))
            _copy_hyperparameters(self.inner.param_groups[-1:], self.param_groups[-1:])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _copy_hyperparameters(self.param_groups, self.inner.param_groups)
        stepped = []
        for p, master in self._masters.items():
            if master is p:
                continue
            # A parameter without a gradient is skipped by the inner optimizer: its master and
            # its value stay as they are.
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
            if p.grad is not None:
                stepped.append((p, master))
        try:
            self.inner.step()
        finally:
            for p, master in stepped:
                master.grad = None   # the FP32 gradients are only needed during the step
        for p, master in stepped:
            p.copy_(master)   # round to nearest even
        _copy_hyperparameters(self.inner.param_groups, self.param_groups)
        return loss

    def state_dict(self) -> dict:
        state_dict = super().state_dict()   # the inner state per parameter index (self.state)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                master = self._masters[p]
                if master is not p:
                    state_dict["state"][index] = {**state_dict["state"].get(index, {}), "master": master}
                index += 1
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(g["params"]) for saved, g in zip(groups, self.param_groups)):
            raise ValueError("FP32MasterOptimizer.load_state_dict: the saved parameter groups do not match "
                             "this optimizer's (number of groups or of parameters per group)")
        params = dict(zip(chain.from_iterable(g["params"] for g in groups),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        self.inner.state.clear()
        for index, value in state_dict["state"].items():
            if value is not None:
                self._import_state(params[index], value)
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        _copy_hyperparameters(self.param_groups, self.inner.param_groups)

    def _import_state(self, param: torch.Tensor, value: dict) -> None:
        """One parameter's saved state: the inner optimizer's part, copied to the master's device
        in its saved dtype (the moments stay FP32 whatever the parameter is), and the master."""
        master = self._master_of(param)
        value = dict(value)
        saved_master = value.pop("master", None)
        if master is not param:
            # Without a saved master (a checkpoint of a plain optimizer) the parameter is the best
            # estimate of it.
            master.copy_(saved_master if saved_master is not None else param.detach())
        self.inner.state[master] = {
            k: (v.detach().to(device=master.device, copy=True) if torch.is_tensor(v) and v.dim() > 0
                else v.detach().clone() if torch.is_tensor(v) else v)
            for k, v in value.items()}

    def __repr__(self) -> str:
        return f"FP32Master({self.inner!r})" if self.inner is not None else "FP32Master(<building>)"


def _check_inner_class(inner_class) -> None:
    if inner_class is None:
        raise TypeError("FP32MasterOptimizer needs inner_class (a torch.optim.Optimizer subclass); "
                        "or use fp32_master(inner_class)")
    if not (isinstance(inner_class, type) and issubclass(inner_class, Optimizer)):
        raise TypeError(f"fp32_master: inner_class must be a torch.optim.Optimizer subclass, got {inner_class!r}")
    if issubclass(inner_class, FP32MasterOptimizer):
        raise TypeError(f"fp32_master: {inner_class.__name__} already keeps FP32 masters")


def _copy_hyperparameters(src_groups: list[dict], dst_groups: list[dict]) -> None:
    """Every entry but the parameters, as ZeRO's _sync_param_groups does."""
    for src, dst in zip(src_groups, dst_groups):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


_FP32_CLASSES: dict[type, type] = {}


def fp32_master(inner_class: type[Optimizer]) -> type[FP32MasterOptimizer]:
    """A class constructed like `inner_class` (params, **defaults) that steps `inner_class` on FP32
    master copies of the parameters (FP32MasterOptimizer): the optimizer_class to give
    ZeroRedundancyOptimizer for BF16 parameters. The same class for the same inner_class."""
    _check_inner_class(inner_class)
    if inner_class not in _FP32_CLASSES:
        _FP32_CLASSES[inner_class] = type(f"FP32Master{inner_class.__name__}", (FP32MasterOptimizer,),
                                          {"inner_class": inner_class, "__module__": __name__,
                                           "__doc__": f"{inner_class.__name__} on FP32 master weights."})
    return _FP32_CLASSES[inner_class]


# --- ZeRO parameter sync through CIERA -----------------------------------------------------------


@dataclass
class SyncStats:
    """One parameter sync (all devices) as this rank saw it."""
    step: int = 0              # syncs so far, this one included
    raw_bytes: int = 0         # the gathered parameters, every rank's partition (this rank's own included)
    wire_bytes: int = 0        # all ranks' payloads for them
    control_bytes: int = 0     # and their control records and verdicts: the rest of what the transport carried
    seconds: float = 0.0       # wall time of the sync on this rank
    encode_s: float = 0.0      # change detection + encoding (the engine's)
    decode_s: float = 0.0
    values: int = 0            # parameter values gathered

    @property
    def bits_per_value(self) -> float:
        """The payloads' bits per value gathered; the control records (control_bytes) are left
        out, which `ciera train --zero`'s figures include: on a model of a few hundred values
        they are most of the traffic."""
        return 8.0 * self.wire_bytes / self.values if self.values else 0.0


@dataclass
class _DeviceSync:
    """The gather of one device's buckets: ONE flat tensor holding every rank's bucket in rank
    order, which is the allgatherv's output, this rank's bucket its input (in place)."""
    device: torch.device
    flat: torch.Tensor
    offsets: list[int]      # first value of rank r's bucket in `flat`
    counts: list[int]       # values of rank r's bucket
    params: list[torch.Tensor]   # every rank's trainable parameters on the device, in `flat` order
    numels: list[int]            # the values of each, as the buckets were built
    names: list[str]             # each one's name in errors ("parameter i", i its place in param_groups)
    engine: object = None

    def input(self, rank: int) -> torch.Tensor:
        return self.flat[self.offsets[rank]: self.offsets[rank] + self.counts[rank]]

    def check_views(self) -> None:
        """ConfigError unless every parameter is still the view of `flat` that the buckets made
        it: the engine writes `flat` through its pointer, and a parameter that no longer holds
        its values there would send stale ones (its own partition) or never see its peers'."""
        prefix = f"{_NAME}: "
        size = self.flat.element_size()
        # A storage freed or shrunk (untyped_storage().resize_(): `flat`'s, which the parameters
        # share): the engine would write past what is left of it. Checked once, on `flat`, naming
        # the first parameter whose values are no longer all in it; each parameter that still lies
        # at its place in `flat` (below) then lies in what is left.
        held = self.flat.untyped_storage().nbytes()
        end = (self.flat.storage_offset() + self.flat.numel()) * size
        if held < end:
            first = self.flat.storage_offset()
            for numel, name in zip(self.numels, self.names):
                first += numel
                if numel and first * size > held:
                    raise short_storage(f"{prefix}{name}", held, first * size)
        refuse_negated(self.params, prefix, self.names)
        at = self.flat.data_ptr()
        for param, numel, name in zip(self.params, self.numels, self.names):
            # A parameter of no values has no address (data_ptr() 0) and nothing to write.
            if (param.dtype != self.flat.dtype or param.numel() != numel
                    or numel and (not param.is_contiguous() or param.data_ptr() != at)):
                raise _ext.ConfigError(f"{prefix}{name} no longer lies in the optimizer's bucket: its .data was "
                                       "replaced after the optimizer was made (`.data =`, `module.to()`); write "
                                       "new values into it in place (`.copy_()`), or make the optimizer after")
            at += numel * size


_NAME = "ciera.zero.ZeroRedundancyOptimizer"
_POLICIES = ("delta", "ciera", "raw")


def _failed_set_up(rank: int) -> str:
    """set_up_on_every_rank()'s text for a stage of the engines' set-up that failed on `rank`."""
    return f"{_NAME}: rank {rank} could not set up CIERA"


def _policy(name: str):
    if name not in _POLICIES:
        raise ValueError(f"{_NAME}: policy must be one of {', '.join(map(repr, _POLICIES))}, "
                         f"got {name!r}")
    policy = getattr(_ext.ShardPolicy, name, None)
    if policy is None:
        raise _ext.ConfigError(f"{_NAME}: this build of CIERA has no {name!r} shard policy "
                               "(rebuild the extension, or pass policy='ciera')")
    return policy


def _pieces(values: int, count: int) -> list[int]:
    """`values` split into `count` pieces as evenly as possible (the first ones longer)."""
    return [values // count + (1 if k < values % count else 0) for k in range(count)]


def _listed(params) -> list:
    """`params` (tensors, or param-group dicts) as a list that can be read more than once, each
    group's "params" a list too: either may be a generator, as model.parameters() is. TypeError,
    as PyTorch's optimizers give, for a tensor or a set (a set's order differs from rank to rank,
    and so would the partition)."""
    def ordered(items, what):
        if isinstance(items, torch.Tensor) or isinstance(items, (set, frozenset)):
            raise TypeError(f"{_NAME}: {what} must be an ordered iterable (a list) of tensors, got "
                            f"{type(items).__name__}")
        try:
            return list(items)
        except TypeError:
            raise TypeError(f"{_NAME}: {what} must be an iterable of tensors or param-group dicts, got "
                            f"{type(items).__name__}") from None

    listed = []
    for item in ordered(params, "params"):
        if isinstance(item, dict) and "params" in item:
            group = item["params"]
            item = dict(item, params=[group] if isinstance(group, torch.Tensor) else ordered(group, "a group's params"))
        listed.append(item)
    return listed


def _parameters_of(params: list) -> list:
    """The tensors of `params` (_listed); TypeError for anything else."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) and "params" in item
                                                else [item])]
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{_NAME}: params must be tensors or param-group dicts of them, got {type(p).__name__}")
    return tensors


def _bucket_dtype(device, trainable: list[torch.Tensor]) -> torch.dtype | None:
    """The one dtype of the trainable parameters on `device` (None for none); TypeError unless
    they share one that CIERA carries."""
    dtypes = {p.dtype for p in trainable}
    if not dtypes:
        return None
    if len(dtypes) > 1:
        raise TypeError(f"{_NAME}: the trainable parameters on {device} must share "
                        f"one dtype (one flat bucket per device), found {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    if dtype not in DTYPES:
        raise TypeError(f"{_NAME}: CIERA carries bf16, fp16 and fp32 parameters; "
                        f"the parameters on {device} are {dtype}")
    return dtype


class ZeroRedundancyOptimizer(_TorchZero):
    """torch.distributed.optim.ZeroRedundancyOptimizer whose parameter sync is a CIERA gather.

    Everything else is PyTorch's: the partition of the parameters over ranks, the local step of
    `optimizer_class` on this rank's partition, param_groups, state_dict consolidation, join.
    The parameters of each device live in ONE flat tensor, every rank's bucket of
    ``parameters_as_bucket_view`` a view into it in rank order, so the sync gathers in place:
    this rank's bucket is the input, the flat tensor the output, and no value is copied.

    Collective, like PyTorch's: every rank constructs it with the same parameters and arguments.
    An argument some rank refuses, or a `policy`, `transport` or `chunk_values` that differs
    between ranks, raises on every rank of `process_group`, naming the rank.
    `transport`: "torch" (a gloo group beside `process_group`, or NCCL for CUDA parameters),
    "mpi" (under mpirun, CPU) or "nccl" (CUDA). `policy`: "delta" (value differences; default),
    "ciera" (exponent reuse) or "raw" (no coding; for comparison). `engine_config`: a
    ciera.EngineConfig (default: warmup_steps 0, which a value-delta stream needs none of).
    `chunk_values`: each rank's bucket is coded in pieces of at most this many values, so that
    the engine's worker threads share the encoding of a large bucket.

    All trainable parameters of a device must share one dtype (BF16, FP16 or FP32), as PyTorch's
    buckets already assume. overlap_with_ddp=True and parameters_as_bucket_view=False are
    refused (the sync needs the flat buckets). A failed sync (a dead peer, a corrupt payload)
    raises the same error on every rank; the parameters are then not to be used."""

    def __init__(self, params, optimizer_class: type[Optimizer], process_group=None, *,
                 transport: str = "torch", engine_config: _ext.EngineConfig | None = None,
                 policy: str = "delta", chunk_values: int = 1 << 22,
                 parameters_as_bucket_view: bool = True, overlap_with_ddp: bool = False, **defaults):
        checked = []   # what check() listed, for the parameters' agreement after it

        def check() -> list:
            if overlap_with_ddp:
                raise ValueError(f"{_NAME}: overlap_with_ddp=True is not supported "
                                 "(its parameters sync in DDP's communication hook, not in step())")
            if not parameters_as_bucket_view:
                raise ValueError(f"{_NAME}: parameters_as_bucket_view=False is not "
                                 "supported: the sync gathers the flat buckets of parameters_as_bucket_view=True "
                                 "(use torch.distributed.optim.ZeroRedundancyOptimizer for per-parameter broadcasts)")
            check_transport(_NAME, transport)
            check_engine_config(_NAME, "engine_config", engine_config)
            if isinstance(chunk_values, bool) or not isinstance(chunk_values, int) or chunk_values < 1:
                raise ValueError(f"{_NAME}: chunk_values must be an int >= 1, "
                                 f"got {chunk_values!r}")
            _policy(policy)
            listed = _listed(params)   # read twice: here, then by PyTorch's constructor
            checked.append(listed)
            # PyTorch's constructor's own local checks (an empty list, sparse or mixed dense
            # types), here: raised by it on one rank alone, they left the peers waiting in the
            # collective that follows (_init_local_optimizer's agreement) until the timeout.
            self._verify_and_init_params(listed)
            self._verify_same_dense_param_type()
            # The buckets' dtypes, which PyTorch's constructor would find only inside the
            # collective set-up that builds the engines (a rank alone with float64 parameters).
            trainable: dict[torch.device, list[torch.Tensor]] = {}
            for param in _parameters_of(listed):
                if param.requires_grad:
                    trainable.setdefault(param.device, []).append(param)
            for device, mine in trainable.items():
                _bucket_dtype(device, mine)
            return listed

        # Every rank checks its own arguments, and they must be the same on every rank of
        # process_group: a rank that raised alone would leave the others waiting in the engines'
        # set-up until its timeout.
        # And the parameters themselves, by position (an optimizer has no names): ranks that
        # listed others were caught only inside the engines' set-up, as a shard-size mismatch of a
        # bucket that named neither the model nor the parameters.
        params = checked_on_every_rank(_NAME, check, process_group,
                                       same={"policy": policy, "transport": transport, "chunk_values": chunk_values},
                                       parameters=lambda: [(str(i), tuple(p.shape), str(p.dtype).removeprefix("torch."))
                                                           for i, p in enumerate(_parameters_of(checked[0]))])
        # Set before PyTorch's constructor, which builds the buckets (and so the engines).
        self._policy_name = policy
        self._policy = _policy(policy)
        self._transport_kind = transport
        if engine_config is None:
            engine_config = _ext.EngineConfig()
            engine_config.warmup_steps = 0
        self._engine_config = engine_config
        self._chunk_values = chunk_values
        self._syncs: list[_DeviceSync] = []
        self._natives: dict[torch.device, object] = {}   # one transport per device, kept across rebuilds
        self._owned = lifecycle.Owned(self)               # the engines and the groups made for them
        self._builds = 0                                  # bucket builds that succeeded
        self._broken: str | None = None                   # why a rebuild failed: no step after it
        self._sync_failure: str | None = None             # why a sync failed: for good, a rebuild mends nothing
        self._closed = False
        self._stepping = threading.Lock()                 # held by the thread in step()
        self.last_sync: SyncStats | None = None
        self.sync_count = 0
        self._agreement = None
        self._rebuild_group = None
        with contextlib.ExitStack() as undo:
            # What the set-up made (engines, the groups of their transports and of the check
            # below), ended on every rank if a stage fails on any (each stage is agreed: every
            # rank leaves by the same error), now rather than when the half-built optimizer goes.
            undo.callback(self.close)
            super().__init__(params, optimizer_class, process_group=process_group, parameters_as_bucket_view=True,
                             overlap_with_ddp=False, **defaults)
            # The per-step check that the ranks agree on trainability runs here: gloo, on the host,
            # failing after the engines' timeout (process_group's own may wait 30 minutes for a dead
            # peer).
            # And the rebuilds' agreements (_set_up_group) on a group of their own, as bounded: a
            # rank alone in add_param_group would otherwise wait in them for its peers until
            # process_group's timeout (30 minutes by default), where it waited out the engine's
            # before they were agreed. Not the check's group: a rebuild's first exchange would pair
            # with a peer's check in step().
            if self.world_size > 1:
                def engine_timeout_group():
                    group = group_beside(self.process_group, "gloo",
                                         datetime.timedelta(seconds=self._engine_config.timeout_s))
                    self._owned.groups.append(group)
                    return group

                self._agreement = set_up_on_every_rank(engine_timeout_group, self.process_group, _failed_set_up)
                self._rebuild_group = set_up_on_every_rank(engine_timeout_group, self.process_group, _failed_set_up)
            undo.pop_all()

    # -- buckets ---------------------------------------------------------------------------------

    def _init_local_optimizer(self) -> None:
        """PyTorch's local optimizer on this rank's partition, agreed on every rank: PyTorch makes
        it before the collective set-up of the engines, so an argument it refuses on one rank
        (lr=-1 there, an optimizer that takes only 2-D parameters and got another kind in this
        rank's partition) raised on that rank alone while its peers waited in the set-up until
        the timeout."""
        checked_on_every_rank(_NAME, super()._init_local_optimizer, self.process_group)

    def _build_param_buckets(self) -> None:
        """PyTorch's buckets (rank r's trainable parameters on a device, flattened in partition
        order; non-trainable ones cloned out; a dummy for a rank with none), with every rank's
        bucket a view into one flat tensor per device; then the engines over them. Collective:
        PyTorch calls it at construction, on add_param_group and when trainability changes, on
        every rank alike."""
        if self._closed:
            raise ValueError(f"{_NAME} is closed (close()); its buckets cannot be rebuilt")
        try:
            self._build_buckets_and_engines()
        except BaseException as failure:
            # The partition may already be the new one (add_param_group appended its group before
            # this), the engines are gone: a later step must not run as if it synced.
            self._broken = f"its buckets could not be rebuilt ({type(failure).__name__}: {failure})"
            raise
        self._builds += 1
        self._broken = None

    def _build_buckets_and_engines(self) -> None:
        # Each stage's local work (the checks of the new buckets, then the flat tensors made and
        # filled: an out-of-memory) agreed on every rank before the next: one that raised on one
        # rank alone (a float64 parameter added or unfrozen there) left its peers in the engines'
        # set-up, waiting out the engine's timeout and then process_group's.
        # And the parameters alike, as at construction (a group added with a [2, 3] parameter on
        # one rank and a [3, 2] one on another synced the same bytes into different shapes).
        plans = checked_on_every_rank(
            _NAME, self._plan_buckets, self._set_up_group(),
            parameters=lambda: [(str(i), tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
                                for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))])
        self._close_engines()
        checked_on_every_rank(_NAME, lambda: self._fill_buckets(plans), self._set_up_group())
        self._open_engines()

    def _plan_buckets(self) -> list:
        """(device, every rank's parameters on it, their trainable ones, the bucket's dtype) per
        device; a TypeError unless each device's trainable parameters share a dtype CIERA carries.
        Checked before the old engines are closed."""
        plans = []
        for device, params_per_rank in self._device_to_params_per_rank.items():
            trainable = [[p for p in params if p.requires_grad] for params in params_per_rank]
            plans.append((device, params_per_rank, trainable,
                          _bucket_dtype(device, [p for mine in trainable for p in mine])))
        return plans

    def _fill_buckets(self, plans: list) -> None:
        """Every device's flat tensor, every rank's trainable parameters moved into it as views
        (self._buckets, self._syncs, no engines yet)."""
        index = {id(p): i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}
        self._buckets = [[] for _ in self._device_to_params_per_rank]
        self._syncs = []
        for dev_i, (device, params_per_rank, trainable, dtype) in enumerate(plans):
            for params in params_per_rank:
                for param in params:
                    if not param.requires_grad:
                        # As PyTorch does: its data may be a view of an earlier bucket.
                        param.data = param.data.detach().clone()
            counts = [sum(p.numel() for p in mine) for mine in trainable]
            in_flat = [p for mine in trainable for p in mine]
            offsets = [sum(counts[:r]) for r in range(self.world_size)]
            flat = torch.empty(sum(counts), dtype=dtype or torch.float32, device=device)
            for r, mine in enumerate(trainable):
                offset = offsets[r]
                for param in mine:
                    view = flat[offset: offset + param.numel()]
                    view.copy_(param.data.flatten())
                    param.data = view.view_as(param.data)
                    offset += param.numel()
                # PyTorch's dummy bucket for a rank with nothing to send here; it is not gathered.
                self._buckets[dev_i].append(flat[offsets[r]: offsets[r] + counts[r]] if counts[r]
                                            else torch.zeros(1, device=device))
            if sum(counts):
                self._syncs.append(_DeviceSync(device, flat, offsets, counts, in_flat, [p.numel() for p in in_flat],
                                               [f"parameter {index.get(id(p), '?')}" for p in in_flat]))

    def _open_engines(self) -> None:
        """One engine per device with parameters, one bucket each: rank r's shards are its bucket
        in `pieces` near-equal pieces (the same count on every rank, some maybe empty)."""
        if (self._transport_kind == "mpi" and self._syncs
                and dist.get_world_size(self.process_group) != dist.get_world_size()):
            raise ValueError("ciera.zero.ZeroRedundancyOptimizer: transport 'mpi' gathers over every process of "
                             "the job (MPI_COMM_WORLD); with a process_group of some of them use transport 'torch'")
        for sync in self._syncs:
            pieces = max(1, max(math.ceil(n / self._chunk_values) for n in sync.counts))
            layout = _ext.BucketLayout()
            layout.name = f"zero:{sync.device}"
            layout.dtype = DTYPES[sync.flat.dtype]
            layout.shard_values = [_pieces(n, pieces) for n in sync.counts]
            layout.policy = [self._policy] * pieces
            # One transport per device for the optimizer's life: a rebuild (add_param_group, a
            # change of trainability) made a new process group each time, and gloo's groups stay
            # until the process exits (5 file descriptors and 3 threads each). Released by
            # close() (at construction, by the constructor when a later stage fails).
            native = self._natives.get(sync.device)
            if native is None:
                native = self._set_up_on_every_rank(
                    lambda: make_transport(self._transport_kind, self.process_group, self._engine_config.timeout_s,
                                           sync.device, made=self._owned.groups))
                self._natives[sync.device] = native
            self._set_up_on_every_rank(lambda: self._open_engine(sync, native, layout))

    def _open_engine(self, sync: "_DeviceSync", native, layout) -> None:
        cuda = sync.device.type == "cuda"
        sync.engine = _ext.Engine(native, self._engine_config, [layout],
                                  device=(sync.device.index if sync.device.index is not None
                                          else torch.cuda.current_device()) if cuda else -1)
        lifecycle.register_engine(sync.engine)
        self._owned.engines.append(sync.engine)

    def _set_up_on_every_rank(self, stage):
        """set_up_on_every_rank() over _set_up_group() for one stage of the engines' set-up (at
        construction and in every rebuild): a transport or engine that failed on one rank alone
        left its peers in the engine's configuration agreement, or in the next sync, until the
        timeout. On a failure anywhere every rank closes the engines of this build (this stage's
        included), so that every rank's _build_param_buckets fails alike, leaving it broken."""
        return set_up_on_every_rank(stage, self._set_up_group(), _failed_set_up, lambda _: self._close_engines())

    def _set_up_group(self):
        """The group the engines' set-up agrees on: process_group in the constructor (every rank
        is in it, checked_on_every_rank saw them), then, in rebuilds, the group made for them,
        whose collectives fail after the engine's timeout."""
        return self._rebuild_group if self._rebuild_group is not None else self.process_group

    def _close_engines(self) -> None:
        for sync in self._syncs:
            if sync.engine is not None:
                lifecycle.close_engine(sync.engine)
                self._owned.engines.remove(sync.engine)
                sync.engine = None

    # -- the sync --------------------------------------------------------------------------------

    def step(self, closure=None, **kwargs):
        """PyTorch's step: this rank's partition, then the sync. One call at a time: a second
        thread's step() while one is in flight is a RuntimeError on its rank, before its local step
        rewrites parameters that the first one's sync reads."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError(f"{_NAME}.step: another thread's step() is in flight; steps must not overlap")
        try:
            return super().step(closure, **kwargs)
        finally:
            self._stepping.release()

    def _local_step(self, *args, **kwargs):
        """PyTorch's local step (this rank's partition). If it raises (an out-of-memory as the
        optimizer state is made, a closure's error: each rank steps its own partition), this rank
        still takes part in the sync its peers are already in, by refusing it: they fail at once,
        naming this rank, instead of waiting for it until the timeout. Not where the step first
        rebuilds the buckets (trainability changed), a collective in which the peers may have
        failed too."""
        if self._closed:   # before PyTorch's step changes this rank's partition and its state
            raise ValueError("ciera.zero.ZeroRedundancyOptimizer is closed (close()); it cannot step")
        self._require_whole()
        mask = self._get_is_trainable_mask()
        self._require_same_trainability(mask)
        builds = self._builds
        if mask == self._is_trainable_mask:   # else PyTorch rebuilds the buckets first, from the parameters
            try:
                # The parameters must still lie in their buckets (check_views) before the local
                # step writes this rank's partition through them; refused as a failed step is.
                refused_on_every_rank(self._check_views, self._refuse_sync_as_checked)
            except Exception as failure:
                self._sync_failure = (f"the parameter sync of step {self.sync_count + 1} failed "
                                      f"({type(failure).__name__}: {failure})")
                raise
        try:
            return super()._local_step(*args, **kwargs)
        except Exception as failure:
            # A rebuild this step that failed is a collective whose peers failed too; one that
            # succeeded (or none) leaves them in the sync, which this rank refuses.
            if mask == self._is_trainable_mask or self._builds > builds:
                self._refuse_sync(f"its optimizer step failed: {type(failure).__name__}: {failure}")
                # The peers' partitions moved on and this rank's did not reach them: no rank's
                # parameters are the ones torch's ZeRO would hold.
                self._sync_failure = (f"the parameter sync of step {self.sync_count + 1} failed "
                                      f"({type(failure).__name__}: {failure})")
            raise

    def _require_whole(self) -> None:
        why = self._sync_failure or self._broken
        if why is not None:
            raise RuntimeError(f"{_NAME}: {why}; it cannot step or sync any more (make a new optimizer)")

    def _require_same_trainability(self, mask: list[bool]) -> None:
        """Every rank must freeze and unfreeze the same parameters: a rank that rebuilds its
        buckets alone would wait in the engines' set-up while its peers wait in the sync, until
        the timeout. One all-gather of 8 bytes per step, on a gloo group of its own."""
        if self._agreement is None:
            return
        mine = torch.tensor([zlib.crc32(bytes(mask)) | (len(mask) << 32)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(every, mine, group=self._agreement)
        except RuntimeError as e:   # gloo's: a peer dead, stalled past the timeout, or closed
            raise _ext.CommError(f"{_NAME}: the ranks' check before step() failed (a peer dead, stalled "
                                 f"past {self._engine_config.timeout_s:g} s, or its optimizer closed): {e}") from e
        differing = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
        if differing:
            raise _ext.ConfigError(f"{_NAME}: the ranks differ in which parameters are trainable "
                                   f"(requires_grad): rank {differing[0]}'s differ from rank 0's; every rank "
                                   "must freeze and unfreeze the same parameters before step()")

    def _refuse_sync(self, reason: str) -> None:
        """Refuses this step's gather of every device's engine, in the order _sync_params starts
        them, so that no peer's gather is left waiting."""
        refuse_each([(sync.engine, 0) for sync in self._syncs if sync.engine is not None], reason)

    def _check_views(self) -> None:
        for sync in self._syncs:
            sync.check_views()

    def _refuse_sync_as_checked(self, text: str) -> None:
        # The peers hear it cut to 76 bytes (kErrorTextBytes): the class's name would fill half.
        self._refuse_sync(text.removeprefix(f"{_NAME}: "))

    def _sync_params(self) -> None:
        """Every rank's partition to every rank: one in-place CIERA gather per device, started
        together and waited for in order. Raises on every rank if any rank's gather failed."""
        if self._closed:
            raise ValueError("ciera.zero.ZeroRedundancyOptimizer is closed (close()); it cannot sync parameters")
        self._require_whole()
        start = time.perf_counter()

        def start_one(k: int):
            sync = self._syncs[k]
            mine = sync.input(self.rank)
            stream = torch.cuda.current_stream(sync.device).cuda_stream if sync.device.type == "cuda" else 0
            return sync.engine.start(0, mine.data_ptr(), mine.numel() * mine.element_size(), sync.flat.data_ptr(),
                                     sync.flat.numel() * sync.flat.element_size(), stream, keep=(mine, sync.flat))

        try:
            # Again after the local step, whose optimizer class may have moved a parameter out of
            # its bucket too (and after a rebuild, which the check before it skips).
            refused_on_every_rank(self._check_views, self._refuse_sync_as_checked)
            tickets = start_each([(sync.engine, 0) for sync in self._syncs], start_one)
            stats = wait_each([(sync.engine, t) for sync, t in zip(self._syncs, tickets)])
        except BaseException as failure:
            # Every rank's gather failed alike, but each has stepped its own partition: the
            # parameters are no longer torch's ZeRO's anywhere, so nothing may step on them.
            self._sync_failure = (f"the parameter sync of step {self.sync_count + 1} failed "
                                  f"({type(failure).__name__}: {failure})")
            raise
        finally:
            # The engine wrote the peers' partitions through the flat tensor's pointer, unseen by
            # autograd, and the local step moved only this rank's versions: a backward that saved
            # a parameter before step() failed on its owner alone and went on with the new values
            # elsewhere. Every parameter synced counts as written, on every rank (a failed sync
            # too: it may have written some).
            torch.autograd.graph.increment_version([p for sync in self._syncs for p in sync.params])
        self.sync_count += 1
        self.last_sync = SyncStats(step=self.sync_count, raw_bytes=sum(s.raw_bytes for s in stats),
                                   wire_bytes=sum(s.wire_bytes for s in stats),
                                   control_bytes=sum(s.control_bytes for s in stats),
                                   seconds=time.perf_counter() - start,
                                   encode_s=sum(s.encode_s for s in stats), decode_s=sum(s.decode_s for s in stats),
                                   values=sum(sync.flat.numel() for sync in self._syncs))

    # -- the rest --------------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        return self._policy_name

    @property
    def engines(self) -> list:
        """The engines, one per device with trainable parameters (none after a failed rebuild,
        which closed them)."""
        return [sync.engine for sync in self._syncs if sync.engine is not None]

    @property
    def cache_bytes(self) -> int:
        """Codec state this rank holds (the previous values of every peer's partition, for
        delta); a ValueError after close()."""
        if self._closed:
            raise ValueError("ciera.zero.ZeroRedundancyOptimizer is closed (close())")
        return sum(engine.cache_bytes for engine in self.engines)

    @property
    def closed(self) -> bool:
        return self._closed

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_closed", False):   # before PyTorch adds it (PyTorch's constructor calls this too)
            raise ValueError(f"{_NAME} is closed (close()); it takes no parameter group")
        super().add_param_group(param_group)
        if self.initialized:   # its buckets rebuilt for the mask as it is now
            self._is_trainable_mask = self._get_is_trainable_mask()

    def _get_is_trainable_mask(self) -> list[bool]:
        """Whether each parameter of param_groups is trainable. PyTorch's reads the parameters
        given at construction only: one added by add_param_group frozen, then unfrozen on every
        rank, never entered a bucket, and its owner's steps reached no other rank, in silence
        (PyTorch's own optimizer too)."""
        return [p.requires_grad for group in self.param_groups for p in group["params"]]

    def close(self) -> None:
        """Ends the engines (collective when their transport is) and the process groups made for
        them; closing twice is harmless. Not while this rank's step() is in flight on another
        thread: a RuntimeError then, the optimizer left open (closed under it, the step would
        still have rewritten this rank's partition, and only then failed, its peers with it)."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError(f"{_NAME}.close: a step() of this optimizer is in flight; close it after")
        try:
            if not self._closed:
                self._close_engines()
                self._natives.clear()
                self._owned.release()
                # Released above; held here, the group object kept its threads and descriptors
                # (3 and 5) for as long as the closed optimizer lived.
                self._agreement = self._rebuild_group = None
                self._closed = True
        finally:
            self._stepping.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


CieraZeroRedundancyOptimizer = ZeroRedundancyOptimizer   # the same class, named apart from PyTorch's
