"""Reliability tests 10 and 14 through the main job: a rank of `ciera train` is stopped (SIGSTOP)
or killed (SIGKILL) in the middle of training, compression on, on both transports. Every
surviving rank must fail within the timeout and the job must end with a non-zero status, one
line naming the rank and what the others were waiting for, and no process left behind. Nothing
here kills leftovers early: the job has to end by itself within timeout + margin (the cleanup at
the end only runs after the test has failed)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_torch, process_alive, rank_statuses  # noqa: F401  (ROOT makes ciera importable)

needs_torch()  # every test here trains: torch and transformers (pip install '.[train]')

TIMEOUT_S = 10
MARGIN_S = 40  # start-up of the job's end: mpirun ending the ranks, the launcher's last poll


def _env():
    import ciera

    return dict(os.environ, PYTHONPATH=str(Path(ciera.__file__).resolve().parents[1]))


def _kill_leftovers(job: subprocess.Popen, pids: list) -> None:
    """After a test: the job, the rank launcher it started (the native tool waits for its mpirun
    rather than becoming it) and its ranks, if any is left (only when the test has failed)."""
    if job.poll() is None:
        children = Path(f"/proc/{job.pid}/task/{job.pid}/children")
        launchers = [int(p) for p in children.read_text().split()] if children.exists() else []
        job.kill()
        pids = [*launchers, *pids]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _when_every_rank_reaches(job: subprocess.Popen, out: Path, ranks: int, steps: int) -> dict:
    """The rank statuses of the `ciera train` job writing under `out`, once each of its `ranks`
    ranks has done `steps` steps; fails the test if the job ends first or takes 300 s."""
    deadline = time.time() + 300
    while True:
        statuses = rank_statuses(out)
        if len(statuses) == ranks and all((s.get("step") or 0) >= steps for s in statuses.values()):
            return statuses
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.time() < deadline, f"the job did not reach step {steps + 1}"
        time.sleep(0.2)


@pytest.mark.parametrize("transport,launcher", [("mpi", "mpirun"), ("torch", "mpirun"), ("torch", "torchrun")])
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_stopped_or_killed_rank_ends_the_job_with_one_line(tmp_path, transport, launcher, fault):
    """Under mpirun (MPI_Abort ends the job) and torchrun (its agent ends the others once one
    exits; the launcher continues a stopped rank so that torchrun's SIGTERM reaches it)."""
    victim = 1
    cmd = [sys.executable, "-m", "ciera.train", "--ranks", "3", "--steps", "500", "--warmup", "2",
           "--layers", "1", "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32",
           "--transport", transport, "--launcher", launcher, "--no-baseline", "--timeout", str(TIMEOUT_S),
           "--out", str(tmp_path)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    pids = []
    try:
        # Wait until every rank trains with compression on (past warmup), then hit one.
        statuses = _when_every_rank_reaches(job, tmp_path, 3, 4)
        pids = [s["pid"] for s in statuses.values()]
        os.kill(statuses[victim]["pid"], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        hit = time.time()
        try:
            _, stderr = job.communicate(timeout=TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still runs {TIMEOUT_S + MARGIN_S} s after rank {victim} was hit ({fault})")
        elapsed = time.time() - hit
        assert job.returncode == 1, (job.returncode, stderr[-3000:])  # the work failed (not mpirun's 137)
        last = stderr.strip().splitlines()[-1]
        print(f"\n{fault}/{transport}/{launcher} after {elapsed:.1f} s: {last}")
        assert "Traceback" not in stderr, stderr[-3000:]
        what = "stopped (SIGSTOP)" if fault == "stop" else "was killed by signal 9"
        assert f"rank {victim} {what}" in last, stderr[-3000:]
        assert "of the ciera run" in last and "log.txt" in last, last
        if fault == "stop":
            # The others waited out the timeout for it, and say so. Each rank's timeout runs from
            # when its own wait began, which may be before the stop if the victim was behind.
            assert "gave up" in last and ("dead or stalled" in last or "imed out" in last), last
            assert elapsed >= TIMEOUT_S / 2, elapsed
        # No rank is left, the stopped one included.
        time.sleep(1)
        assert not [p for p in pids if process_alive(p)], "ranks left running"
    finally:
        _kill_leftovers(job, pids)


def _ranks_of(marker: str) -> list[int]:
    """Pids of the bench's rank processes (their command line holds --child and `marker`)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--child" in args and marker.encode() in args and args[0].endswith(b"ciera"):
            pids.append(int(cmdline.parent.name))
    return sorted(pids)


def test_a_stopped_rank_ends_bench_allgather(tmp_path):
    """The native tool's ranks: a stopped rank makes the others time out and abort the job."""
    from ciera.cli import native_tool

    marker = "48611"  # a seed no other test uses, to find this job's ranks
    cmd = [str(native_tool()), "bench", "allgather", "--ranks", "3", "--params", "300000", "--steps", "100000",
           "--warmup", "2", "--buckets", "2", "--timeout", str(TIMEOUT_S), "--seed", marker]
    # Its progress (stderr, a line per tenth when not a terminal, the first after step 1) says
    # when every rank is past MPI's start-up, which has no timeout: a rank stopped there would
    # hang the others (Open MPI's own start-up, not CIERA's collectives).
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=_env())
    pids = []
    try:
        deadline = time.time() + 120
        while len(pids) < 3 or "(1/100000)" not in err_path.read_text():
            assert job.poll() is None, err_path.read_text()[-3000:]
            assert time.time() < deadline, "the ranks did not finish a step"
            time.sleep(0.5)
            pids = _ranks_of(marker)
        time.sleep(1)  # into the steps (a few ms each), past warmup
        os.kill(pids[-1], signal.SIGSTOP)
        hit = time.time()
        try:
            job.wait(timeout=TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"bench allgather still runs {TIMEOUT_S + MARGIN_S} s after a rank was stopped")
        stderr = err_path.read_text()
        assert job.returncode != 0
        assert "did not complete within" in stderr, stderr[-3000:]
        assert time.time() - hit >= TIMEOUT_S / 2  # the others waited out their timeout
        time.sleep(1)
        assert not [p for p in pids if process_alive(p)], "ranks left running"
    finally:
        _kill_leftovers(job, pids)


# What each rank prints when the last rank stops at that point (mpi_stall_worker.py's WHERE).
_STALL_SIGNS = {
    "step": ["CommError"],
    "set-up": ["CommError", "MPI_Comm_idup"],
    "start-up": ["MPI_Init_thread did not return within"],
    "finalize": ["rank 0: done", "rank 1: done", "MPI_Finalize did not return within"],
}


@pytest.mark.parametrize("where", list(_STALL_SIGNS))
def test_the_python_api_ends_the_mpi_job_after_a_stalled_peer(where):
    """No torch, no ciera train: a Python program that uses the MPI transport, whose last rank
    stops (SIGSTOP) in a step, in MPI's start-up, before the transport is made or before
    MPI_Finalize. The others must end the job by themselves: an uncaught CommError by the exit
    handler's MPI_Abort, not a wait in MPI_Finalize; MPI's start-up and finalize, which cannot be
    polled, by their watchdogs (docs/reliability.md, row 22)."""
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed")
    worker = Path(__file__).with_name("mpi_stall_worker.py")
    env = dict(_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "3", "-x", "PYTHONPATH",
           sys.executable, str(worker), str(TIMEOUT_S), where]
    started = time.time()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        # The whole timeout, MPI's start-up included: the ranks' imports of torch (ciera.fsdp)
        # may start them seconds apart on a loaded machine.
        output, _ = job.communicate(timeout=TIMEOUT_S + MARGIN_S + 30)  # + start-up
    except subprocess.TimeoutExpired:
        job.kill()
        output = job.communicate()[0]
        for line in subprocess.run(["pgrep", "-f", str(worker)], capture_output=True, text=True).stdout.split():
            os.kill(int(line), signal.SIGKILL)  # cleanup after the failure only
        pytest.fail(f"the job still runs {time.time() - started:.0f} s after it started:\n{output[-3000:]}")
    assert job.returncode != 0, output[-3000:]
    assert f"the last rank stops in {where}" in output, output[-3000:]
    for sign in _STALL_SIGNS[where]:
        assert sign in output, output[-3000:]
    if "CommError" in _STALL_SIGNS[where]:
        # Open MPI 4 prints its MPI_ABORT banner through show_help, which fails now and then when
        # two ranks abort at the same moment ("ORTE_ERROR_LOG: Out of resource in file
        # .../show_help.c"): the job still ended by MPI_Abort, only the banner is lost.
        assert "MPI_ABORT" in output or "show_help.c" in output, output[-3000:]
    assert "no error although" not in output


@pytest.mark.parametrize("launcher,sig,nohup", [("mpirun", signal.SIGINT, False), ("mpirun", signal.SIGTERM, False),
                                                ("mpirun", signal.SIGHUP, False), ("torchrun", signal.SIGINT, False),
                                                ("torchrun", signal.SIGTERM, False), ("torchrun", signal.SIGHUP, True)])
def test_a_signal_to_the_launcher_ends_the_ranks_too(tmp_path, launcher, sig, nohup):
    """`timeout N ciera train`, a scheduler, kill PID, a closed ssh session: the signal reaches the
    launcher alone. It used to exit (a traceback for SIGINT; silently, status 129, for SIGHUP)
    and leave mpirun and the ranks training in the run folder; it now ends them, says so in one
    line and exits 128 + the signal's number. Under nohup a SIGHUP stays ignored: the run goes
    on, and a SIGTERM then ends it."""
    cmd = [sys.executable, "-m", "ciera.train", "--ranks", "2", "--steps", "500", "--warmup", "2",
           "--layers", "1", "--hidden", "64", "--expert-intermediate", "64", "--seq-len", "32",
           "--launcher", launcher, "--no-baseline", "--out", str(tmp_path)]
    # Its own session: the signal goes to the launcher's pid only, as kill or timeout send it. As
    # from a terminal: whatever this test runs under (nohup, a script's background job), the
    # launcher starts with SIGHUP and SIGINT at their defaults, unless nohup ignores SIGHUP.
    def as_from_a_terminal():
        for default in (signal.SIGHUP, signal.SIGINT):
            signal.signal(default, signal.SIG_DFL)

    job = subprocess.Popen(["nohup", *cmd] if nohup else cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=_env(), start_new_session=True, preexec_fn=as_from_a_terminal)
    pids = []
    try:
        pids = [s["pid"] for s in _when_every_rank_reaches(job, tmp_path, 2, 2).values()]
        if nohup:
            job.send_signal(sig)
            reached = max((s.get("step") or 0) for s in rank_statuses(tmp_path).values())
            _when_every_rank_reaches(job, tmp_path, 2, reached + 2)   # fails if the job ends
            sig = signal.SIGTERM
        job.send_signal(sig)
        _, stderr = job.communicate(timeout=60)
        assert job.returncode == 128 + sig, (job.returncode, stderr[-3000:])
        assert "Traceback" not in stderr, stderr[-3000:]
        assert f"ciera train: interrupted ({sig.name}); the ranks were ended" in stderr.strip().splitlines()[-1], stderr
        time.sleep(1)
        assert not [p for p in pids if process_alive(p)], "ranks left running"
    finally:
        _kill_leftovers(job, pids)
