"""torch.distributed's single-tensor collectives under the names the installed torch has: 2.13
calls them ``all_gather_single`` / ``reduce_scatter_single`` and warns (FutureWarning) at every
call of the old ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; older releases (the GPU
image's 2.11) have only the old names. Same arguments either way.

And raise_first_failure: a rank's local failure before a collective set-up, raised on every rank."""

import torch.distributed as dist

from ciera import _ext

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# The exception types a rank's local failure is raised as on every rank; anything else is a
# ConfigError (the set-up refused), with the original type named in its text.
_SAME_TYPE = {"ValueError": ValueError, "TypeError": TypeError}


def first_failure(failure: BaseException | None, group=None) -> tuple[int, str, str] | None:
    """Collective over `group` (default the world): whether any rank's local step failed
    (`failure`: its exception, or None). Returns (rank, type name, text) of the lowest rank that
    failed, the same on every rank, or None if none did."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, None if failure is None else (type(failure).__name__, str(failure)),
                           group=group)
    for rank, failed in enumerate(everyone):
        if failed is not None:
            return (rank, *failed)
    return None


def raise_first_failure(what: str, failure: BaseException | None, group=None) -> None:
    """A step that reads this rank's own arguments or state (checks, a user's callable) before a
    collective set-up: if it failed on any rank, the same error on every rank of `group`, naming
    the lowest rank that failed, instead of one rank raising while the others wait in the next
    collective until its timeout. A ValueError or TypeError keeps its type; anything else is a
    ConfigError. Collective."""
    first = first_failure(failure, group)
    if first is None:
        return
    rank, kind, text = first
    error = _SAME_TYPE.get(kind)
    if error is None:
        error, text = _ext.ConfigError, (text if kind in ("ConfigError", "Error") else f"{kind}: {text}")
    raise error(f"{what}: on rank {rank}: {text}")
