"""``ciera train``: trains a real MoE architecture with FSDP2 on W ranks (CPU, or GPUs with
--device cuda), once with FSDP2's own all-gather (the baseline) and once through CIERA, from the
same seed and data, and shows that the two trainings are bitwise identical while CIERA moves
fewer bytes.

    ciera train                          # 4 ranks, OLMoE, defaults that finish in minutes
    ciera train --model mixtral --link-gbit 1 --verify --json
    ciera train --launcher torchrun --device cuda --ranks 2

The command launches its own ranks (under mpirun or torchrun, or inside the link lab with
--link-gbit) and draws the progress; the ranks write per-step metrics to <run>/metrics.jsonl and rank 0 writes
<run>/summary.json, from which the final table and the PNG plots are made.

    options.py           the command line, checked before any rank starts
    launcher.py          the process the user started: launches the ranks, draws progress, renders
    rank.py              one rank: builds the models, trains them side by side, step by step
    metrics.py           typed per-step and per-run records, reduced over ranks as tensors
    summary.py           summary.json from the runs (rank 0)
    checkpoint.py        --checkpoint-every / --resume: torch.distributed.checkpoint folders, checked
    characterisation.py  --stats: exponent-change statistics of the gathered parameters
    tracing.py           --trace: the trace for `ciera simulate`
"""

from ciera.train.launcher import main

__all__ = ["main"]
