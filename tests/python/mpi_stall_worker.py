"""One rank of test_faults.py's Python-API test, under mpirun: CIERA's engine on the Open MPI
transport, no torch. The last rank stops itself (SIGSTOP) at step 5; the others get a CommError
they do not catch, and the package's exit handler must end the job (MPI_Abort) instead of waiting
in MPI_Finalize for the stopped rank."""

import os
import signal
import sys

import numpy as np

import ciera
from ciera.fsdp import lifecycle

lifecycle.init_mpi_once()
transport = ciera._ext.mpi_transport()
rank, world = transport.rank, transport.size
config = ciera.EngineConfig()
config.warmup_steps = 2
config.timeout_s = float(sys.argv[1])
layout = ciera.BucketLayout.fsdp_split("b", ciera.DType.bf16, [50_000], world)
engine = ciera.Engine(transport, config, [layout])
mine = np.full(layout.rank_bytes(rank), rank, dtype=np.uint8)
out = np.empty(layout.total_bytes(), dtype=np.uint8)
for step in range(1000):
    if rank == world - 1 and step == 5:
        print(f"rank {rank} stops", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    mine[0] = step % 256
    engine.run(0, mine.ctypes.data, mine.nbytes, out.ctypes.data, out.nbytes)  # raises CommError
print(f"rank {rank}: no error although a peer stopped", flush=True)
