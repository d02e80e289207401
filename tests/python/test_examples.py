"""examples/fsdp2_train.py, the README's FSDP2 example as a user runs it: under torchrun on two CPU
ranks, plain FSDP2 and FSDP2 through CIERA must train bitwise identically (the script compares
losses and parameters itself and exits 1 on any difference)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_the_fsdp2_example_trains_bitwise_identically_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "fsdp2_train.py"), "--steps", "8", "--warmup-gathers", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    assert "losses and parameters bitwise identical to plain FSDP2" in done.stdout
    # 5 layers' gathers (4 blocks and the root), forward and backward: after 4 raw ones, compressed.
    assert "60 of 80 gathers compressed" in done.stdout
