"""Which bytes of FSDP2's flat all-gather buffers belong to which parameter.

The one module that reads FSDP2's private state (``torch.distributed.fsdp._fully_shard``: the
parameter groups, their padded shard sizes and mixed-precision policy, and the collective
interfaces a custom all-gather implements). A torch release that moves them breaks here only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter  # noqa: F401

from ciera import _ext

# The torch dtypes CIERA carries, as the codec names them.
DTYPES = {torch.bfloat16: _ext.DType.bf16, torch.float16: _ext.DType.fp16, torch.float32: _ext.DType.fp32}


@dataclass
class ParamSlice:
    name: str
    numel: int    # padded shard values, the same on every rank
    offset: int   # first value of this parameter in a rank's shard of the bucket
    full_numel: int = 0  # values of the whole (unsharded, unpadded) parameter


@dataclass
class Bucket:
    """One FSDP parameter group: one engine bucket whose shards are the group's parameters."""
    index: int
    module_name: str
    dtype: torch.dtype
    params: list[ParamSlice]
    numel: int    # values per rank

    def param_range(self, rank: int, k: int) -> tuple[int, int]:
        """[first, end) value offsets of parameter k's shard of `rank` in the gathered buffer."""
        start = rank * self.numel + self.params[k].offset
        return start, start + self.params[k].numel


def _param_group(module: FSDPModule):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.12 and earlier (the GPU machine's 2.11): one optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    if len(groups) > 1:
        raise _ext.ConfigError(f"{type(module).__name__}: CIERA needs one FSDP parameter group per module")
    return groups[0] if groups else None


def _bucket(index: int, module_name: str, group, names: dict) -> Bucket:
    dtypes = set()
    params, offset = [], 0
    mp = group.mp_policy
    for fp in group.fsdp_params:
        # What FSDP all-gathers: the mixed-precision param dtype for floating-point parameters
        # (FSDP sets param_dtype only at its lazy init, after enable() typically runs).
        orig = fp.sharded_param.dtype
        dtype = mp.param_dtype if (mp.param_dtype is not None and orig.is_floating_point) else orig
        dtypes.add(dtype)
        name = names.get(id(fp.sharded_param), f"{module_name}.<param>")
        if dtype not in DTYPES:
            raise TypeError(f"CIERA carries bf16, fp16 and fp32 parameters; {name} is {dtype}")
        numel = fp.padded_sharded_param_size.numel()
        params.append(ParamSlice(name, numel, offset, fp.sharded_param.numel()))
        offset += numel
    if len(dtypes) != 1:
        raise TypeError(f"{module_name}: parameters of one FSDP group must share a "
                        f"dtype for CIERA, found {sorted(map(str, dtypes))}")
    return Bucket(index, module_name, dtypes.pop(), params, offset)


def _param_groups(model: torch.nn.Module):
    """(module, its FSDP parameter group) of every FSDP module that has parameters, in module order."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = _param_group(module)
            if group is not None and group.fsdp_params:
                yield module, group


def describe_buckets(model: torch.nn.Module) -> list[tuple[FSDPModule, Bucket]]:
    """One bucket per FSDP parameter group, in module order (the same on every rank)."""
    names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n for n, m in model.named_modules()}
    out = []
    for module, group in _param_groups(model):
        out.append((module, _bucket(len(out), module_names.get(id(module), ""), group, names)))
    return out


@dataclass
class GatherGroup:
    """One kind of process group FSDP2 gathers on, as CIERA sees it. Kind 0 is the shard group
    (every forward gather, and backward ones without partial resharding); with
    `reshard_after_forward=N`, FSDP2 reshards a layer to N ranks after its forward, and the backward
    re-gather runs on those N (kind 1). Each rank is in one group of each kind; `partition` lists
    them all (they split the world), the same on every rank. CIERA runs one engine per kind on
    this rank's group: its transport, caches and selection state are that group's."""
    kind: int
    ranks: tuple[int, ...]                    # this rank's group: world ranks, in group rank order
    partition: tuple[tuple[int, ...], ...]    # every group of this kind
    factor: int                               # values per rank, relative to the shard group's
    buckets: list[Bucket]                     # every bucket, its shards as this kind holds them
    gathered: set[int]                        # indices of the buckets FSDP gathers on this kind
    engine: object = None

    @property
    def size(self) -> int:
        return len(self.ranks)


def _partition(mesh_info) -> tuple[tuple[int, ...], ...]:
    """Every shard group of `mesh_info`'s mesh (rows of ranks along its shard dimension)."""
    ranks = mesh_info.mesh.mesh.movedim(mesh_info.shard_mesh_dim, -1)
    return tuple(tuple(int(r) for r in row) for row in ranks.reshape(-1, ranks.shape[-1]).tolist())


def _scaled(bucket: Bucket, factor: int) -> Bucket:
    """`bucket` as a group `factor` times smaller holds it: each rank's shard of every parameter
    `factor` times longer (FSDP2 cuts the post-forward shard out of the padded unsharded
    parameter, so the padding scales too)."""
    params = [ParamSlice(p.name, p.numel * factor, p.offset * factor, p.full_numel) for p in bucket.params]
    return Bucket(bucket.index, bucket.module_name, bucket.dtype, params, bucket.numel * factor)


def describe_groups(described: list[tuple[FSDPModule, Bucket]]) -> list[GatherGroup]:
    """The process groups FSDP2 gathers the buckets on: the shard group (kind 0), then each
    distinct post-forward group (reshard_after_forward=N), in module order. ConfigError unless
    every parameter group is sharded on the same mesh."""
    import torch.distributed as dist

    kinds: list[GatherGroup] = []
    for module, bucket in described:
        group = _param_group(module)
        infos = [group.mesh_info]
        if group._use_post_forward_mesh:
            infos.append(group.post_forward_mesh_info)
        for depth, info in enumerate(infos):
            partition = _partition(info)
            match = next((k for k in kinds if k.partition == partition), None)
            if depth == 0 and kinds and match is not kinds[0]:
                raise _ext.ConfigError(
                    f"{bucket.module_name or 'root'} is sharded on ranks {partition}, other FSDP modules on "
                    f"{kinds[0].partition}: CIERA needs every module on the same mesh")
            if match is None:
                shard_size = len(partition[0]) if not kinds else kinds[0].size
                if shard_size % len(partition[0]):
                    raise _ext.ConfigError(f"post-forward groups of {len(partition[0])} ranks do not divide the "
                                           f"shard group of {shard_size}")
                factor = shard_size // len(partition[0])
                mine = tuple(dist.get_process_group_ranks(info.shard_process_group))
                if mine not in partition:
                    row = next((r for r in partition if sorted(r) == sorted(mine)), None)
                    if row is not None:   # torch's groups hold their ranks in ascending order
                        raise _ext.ConfigError(f"the mesh lists this rank's FSDP group as {row}, its process group "
                                               f"holds them as {mine}: CIERA needs mesh rows in ascending rank order")
                    raise _ext.ConfigError(f"this rank's FSDP group {mine} is not one of the mesh's {partition}")
                match = GatherGroup(len(kinds), mine, partition, factor,
                                    [_scaled(b, factor) for _, b in described], set())
                kinds.append(match)
            match.gathered.add(bucket.index)
    return kinds


def lone_shard_group(model: torch.nn.Module):
    """The process group FSDP2 shards `model` on, where every FSDP module's mesh is that one
    group of some of the world's ranks (a mesh made on a subgroup: the other ranks train apart,
    or not at all) and none reshards to a smaller group after forward; else None. From the
    meshes alone (no bucket is built, so a model enable() must refuse still finds the group to
    refuse it on), and local: no collective. A model it cannot read gives None: the callers'
    checks then refuse it on every rank, with its reason."""
    import torch.distributed as dist

    found = None
    try:
        for _, group in _param_groups(model):
            if group._use_post_forward_mesh or len(_partition(group.mesh_info)) != 1:
                return None
            process_group = group.mesh_info.shard_process_group
            if found is not None and process_group is not found:
                return None
            found = process_group
    except Exception:  # noqa: BLE001 - refused by the callers' checks, on every rank
        return None
    return found if found is not None and dist.get_world_size(found) != dist.get_world_size() else None


def is_hsdp(module: FSDPModule) -> bool:
    """Whether `module`'s parameters are sharded on an HSDP mesh (replicated across its first dimension)."""
    group = _param_group(module)
    return group is not None and group._is_hsdp


def all_gather_comm(module: FSDPModule):
    """The all-gather FSDP2 currently uses for `module`'s parameter group (for tests)."""
    return _param_group(module)._all_gather_comm


def reduce_scatter_comm(module: FSDPModule):
    """The reduce-scatter FSDP2 currently uses for `module`'s parameter group."""
    return getattr(_param_group(module), "_reduce_scatter_comm", None)  # torch 2.12 and earlier: none


def prefetch_forward(model: torch.nn.Module) -> list:
    """Makes each FSDP module start the next one's all-gather (in model.modules() order) before it
    runs (FSDP2 prefetches backward gathers itself, forward ones only when told), so an in-flight
    gather overlaps compute. Returns what each module prefetched before, for
    restore_forward_prefetch. As with FSDP2's own set_modules_to_forward_prefetch, every forward
    must then run the modules in that order: a module prefetched and then skipped keeps the
    values it gathered, and a change to its parameters before it next runs is not seen."""
    modules = [m for m, _ in describe_buckets(model)]
    before = [(m, list(m._get_fsdp_state()._states_to_forward_prefetch)) for m in modules]
    for current, following in zip(modules, modules[1:]):
        current.set_modules_to_forward_prefetch([following])
    return before


def restore_forward_prefetch(before: list) -> None:
    """Puts back the forward prefetch prefetch_forward() replaced."""
    for module, states in before:
        module._get_fsdp_state()._states_to_forward_prefetch = list(states)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def full_parameter(bucket: Bucket, k: int, output: torch.Tensor, world: int) -> torch.Tensor:
    """Parameter k of a gathered bucket as one flat tensor: its shards from every rank,
    concatenated, without FSDP's padding (which sits at the end: dim-0 chunks are ceil-sized)."""
    p = bucket.params[k]
    pieces = [output[r * bucket.numel + p.offset: r * bucket.numel + p.offset + p.numel] for r in range(world)]
    return torch.cat(pieces)[: p.full_numel]
