"""Where every rank of ``ciera train`` is, and what the user is told when one stops or dies.

Each rank keeps a small status file (``ranks/<rank>.json`` in the run folder: its pid, which
training and step it is in, and its error if it failed). The launcher reads them while it waits,
together with each rank's process state (``/proc/<pid>/stat``: a stopped rank shows ``T``) and,
at the end, the launcher's account (mpirun's or torchrun's) of ranks killed by a signal. From
these it writes one line while the ranks wait (who is behind, and why) and one line when the job
fails: which rank failed and what the others were waiting for."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path


def status_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ranks"


class RankStatus:
    """One rank's status file, replaced atomically at each change."""

    def __init__(self, run_dir: Path, rank: int):
        self.rank = rank
        self.path = status_dir(run_dir) / f"{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.state = {"rank": rank, "pid": os.getpid(), "state": "starting", "run": None, "step": None}
        self._write()

    def update(self, state: str, run: str | None = None, step: int | None = None, phase: str | None = None) -> None:
        self.state.update(state=state, run=run, step=step, phase=phase)
        self._write()

    def between_steps(self, phase: str, steps_done: int) -> None:
        """Work of every training after `steps_done` steps (0: before the first), outside any
        step: a checkpoint, a memory sample, the final comparison. Written at once, so that a
        failure or a stall in it is told as what it is, not as the last step's last phase."""
        self.update("training", None, steps_done - 1 if steps_done > 0 else None, phase)

    def phase(self, phase: str) -> None:
        """Where in the current step (forward, backward, ...): what a failure was waiting in. Kept
        in memory and written with the failure, so that no file is written inside a timed step."""
        self.state["phase"] = phase

    def failed(self, error: BaseException) -> None:
        self.state.update(state="failed", error=error_text(error))
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


def error_text(error: BaseException) -> str:
    """`error` in one short line: its type and first line, without gloo's source locations and
    advice."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ", "", lines[0] if lines else "")
    text = text.split(". This is typically caused")[0]
    text = re.sub(r" on rank \d+", "", text)  # the line names the ranks itself
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def killed_ranks(log_text: str) -> dict[int, str]:
    """Ranks the launcher saw killed by a signal, from its account in the job's output: what
    happened to each, e.g. "was killed by signal 9 (Killed)"."""
    killed = {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in re.finditer(
        r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+) \(([^)]*)\)", log_text)}  # mpirun
    # torchrun (torch.distributed.elastic's failure report): "rank : 1 (local_rank: 1)", then
    # "exitcode : -9 (pid: 1234)", the signal's number negated. Ranks torchrun ended itself, once
    # another had failed, are listed too; it names them first ("Sending process 1234 closing signal").
    ended = set(re.findall(r"Sending process (\d+) closing signal", log_text))
    for m in re.finditer(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*-(\d+) \(pid: (\d+)\)",
                         log_text):
        if m.group(3) not in ended:
            number = int(m.group(2))
            killed.setdefault(int(m.group(1)), (number, signal.strsignal(number) or f"signal {number}"))
    return {rank: f"was killed by signal {number} ({name})" for rank, (number, name) in killed.items()}


def last_error_line(log_text: str) -> str | None:
    """The link lab's own refusal ("linklab: network namespaces are not permitted here": no rank
    started), else the first line of the job's output that ends a rank's Python traceback
    ("PermissionError: ..."): what a rank that could not write its status (its folder
    unwritable) died of. The lab's banner and byte counts, the launcher's own report (torchrun's
    ChildFailedError, after the ranks') and warnings from finalizers ("Exception ignored in")
    are not causes."""
    for line in re.findall(r"^linklab: .*$", log_text, re.MULTILINE):
        if not re.match(r"linklab: (\d+ ranks|inter-node bytes while)", line):
            return line.strip()
    for line in re.findall(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*$", log_text, re.MULTILINE):
        if not line.startswith(("torch.distributed.elastic.", "Exception ignored")) and "ChildFailedError" not in line:
            return line.strip()
    return None


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, from the state on (so field N of
    proc(5) is [N - 3]: the state [0], the parent [1], the start time [19]); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (R, S, D, T for stopped, Z, ...), None if it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


@dataclass
class Watch:
    """The launcher's view of the ranks, refreshed by poll()."""

    run_dir: Path
    ranks: int
    statuses: dict = field(default_factory=dict)   # rank -> last status read
    stopped: set = field(default_factory=set)      # ranks ever seen stopped (SIGSTOP)
    vanished: list = field(default_factory=list)   # ranks whose process ended unannounced, in order

    def poll(self) -> None:
        """Reads the status files and looks at every rank's process (while the job runs)."""
        self.read_statuses()
        for rank, status in self.statuses.items():
            state = process_state(status["pid"])
            if state == "T":
                self.stopped.add(rank)
            elif state is None and status["state"] not in ("failed", "done") and rank not in self.vanished:
                self.vanished.append(rank)

    def continue_stopped(self) -> None:
        """Once a rank has failed or ended, continues the stopped ones (SIGCONT), as mpirun does
        before it ends a job's ranks: a stopped process acts on no signal but SIGKILL, so
        torchrun's SIGTERM would wait until its SIGKILL 30 s later. (Under torchrun.)"""
        failing = self.vanished or any(s["state"] == "failed" for s in self.statuses.values())
        for rank in sorted(self.stopped) if failing else []:
            pid = self.statuses[rank]["pid"]
            if process_state(pid) == "T":
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # ended meanwhile

    def read_statuses(self) -> None:
        for path in status_dir(self.run_dir).glob("*.json"):
            try:
                status = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced while read; next poll
            self.statuses[status["rank"]] = status

    def waiting_line(self, seconds: float, started: bool = True) -> str:
        """Who the job has been waiting for, `seconds` without progress (since the launch, when
        no step has completed yet: `started` False)."""
        parts = [f"{self._rank_text(r)}" for r in sorted(self.stopped | set(self.vanished))]
        places: dict[str, list[int]] = {}
        for rank, status in sorted(self.statuses.items()):
            if rank not in self.stopped and rank not in self.vanished:
                places.setdefault(self._place(status), []).append(rank)
        parts += [f"{_ranks(rs)} {place}" for place, rs in places.items()]
        missing = [r for r in range(self.ranks) if r not in self.statuses]
        if missing:
            parts.append(f"{_ranks(missing)} not started")
        lead = f"no progress for {seconds:.0f} s" if started else f"starting ({seconds:.0f} s)"
        return f"ciera train: {lead}: " + "; ".join(parts)

    def failure_line(self, status: int, log_text: str) -> str:
        """One line: the rank that failed first and what the others were waiting for."""
        killed = killed_ranks(log_text)
        # A rank stopped or killed is the cause; failing that, the first to end unannounced (the
        # launcher ends the others right after it). A rank whose failure was written after it
        # was seen gone (between two reads of a poll) has announced itself after all.
        vanished = [r for r in self.vanished if self.statuses.get(r, {}).get("state") not in ("failed", "done")]
        culprits = sorted(self.stopped | set(killed)) or vanished[:1]
        failed = sorted(r for r, s in self.statuses.items() if s["state"] == "failed" and r not in culprits)
        parts = []
        for r in culprits:
            what = killed.get(r) or ("stopped (SIGSTOP)" if r in self.stopped else "ended without a word")
            parts.append(f"rank {r} {what}{self._where(r)}")
        # The others, grouped by where they were and what they saw.
        groups: dict[tuple[str, str], list[int]] = {}
        for r in failed:
            groups.setdefault((self._where(r), self.statuses[r]["error"]), []).append(r)
        verb = "gave up" if culprits else "failed"
        for (where, error), rs in groups.items():
            parts.append(f"{_ranks(rs)} {verb}{where}: {error}")
        # Ranks that never wrote a status: stopped or stuck before their first line of Python, or
        # ended by the launcher before they got that far.
        missing = [r for r in range(self.ranks) if r not in self.statuses and r not in culprits]
        if missing and parts:
            parts.append(f"{_ranks(missing)} never started (no status)")
        if not parts:
            error = last_error_line(log_text)
            return f"ciera train: the ranks failed (exit {status})" + (f"; the first error in their output: {error}"
                                                                        if error else "")
        return "ciera train: " + "; ".join(parts)

    def _where(self, rank: int) -> str:
        status = self.statuses.get(rank)
        return f" {self._place(status)}" if status else ""

    @staticmethod
    def _place(status: dict) -> str:
        if status.get("run") is None:
            if status.get("phase"):   # between steps (RankStatus.between_steps)
                after = "before the first step" if status.get("step") is None else f"after step {status['step'] + 1}"
                return f"in the {status['phase']} {after}"
            # A rank that failed outside any training failed in its set-up (the state replaced it).
            return {"starting": "setting up", "failed": "setting up", "done": "done"}.get(
                status["state"], f"({status['state']})")
        phase = f"in the {status['phase']} of " if status.get("phase") else "in "
        return f"{phase}step {status['step'] + 1} of the {status['run']} run"

    def _rank_text(self, rank: int) -> str:
        what = "is stopped (SIGSTOP)" if rank in self.stopped else "has ended"
        return f"rank {rank} {what}{self._where(rank)}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class Stall:
    """Says, every `every_s` seconds without progress, who the job is waiting for."""

    def __init__(self, watch: Watch, write, every_s: float = 10.0):
        self.watch, self.write, self.every_s = watch, write, every_s
        self.last_progress = self.last_said = time.time()
        self.started = False  # a step has completed

    def progressed(self) -> None:
        self.last_progress = self.last_said = time.time()
        self.started = True

    def check(self) -> None:
        now = time.time()
        if now - self.last_said >= self.every_s:
            self.last_said = now
            self.write(self.watch.waiting_line(now - self.last_progress, self.started))
