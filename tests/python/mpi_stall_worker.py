"""One rank of test_faults.py's Python-API tests, under mpirun: CIERA's engine on the Open MPI
transport, no torch. `python mpi_stall_worker.py TIMEOUT_S WHERE`: the last rank stops itself
(SIGSTOP) at WHERE, and every other rank must end by itself within the timeout:
- "step": at step 5; the others get a CommError they do not catch, and the package's exit handler
  must end the job (MPI_Abort) instead of waiting in MPI_Finalize for the stopped rank;
- "start-up": before MPI starts; the others' MPI_Init_thread must end them (its watchdog);
- "set-up": after MPI started, before the transport's communicator is made (a polled collective:
  an uncaught CommError, then MPI_Abort as for "step");
- "finalize": after every step and the engine's close succeeded; the others' MPI_Finalize, at
  exit, must end them (its watchdog)."""

import os
import signal
import sys

import numpy as np

import ciera
from ciera.fsdp import lifecycle

timeout_s, where = float(sys.argv[1]), sys.argv[2]
last = int(os.environ["OMPI_COMM_WORLD_RANK"]) == int(os.environ["OMPI_COMM_WORLD_SIZE"]) - 1


def stop_if(here: str) -> None:
    if last and where == here:
        print(f"the last rank stops in {here}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


stop_if("start-up")
# The ranks import torch (ciera.fsdp) before this, seconds apart on a loaded machine: only where
# the start-up itself is under test does it get the short timeout.
lifecycle.init_mpi_once(timeout_s, start_up_s=timeout_s if where == "start-up" else 120)
stop_if("set-up")
transport = ciera._ext.mpi_transport(None, timeout_s)
rank, world = transport.rank, transport.size
config = ciera.EngineConfig()
config.warmup_steps = 2
config.timeout_s = timeout_s
layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [50_000], world)
engine = ciera.Engine(transport, config, [layout])
mine = np.full(layout.rank_bytes(rank), rank, dtype=np.uint8)
out = np.empty(layout.total_bytes(), dtype=np.uint8)
for step in range(1000 if where == "step" else 10):
    if step == 5:
        stop_if("step")
    mine[0] = step % 256
    engine.run(0, mine.ctypes.data, mine.nbytes, out.ctypes.data, out.nbytes)  # raises CommError
if where == "step":
    print(f"rank {rank}: no error although a peer stopped", flush=True)
engine.close()
stop_if("finalize")
print(f"rank {rank}: done, MPI_Finalize at exit", flush=True)
