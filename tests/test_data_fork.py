"""The loaders across ``os.fork()``: a training loop that forks a helper (an
asynchronous checkpoint writer) while its loader runs. The parent's loader must
deliver every element whatever the child does with its copy; the copy is inert
in the child (its ``next()`` raises a clear error); a loader the child makes
itself works; a child that leaves exits at once. And the other way round: a
worker's ``fn`` that forks. What it forked dies with the worker, with
``close()`` and with the rank, and a worker that forked and then crashed is
reported although its child holds the worker's socket open.

Launcher tests (they start worker processes and fork): serial session only.
The rank-side cases run in a script of their own (``data_scripts/forker.py``),
so that the fork happens in a plain process, not in pytest's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from data_scripts.fns import ForkThenCrash

from collective_gc.data import ProcessPrefetch, WorkerError, testing

from _util import in_thread, process_alive, script_env

pytestmark = pytest.mark.launcher

SCRIPTS = os.path.join(os.path.dirname(__file__), "data_scripts")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "forker.py"), *args],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=timeout,
    )


CODES = {3: "the child's next() of the parent's loader did not raise a clear error",
         4: "the child hangs at exit",
         5: "the parent's loader lost elements",
         6: "a loader made in the child gave wrong elements",
         7: "a forked helper holds the loader's descriptors or memory",
         8: "a forked helper keeps the workers alive after close()"}  # fmt: skip


@pytest.mark.parametrize("probe", [False, True], ids=["", "probe"])
@pytest.mark.parametrize("how", ["exit", "close", "new"])
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_forked_child_leaves_the_parents_loader_alone(kind: str, how: str, probe: bool) -> None:
    """Issue 24, defects 1 and 2. Before: a ProcessPrefetch child's ``close()``
    (``sys.exit`` through the ``with``, or ``close()`` then ``os._exit``) shut
    the shared socket down and the parent got WorkerError after ~14 of 200
    elements; the child's ``next()`` took the parent's elements; a
    ThreadPrefetch child hung for ever at exit on a lock of the producer
    thread, which does not exist in the child."""
    result = _run(kind, how, *(["probe"] if probe else []))
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        CODES.get(result.returncode, f"exit code {result.returncode}") + "\n" + result.stderr
    )


def test_a_forked_helper_pins_none_of_the_loaders_memory() -> None:
    """Issue 24, defect 7, and the held-out rounds of issue 32. A helper
    process forked by the rank (one that never uses the loader) held every
    slot's and ring's memfd and mapping until it exited, even after the rank
    died; then still the segments of the elements it had copies of (4
    elements, 8 references: their mappings and descriptors). Now it holds
    none: its copies of the elements are its own, private memory."""
    result = _run("process", "helper")
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        CODES.get(result.returncode, f"exit code {result.returncode}") + "\n" + result.stderr
    )


# -- a fn that forks ------------------------------------------------------------------


def _kill_listed(path: Any) -> list[int]:
    pids = [int(p) for p in path.read_text().split()] if path.exists() else []
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def test_worker_that_forked_then_crashed_is_reported(tmp_path: Any) -> None:
    # The grandchild holds the worker's socket open: EOF never comes. The
    # parent must see the worker itself die.
    record = tmp_path / "grandchildren"
    it = ProcessPrefetch(ForkThenCrash(str(record)), range(6), num_workers=1)
    try:
        assert next(it)[0] == 0 and next(it)[0] == 1
        finished, outcome = in_thread(lambda: next(it), 30)
        assert finished, "next() waits for ever for a worker that died"
        assert isinstance(outcome, WorkerError), repr(outcome)
        assert outcome.exitcode == -signal.SIGKILL
        # The worker's forked child dies with it.
        assert not _outlive(record), "fn's child outlived its worker"
    finally:
        it.close()
        _kill_listed(record)


def _outlive(record: Any, seconds: float = 10) -> list[int]:
    """The children listed in ``record`` still alive after up to ``seconds``."""
    pids = [int(p) for p in record.read_text().split()]
    deadline = time.monotonic() + seconds
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in pids if process_alive(p)]


def test_close_stops_what_fn_forked(tmp_path: Any) -> None:
    record = tmp_path / "grandchildren"
    it = ProcessPrefetch(ForkThenCrash(str(record), at=0, crash=False), range(50), num_workers=1)
    try:
        assert next(it)[0] == 0
        it.close()
        assert not _outlive(record), "fn's child outlived close()"
    finally:
        it.close()
        _kill_listed(record)


class StartThenEnd:
    """At key 1: start a helper with ``subprocess`` (as fn may start ffmpeg), write
    its pid to ``path``, then end the worker ``how``: ``segv`` (a crash in C
    code), ``exit`` (``sys.exit()`` in fn) or ``stop`` (SIGSTOP: the worker
    answers nothing, so close() SIGKILLs it after ``close_timeout``). Other
    keys: a small element. Defined here, so workers import this module."""

    def __init__(self, path: str, how: str) -> None:
        self.path, self.how = path, how

    def __call__(self, i: int) -> int:
        if i == 1:
            helper = subprocess.Popen(["sleep", "120"])
            with open(self.path, "a") as f:
                f.write(f"{helper.pid}\n")
            if self.how == "exit":
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGSEGV if self.how == "segv" else signal.SIGSTOP)
            time.sleep(120)
        return i


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("how", ["segv", "exit", "stop"])
def test_what_fn_started_with_subprocess_dies_however_the_worker_ends(
    tmp_path: Any, how: str
) -> None:
    """A helper that fn started with ``subprocess`` (which runs no at-fork hook:
    no PDEATHSIG of its own) is in the worker's process group, and must not
    outlive close(), whether the worker crashed, called ``sys.exit()`` (which
    escaped the worker's loop into the interpreter's own exit, atexit and all)
    or was SIGKILLed by close() after ``close_timeout``.

    From a review of the loader (grandchild.py). The parent SIGKILLed is a
    documented limitation: PDEATHSIG kills the worker, nothing kills the helper.
    """
    record = tmp_path / "helpers"
    it = ProcessPrefetch(StartThenEnd(str(record), how), range(6), num_workers=1, close_timeout=0.5)
    try:
        assert next(it) == 0
        if how == "stop":
            (worker,) = testing.workers(it)
            deadline = time.monotonic() + 20
            while _state(worker.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.005)
            assert _state(worker.pid) == "T"
        else:
            with pytest.raises(WorkerError) as info:
                next(it)
            if how == "exit":  # reported as fn's error, not as a bare exit code
                assert "SystemExit" in str(info.value)
        it.close()
        assert record.read_text().split(), "fn never started its helper"
        assert not _outlive(record, 3), "fn's subprocess outlived close()"
    finally:
        it.close()
        _kill_listed(record)


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("mode", ["main-fork", "thread-fork"])
def test_everything_dies_with_the_rank_whatever_fn_forked(mode: str) -> None:
    env = script_env()
    victim = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, "victim.py"), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    family: set[int] = set()
    try:
        line = victim.stdout.readline() if victim.stdout else ""
        assert line.startswith("ready"), line
        workers = {int(p) for p in line.split()[1:]}
        family = _descendants(victim.pid)
        assert workers < family  # the workers, and what their fn forked
        victim.kill()
        victim.wait(10)
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.01)
        survivors = [p for p in family if process_alive(p)]
    finally:
        victim.kill()
        victim.wait()
        for p in family:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not survivors, f"{survivors} outlived the rank"
