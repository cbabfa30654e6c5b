"""Small helpers shared by the tests."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc

from conftest import mpiexec_cmd, mpiexec_env

WORLD = MPI.COMM_WORLD


def noop(*args: Any, **kwargs: Any) -> None:
    """A destroy (or callback) that does nothing."""


def everyone(comm: MPI.Comm, value: Any) -> list[Any]:
    """Every rank's ``value`` (over the test's own communicator, not the manager's)."""
    return comm.allgather(value) if comm.Get_size() > 1 else [value]


class Obj:
    """A plain managed object; ``peer`` lets a test build cycles."""

    def __init__(self, tag: Any = None) -> None:
        self.tag = tag
        self.peer: Any = None


class CheckedLog:
    """A destroy log whose entries also check, collectively, that every rank
    destroys the same key at the same position (an MPI call, as a real
    collective destroy would make)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.keys: list[Any] = []

    def destroy(self, tag: Any) -> None:
        self.keys.append(tag)
        if self.comm.Get_size() > 1:
            mine = (len(self.keys), tag)
            everyone = self.comm.allgather(mine)
            assert all(e == mine for e in everyone), f"destroy order differs: {everyone}"


def make_cycle(comm: MPI.Comm, log: CheckedLog, tag: Any) -> cgc.Registration:
    """Register an object that lives in a two-object reference cycle."""
    a, b = Obj(tag), Obj()
    a.peer, b.peer = b, a
    return cgc.register(a, log.destroy, tag, comm=comm, name=f"cyc{tag}")


def same_on_all(comm: MPI.Comm, value: Any) -> bool:
    return all(v == value for v in comm.allgather(value))


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; a zombie (dead, not yet reaped) is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def script_env() -> dict[str, str]:
    """The environment of a script in a fresh interpreter: no MPI launcher's
    variables (it would take itself for a rank of this job), this sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def in_thread(call: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run ``call`` on a thread; (whether it finished within ``timeout``, what
    it returned or raised). A loader that hangs fails the test, not the session."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (result[0] if result else None)


def mapped_segments() -> int:
    """How many of the loader's shared-memory segments this process maps."""
    with open("/proc/self/maps") as f:
        return sum("memfd:collective_gc" in line for line in f)


class GcDisabled:
    """Context manager: automatic cyclic collection off, restored after."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


_WINDOWS: list[str | None] = []


def windows_or_skip(comm: MPI.Intracomm) -> None:
    """Collective on the first call (every rank runs the tests in one order):
    skip the test if this MPI cannot create an ``MPI.Win.Create`` window on
    ``comm``'s world at all. Open MPI 4.1 with ``btl=tcp,self`` (the transport
    between nodes) fails every creation with MPI_ERR_WIN, on every rank alike;
    that is this MPI's limit, not ours. The answer is agreed (an allreduce),
    so every rank skips or none."""
    why = windows_fail(comm)
    if why is not None:
        pytest.skip(f"this MPI cannot create windows over btl tcp,self: {why}")


def windows_fail(comm: MPI.Intracomm) -> str | None:
    """Collective on the first call: why ``MPI.Win.Create`` fails on every
    rank of ``comm``, or None if it works (see :func:`windows_or_skip`)."""
    if not _WINDOWS:
        why = None
        try:
            MPI.Win.Create(None, 1, MPI.INFO_NULL, comm).Free()
        except MPI.Exception as exc:
            why = exc.Get_error_string()
        failed = comm.allreduce(why is not None, op=MPI.LOR)
        if failed and not _tcp_only():
            # Only the TCP-only transport excuses it: on any other stack the
            # window tests must fail, not skip (every rank raises alike).
            raise RuntimeError(
                f"MPI.Win.Create fails on this stack ({why or 'on another rank'}) although "
                "its transport is not restricted to tcp,self"
            )
        _WINDOWS.append((why or "failed on another rank") if failed else None)
    return _WINDOWS[0]


def _tcp_only() -> bool:
    """Whether Open MPI was told to use only its TCP and self transports."""
    btl = os.environ.get("OMPI_MCA_btl", "").strip()
    names = {n.strip() for n in btl.split(",") if n.strip()}
    return bool(names) and not btl.startswith("^") and names <= {"tcp", "self"}


# -- participants that record or raise (tests of participants and of interrupts) --


def outcome_of(fn: Any) -> str:
    """Run ``fn``; name what it raised (or "ok")."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
        return type(exc).__name__
    return "ok"


class Tiny:
    __slots__ = ("__weakref__",)


class Recorder(cgc.Participant):
    def __init__(self, field: int, vote: int) -> None:
        self.field = field
        self._vote = vote
        self.seen: list[int] = []

    def vote(self, mgr: cgc.Manager) -> int:
        return self._vote

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        self.seen.append(self.votes(flags))


class Finisher(cgc.Participant):
    """A finish that raises ``exc`` on ``rank`` (``may`` answers may_raise),
    and logs each call."""

    def __init__(self, tag: str, rank: int, exc: BaseException | None, may: bool) -> None:
        self.tag, self.rank, self.exc, self.may = tag, rank, exc, may

    def may_raise(self, flags: int) -> bool:
        return self.may

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        FINISHED.append(self.tag)
        if self.exc is not None and mgr.rank == self.rank:
            raise self.exc


FINISHED: list[str] = []


def sync_with(mgr: cgc.Manager, *parts: cgc.Participant) -> object:
    """One sync point of ``mgr`` with ``parts`` as its own participants, the
    finish log emptied first."""
    FINISHED.clear()
    return mgr.sync(deadline=time.monotonic() + 30, participants=parts)


class Asked(Finisher):
    """may_raise raises ``exc`` on ``rank`` the first time it is asked."""

    def __init__(self, rank: int, exc: BaseException) -> None:
        super().__init__("asked", -1, None, True)
        self.pending: BaseException | None = exc
        self.asked_rank = rank
        self.asked = 0

    def may_raise(self, flags: int) -> bool:
        self.asked += 1
        exc, self.pending = self.pending, None
        if exc is not None and self.asked_rank in (-1, WORLD.Get_rank()):
            raise exc
        return True


TIMEOUT = 5.0  # every collective that may fail here gives up after this


# -- verdicts and whole jobs (tests of interrupts, registration, lifecycle) --------


def attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    """Run ``fn``: ("ok", what it returned), or (the name of what it raised, None)."""
    try:
        return "ok", fn()
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
        return type(exc).__name__, None


# Each rank's stdout and stderr go to files of their own (out.RANK, err.RANK in
# the directory given as argv[1]): mpiexec may splice the ranks' lines.
JOB_HEAD = """
import os, sys
from mpi4py import MPI
import collective_gc as cgc

rank = MPI.COMM_WORLD.Get_rank()
for fd, kind in ((1, "out"), (2, "err")):
    f = os.open(os.path.join(sys.argv[1], f"{kind}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(f, fd)
    os.close(f)


class Obj:
    pass
"""


def run_job(
    tmp_path: Path, source: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str], list[str], float]:
    """Run ``source`` on 4 ranks: the process, each rank's stdout and stderr,
    and the job's wall time."""
    script = tmp_path / "job.py"
    script.write_text(source)
    e = mpiexec_env()
    e.update(env)
    t0 = time.monotonic()
    proc = subprocess.run(
        [*mpiexec_cmd(4, 60), sys.executable, "-m", "mpi4py", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        env=e,
    )
    took = time.monotonic() - t0

    def read(name: str) -> str:
        path = tmp_path / name
        return path.read_text(errors="replace") if path.exists() else ""

    outs = [read(f"out.{r}") for r in range(4)]
    errs = [read(f"err.{r}") for r in range(4)]
    return proc, outs, errs, took


def job_report(proc: subprocess.CompletedProcess[str], outs: list[str], errs: list[str]) -> str:
    parts = [f"exit code {proc.returncode}", proc.stdout, proc.stderr]
    for r in range(4):
        parts += [f"--- rank {r} stdout:\n{outs[r]}", f"--- rank {r} stderr:\n{errs[r]}"]
    return "\n".join(parts)
