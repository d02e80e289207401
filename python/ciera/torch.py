"""CIERA for PyTorch FSDP2: one call routes every ``fully_shard`` parameter group's all-gather
through the CIERA engine, and the training stays bitwise identical.

    model = ...                              # fully_shard(...) applied, FSDP2
    handle = ciera.torch.enable(model)       # collective: call on every rank
    ...train...
    handle.disable()                         # back to FSDP2's own all-gather

The implementation lives in :mod:`ciera.fsdp`, one module per concern; this module is its public
face: the names of ``ciera.fsdp.__all__``.
"""

from ciera.fsdp import *  # noqa: F401,F403
from ciera.fsdp import __all__  # noqa: F401
