"""The launcher's account of a failed job (ciera.train.watch), from rank status files, process
states and mpirun's log: which rank failed and where the others gave up, in one line."""

from conftest import ROOT  # noqa: F401  (makes ciera importable)
from ciera.train.watch import RankStatus, Watch, error_text


def _status(tmp_path, rank, run="ciera", step=4, phase="backward pass", error=None):
    s = RankStatus(tmp_path, rank)
    s.update("training", run, step, phase)
    if error is not None:
        s.failed(error)
    return s


def test_a_stopped_rank_and_the_ranks_that_gave_up_are_one_line(tmp_path):
    timeout = RuntimeError("[/x/gloo/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation "
                           "to complete on rank 0")
    _status(tmp_path, 0, error=timeout)
    _status(tmp_path, 1)
    _status(tmp_path, 2, error=RuntimeError(str(timeout).replace("rank 0", "rank 2")))
    watch = Watch(tmp_path, 3)
    watch.read_statuses()
    watch.stopped.add(1)
    line = watch.failure_line(1, "")
    assert line == ("ciera train: rank 1 stopped (SIGSTOP) in the backward pass of step 5 of the ciera run; "
                    "ranks 0, 2 gave up in the backward pass of step 5 of the ciera run: "
                    "RuntimeError: Timed out waiting 10000ms for recv operation to complete")
    assert "\n" not in line


def test_a_killed_rank_is_named_from_mpiruns_log(tmp_path):
    _status(tmp_path, 0, error=ConnectionError("Connection reset by peer. This is typically caused by a "
                                               "remote worker hanging"))
    _status(tmp_path, 1, step=6)
    log = ("mpirun noticed that process rank 1 with PID 4242 on node vm exited on signal 9 (Killed).\n")
    watch = Watch(tmp_path, 2)
    watch.read_statuses()
    assert watch.failure_line(137, log) == (
        "ciera train: rank 1 was killed by signal 9 (Killed) in the backward pass of step 7 of the ciera run; "
        "rank 0 gave up in the backward pass of step 5 of the ciera run: ConnectionError: Connection reset by peer")


def test_without_a_culprit_the_failing_ranks_and_their_errors_are_named(tmp_path):
    _status(tmp_path, 0, error=ValueError("bad thing"))
    _status(tmp_path, 1, step=2, phase=None, error=KeyError("other"))
    watch = Watch(tmp_path, 2)
    watch.read_statuses()
    line = watch.failure_line(1, "")
    assert line.startswith("ciera train: rank 0 failed in the backward pass of step 5 of the ciera run: ValueError: bad thing")
    assert "rank 1 failed in step 3 of the ciera run: KeyError: 'other'" in line
    assert Watch(tmp_path / "none", 2).failure_line(3, "") == "ciera train: the ranks failed (exit 3)"
    # No status to read (a rank whose status folder became unwritable): the cause from its output.
    log = ("Traceback (most recent call last):\n  File \"watch.py\", line 1, in _write\n"
           "PermissionError: [Errno 13] Permission denied: 'ranks/1.tmp'\nmpirun noticed that ...\n")
    assert Watch(tmp_path / "none", 2).failure_line(1, log) == (
        "ciera train: the ranks failed (exit 1); the first error in their output: "
        "PermissionError: [Errno 13] Permission denied: 'ranks/1.tmp'")
    # Under torchrun its own report follows the ranks': not the cause, nor a finalizer's warning.
    torchrun = ("Exception ignored in: <function _Stream.__del__>\n" + log +
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert Watch(tmp_path / "none", 2).failure_line(1, torchrun).endswith(
        "PermissionError: [Errno 13] Permission denied: 'ranks/1.tmp'")
    # The link lab refused to start (no rank ran): its reason, not its banner or byte counts.
    lab = ("linklab: 2 ranks, 1 Gbit/s, TCP bbr9\n"
           "linklab: the kernel offers no TCP congestion control 'bbr9' (it has: reno cubic)\n"
           "linklab: inter-node bytes while the command ran: 0 sent, 0 received over 2 node uplinks\n")
    assert Watch(tmp_path / "none", 2).failure_line(2, lab) == (
        "ciera train: the ranks failed (exit 2); the first error in their output: "
        "linklab: the kernel offers no TCP congestion control 'bbr9' (it has: reno cubic)")
    assert Watch(tmp_path / "none", 2).failure_line(1, lab.splitlines()[0] + "\n" + log).endswith(
        "PermissionError: [Errno 13] Permission denied: 'ranks/1.tmp'")


def test_waiting_line_says_who_is_behind_and_a_live_process_is_not_vanished(tmp_path):
    _status(tmp_path, 0)
    watch = Watch(tmp_path, 2)
    watch.poll()  # this process is rank 0's pid: alive, not stopped
    assert not watch.stopped and not watch.vanished
    assert watch.waiting_line(20) == ("ciera train: no progress for 20 s: rank 0 in the backward pass of step 5 "
                                      "of the ciera run; rank 1 not started")
    assert watch.waiting_line(12, started=False).startswith("ciera train: starting (12 s): ")


def test_error_text_is_one_short_line():
    assert error_text(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert error_text(RuntimeError("")) == "RuntimeError"


def test_a_rank_seen_gone_that_wrote_its_failure_is_no_culprit(tmp_path):
    _status(tmp_path, 0, error=RuntimeError("gave up"))
    _status(tmp_path, 1, error=RuntimeError("gave up"))
    watch = Watch(tmp_path, 2)
    watch.vanished = [0]  # seen gone before its failure was read
    watch.read_statuses()
    assert watch.failure_line(1, "") == ("ciera train: ranks 0, 1 failed in the backward pass of step 5 of the "
                                         "ciera run: RuntimeError: gave up")


def test_work_between_steps_is_told_as_itself_not_as_the_last_steps_phase(tmp_path):
    # A checkpoint (or the final comparison) after the last step's metrics all-reduce: a stall or
    # a failure there must name it (a CI run once blamed "the metrics all-reduce of step 12").
    writing = _status(tmp_path, 0, step=11, phase="metrics all-reduce")
    writing.between_steps("checkpoint write", 12)
    loading = _status(tmp_path, 1)
    loading.between_steps("checkpoint load", 0)
    loading.failed(RuntimeError("Timed out waiting 600000ms for send operation to complete"))
    watch = Watch(tmp_path, 2)
    watch.read_statuses()
    assert watch.waiting_line(30) == ("ciera train: no progress for 30 s: rank 0 in the checkpoint write after "
                                      "step 12; rank 1 in the checkpoint load before the first step")
    assert watch.failure_line(1, "") == ("ciera train: rank 1 failed in the checkpoint load before the first step: "
                                         "RuntimeError: Timed out waiting 600000ms for send operation to complete")
    # The next step's update takes the place back.
    writing.update("training", "fsdp2", 12)
    watch.read_statuses()
    assert watch.waiting_line(10).startswith("ciera train: no progress for 10 s: rank 0 in step 13 of the fsdp2 run;")


def test_a_rank_that_never_started_is_named_after_the_ranks_that_failed_setting_up(tmp_path):
    """A rank stopped before it wrote its status (in its imports): the others fail in their set-up
    (torch.distributed's store waits for it), and the line names it as never started."""
    for rank in (1, 2):
        RankStatus(tmp_path, rank).failed(RuntimeError("torch.distributed's set-up (every rank joining, 10 s "
                                                       "allowed) failed: Wait timeout"))
    watch = Watch(tmp_path, 3)
    watch.read_statuses()
    assert watch.failure_line(1, "") == (
        "ciera train: ranks 1, 2 failed setting up: RuntimeError: torch.distributed's set-up (every rank joining, "
        "10 s allowed) failed: Wait timeout; rank 0 never started (no status)")
