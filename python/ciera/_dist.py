"""torch.distributed's single-tensor collectives under the names the installed torch has: 2.13
calls them ``all_gather_single`` / ``reduce_scatter_single`` and warns (FutureWarning) at every
call of the old ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older releases (the GPU
image's 2.11) have only the old names. Same arguments either way.

And agree_before_set_up: a rank's local failure before a collective set-up, or settings that differ
between ranks, raised on every rank; refused_on_every_rank: the same for one collective call, through
the library's own refusal of it."""

import hashlib

import torch.distributed as dist

from ciera import _ext

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The exception types a rank's local failure is raised as on every rank; anything else is a
# ConfigError (the set-up refused), with the original type named in its text.
_SAME_TYPE = {"ValueError": ValueError, "TypeError": TypeError, "ImportError": ImportError}


def _gather_failures(failure: BaseException | None, same: dict | None, group, parameters=None) -> list:
    """Every rank's (failure as (type name, text) or None, `same`, a digest of `parameters`), in
    group rank order. A digest, not the list: a model of thousands of parameters on a thousand
    ranks would send every rank megabytes."""
    everyone = [None] * dist.get_world_size(group)
    digest = None if parameters is None else hashlib.sha256(repr(parameters).encode()).hexdigest()
    mine = (None if failure is None else (type(failure).__name__, str(failure)), same or {}, digest)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _world_ranks(group, size: int):
    """The world ranks of `group`'s members in group rank order (the world's: 0..size-1): errors
    name world ranks, the ranks a user launched, not ranks within a group."""
    return dist.get_process_group_ranks(group) if group is not None else range(size)


def parameter_shapes(model) -> list:
    """The model's parameters as every rank of a sharded training must have them alike: (name,
    global shape, dtype) in order."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]


def _described(parameter: tuple) -> str:
    return " ".join([str(list(parameter[1])), *map(str, parameter[2:])])


def _first_parameter_difference(everyone: list, ranks) -> str | None:
    """Where the ranks' parameter_shapes() (`everyone`, of world ranks `ranks`) first differ from
    the first rank's, in words; None if nowhere."""
    first, base = everyone[0], ranks[0]
    for rank, other in zip(ranks[1:], everyone[1:]):
        if other == first:
            continue
        for i, (mine, theirs) in enumerate(zip(first, other)):
            if mine[0] != theirs[0]:
                return f"parameter {i} is '{mine[0]}' on rank {base}, '{theirs[0]}' on rank {rank}"
            if mine != theirs:   # (name, shape, dtype, and what else a framework adds, in words)
                return (f"parameter '{mine[0]}' is {_described(mine)} on rank {base}, "
                        f"{_described(theirs)} on rank {rank}")
        return f"rank {base} has {len(first)} parameters, rank {rank} has {len(other)}"
    return None


def checked_on_every_rank(what: str, step, group=None, same: dict | None = None, parameters=None):
    """`step()`: this rank's local checks and preparation before a collective set-up (no
    collective in it), then agree_before_set_up(what, whatever it raised, group, same, and
    `parameters()`'s parameter_shapes() if given). Returns what `step` returned, where it
    succeeded on every rank and `same` and the parameters agree; else raises the same error on
    every rank. Collective: one all_gather_object (a second where the parameters differ)."""
    failure = result = shapes = None
    try:
        result = step()
        shapes = None if parameters is None else parameters()
    except Exception as e:  # noqa: BLE001 - raised on every rank by agree_before_set_up
        failure = e
    agree_before_set_up(what, failure, group, same, shapes)
    return result


def _failures(failure: BaseException | None, group=None) -> tuple[list[tuple[int, str, str]], int]:
    """Collective over `group` (default the world): which ranks' local step failed (`failure`:
    this rank's exception, or None). Returns (rank, type name, text) of each rank that failed, in
    rank order, and the group's size: the same on every rank."""
    everyone = _gather_failures(failure, None, group)
    return ([(rank, *failed) for rank, (failed, _, _) in zip(_world_ranks(group, len(everyone)), everyone)
             if failed is not None], len(everyone))


def set_up_on_every_rank(stage, group, failed_text, cleanup=None):
    """`stage()` (one step of a collective set-up: a transport, a measured cost model, an engine),
    then whether it succeeded on every rank of `group` (one small all_gather_object): returns what
    it returned where it did. Else, on every rank, `cleanup(result)` (what this rank's stage
    returned, None where it failed: to release what the ranks that succeeded made) and: the
    stage's own error where every rank failed alike (an engine's configuration agreement throws
    the same text everywhere), otherwise a ConfigError, `failed_text(rank)` followed by that rank's
    error, naming the first rank that failed.

    Agreed after each stage, not once at the end: a rank that failed alone would skip the later
    stages, whose collectives (a cost model's measurement on the transport, the engine's
    configuration agreement) its peers would enter and wait in for it until their timeout. A stage
    whose own collective one rank failed to enter (a torch group it never made) still waits out its
    timeout: only the checks before the set-up (checked_on_every_rank) can prevent that."""
    failure = result = None
    try:
        result = stage()
    except Exception as e:  # noqa: BLE001 - any failure: the other ranks must hear of it, not wait
        failure = e
    failed, size = _failures(failure, group)
    if not failed:
        return result
    if cleanup is not None:
        cleanup(result)
    try:
        if failure is not None and len(failed) == size and all(f[1:] == failed[0][1:] for f in failed):
            raise failure
        rank, kind, text = failed[0]
        raise _ext.ConfigError(f"{failed_text(rank)}: {kind}: {text}") from failure
    finally:
        # `failure`'s traceback holds this frame: holding `failure` too, it made a cycle that
        # kept the callers' frames, and the transports of their earlier stages (an MPI or NCCL
        # communicator), to the next garbage collection instead of going with the error.
        failure = result = None


def agree_before_set_up(what: str, failure: BaseException | None, group=None, same: dict | None = None,
                        parameters: list | None = None) -> None:
    """Before a collective set-up, a step that reads this rank's own arguments or state (checks,
    a user's callable; `failure`: what it raised, or None) and the settings every rank must share
    (`same`, name -> value; they must compare equal, not merely look alike). If the step failed on
    any rank: the lowest such rank's error on every rank of `group`, naming it (a ValueError,
    TypeError or ImportError keeps its type, anything else is a ConfigError; a text that starts
    with `what` does not repeat it). Else, if a setting differs: a ConfigError on every rank
    naming the first that does and each rank's value; else, if `parameters` (parameter_shapes(),
    where the set-up needs the ranks' models alike) differ: a ConfigError on every rank naming the
    first parameter that does. So no rank raises alone while the others
    wait in the next collective until its timeout, and no ranks go on to make different calls.
    Collective: one all_gather_object (a second where the parameters differ); none without a
    default process group, where `failure` (if any) is raised as it is and there is no one to
    agree with."""
    if not dist.is_initialized():
        if failure is not None:
            raise failure
        return
    if group is not None and dist.get_world_size(group) < 0:
        # torch's answer on a rank outside the group, where a collective on it returns at once
        # and does nothing: this rank would go on as if every rank had agreed.
        raise _ext.ConfigError(f"{what}: rank {dist.get_rank()} is not in process_group; only its ranks may call it"
                               f" with that group")
    everyone = _gather_failures(failure, same, group, parameters)
    world_rank = _world_ranks(group, len(everyone))
    for rank, (failed, _, _) in zip(world_rank, everyone):
        if failed is not None:
            kind, text = failed
            text = text.removeprefix(f"{what}: ")
            error = _SAME_TYPE.get(kind)
            if error is None:
                error, text = _ext.ConfigError, (text if kind in ("ConfigError", "Error") else f"{kind}: {text}")
            raise error(f"{what}: on rank {rank}: {text}")
    for name in same or {}:
        values = [settings.get(name) for _, settings, _ in everyone]
        if any(v != values[0] for v in values[1:]):
            ranks: dict[str, list[int]] = {}
            for rank, value in zip(world_rank, values):
                ranks.setdefault(repr(value), []).append(rank)
            held = "; ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                             for value, r in ranks.items())
            raise _ext.ConfigError(f"{what}: the ranks differ in {name}: {held}")
    if parameters is not None and any(digest != everyone[0][2] for _, _, digest in everyone):
        # Every rank saw the digests differ: the lists themselves, to name the first difference.
        lists = [None] * len(everyone)
        dist.all_gather_object(lists, parameters, group=group)
        difference = _first_parameter_difference(lists, world_rank)
        raise _ext.ConfigError(f"{what}: the ranks' models differ: "
                               f"{difference or 'their parameters print alike but do not compare equal'}")


def refused_on_every_rank(check, refuse) -> None:
    """`check()`: this rank's checks of one collective call's arguments, before the call. If they
    raise, this rank still takes part in the call, by `refuse(text)` (Engine.refuse,
    LosslessCollectives.refuse_reduce_scatter: every rank's call fails at once, naming this rank),
    and then raises its own error. Raised here alone, it would leave the peers waiting in the call
    for this rank until its timeout. No collective when the checks pass."""
    try:
        check()
    except Exception as failure:
        try:
            refuse(str(failure))
        except Exception:   # noqa: BLE001 - the refusal, as this rank sees it: `failure` says more
            pass
        raise


def refuse_each(refusals, reason: str) -> None:
    """engine.refuse(bucket, reason) for each (engine, bucket) in `refusals`, in order (the order
    the peers wait for them). Each refusal's own error (the refusal as this rank sees it, or a
    bucket that cannot be refused) is dropped: the caller raises the failure that matters."""
    for engine, bucket in refusals:
        try:
            engine.refuse(bucket, reason)
        except Exception:  # noqa: BLE001 - see above
            pass


def start_each(gathers, start) -> list:
    """The tickets of start(k) for each k-th (engine, bucket) of `gathers`, in the order the peers
    start them. If one cannot start on this rank, it and the rest are refused in order (the peers,
    who start them all, fail them at once rather than wait for this rank until the timeout) and
    those started are waited for (none left in flight, to find its bucket busy at the next call)
    before its error is raised."""
    tickets = []
    for k in range(len(gathers)):
        try:
            tickets.append(start(k))
        except Exception as failure:
            refuse_each(gathers[k:], str(failure))
            try:
                wait_each([(engine, ticket) for (engine, _), ticket in zip(gathers, tickets)])
            except Exception:  # noqa: BLE001 - the start's failure is the one that matters
                pass
            raise
    return tickets


def wait_each(waits) -> list:
    """The stats of each (engine, ticket) in `waits`, waited for in order. If one fails, the rest
    are still waited for (a refused or broken call fails them at once too) before its error is
    raised: none of the call's gathers is left in flight, to make the next call's start() find
    its bucket busy on some ranks and not on others."""
    stats, failure = [], None
    for engine, ticket in waits:
        try:
            stats.append(engine.wait(ticket))
        except Exception as e:  # noqa: BLE001 - the first is raised once all are waited for
            failure = failure or e
    if failure is not None:
        raise failure
    return stats
