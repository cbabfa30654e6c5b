"""Regression tests for the defects of a hostile review (reproducers h1-h13):
interrupts that reach a rank while it waits for a late one (strict mode's
sync point and report, ``view``, the first registration, ``close``), a
registration name that is not a str, an exception whose ``str()`` raises an
interrupt, and two exit agreements (a destroy that drops another managed
object, an interrupt in a derived communicator's destroy).

As in test_core_v2_hostile.py: the tests that need other ranks are marked
``mpi``; verdicts that could differ between ranks are gathered first and
asserted on every rank alike, and every collective that may fail has a
deadline of a few seconds, so that a regression fails instead of hanging.
The exit tests start their own 4-rank jobs (marker ``launcher``).
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _scope

from _util import Obj
from conftest import mpiexec_cmd, mpiexec_env

TIMEOUT = 5.0  # every collective that may fail here gives up after this
LATE = 1.0  # how late rank 1 arrives
ALARM = 0.3  # how far into its wait rank 0 is interrupted


def noop(*args: Any) -> None:
    pass


def attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    """Run ``fn``: ("ok", what it returned), or (the name of what it raised, None)."""
    try:
        return "ok", fn()
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
        return type(exc).__name__, None


def everyone(comm: MPI.Comm, value: Any) -> list[Any]:
    """Every rank's ``value`` (over the test's own communicator, not the manager's)."""
    return comm.allgather(value) if comm.Get_size() > 1 else [value]


def interrupted_on_rank_0(
    comm: MPI.Intracomm, fn: Callable[[], Any], *, late: bool = True
) -> tuple[str, Any, list[str]]:
    """Every rank runs ``fn``, rank 1 ``LATE`` seconds after the others if
    ``late``; rank 0 gets a KeyboardInterrupt (SIGALRM) ``ALARM`` seconds into
    its call. What ``fn`` raised or returned (see :func:`attempt`), and on
    rank 0 the functions the interrupt landed in (``fn``'s calls, innermost
    first)."""
    rank = comm.Get_rank()
    if rank == 1 and late:
        time.sleep(LATE)
    if rank != 0:
        return (*attempt(fn), [])
    where: list[str] = []

    def interrupt(signum: int, frame: Any) -> None:
        while frame is not None and frame.f_code is not attempt.__code__:  # inside fn
            where.append(frame.f_code.co_name)
            frame = frame.f_back
        raise KeyboardInterrupt("SIGALRM")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, ALARM)
    try:
        return (*attempt(fn), where)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def barrier(comm: MPI.Intracomm) -> None:
    """A barrier on the test's communicator that gives up after ``TIMEOUT``."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + TIMEOUT
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError("a rank did not reach the test's barrier")
        time.sleep(1e-3)


def collect_ok(comm: MPI.Intracomm) -> tuple[str, Any]:
    """A sync point with a deadline: ("ok", destroyed) or what it raised."""
    seen, stats = attempt(lambda: cgc.collect(comm, generation=None, timeout=TIMEOUT))
    return seen, None if stats is None else stats.destroyed


# -- h13, h2: strict mode's report after an interrupted sync point -------------------


def _strict_sync(comm: MPI.Intracomm, late: bool) -> tuple[str, str, list[str]]:
    """In a strict scope, a managed object dies in a cycle on every rank; then
    a sync point, rank 0 interrupted in it. What that sync point raised, what
    the scope's exit sync point raised, and where rank 0 was interrupted."""
    seen: list[tuple[str, Any, list[str]]] = []

    def body() -> None:
        with cgc.collective_scope(
            comm, strict=True, gc="off", exit_collect=None, timeout=TIMEOUT
        ) as scope:
            o = Obj()
            o.peer = o
            cgc.register(o, noop, comm=comm, name="cyclic")
            del o
            gc.collect()
            barrier(comm)  # every rank has its cyclic death queued
            seen.append(interrupted_on_rank_0(comm, scope.sync, late=late))

    left = attempt(body)[0]
    (sync, _, where), *_ = seen or [("not reached", None, [])]
    return sync, left, where


def _assert_strict_outcome(comm: MPI.Intracomm, late: bool, inside: str, outside: str) -> None:
    """Run :func:`_strict_sync`; rank 0 raises its interrupt, every other rank
    the report, every manager stays usable; rank 0 was interrupted in
    ``inside``, not in ``outside``."""
    sync, left, where = _strict_sync(comm, late=late)
    broken = cgc.manager(comm).broken
    after = collect_ok(comm)
    states = everyone(comm, (sync, left, broken, after))
    wheres = everyone(comm, where)
    assert inside in wheres[0] and outside not in wheres[0], (wheres[0], states)
    assert states == [("KeyboardInterrupt", "ok", None, ("ok", 0))] + [
        ("CyclicFinalizationError", "ok", None, ("ok", 0))
    ] * (comm.Get_size() - 1), states


@pytest.mark.mpi(min_size=2)
def test_strict_sync_interrupted_while_waiting_still_reports_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    # h13: rank 0's interrupt is held through the sync point's agreement, which
    # then sees the cyclic death: rank 0 must still take part in the strict
    # report's gather (the others wait in it), then raise the interrupt.
    # Interrupted in the agreement, not in the gather of the report (see below).
    _assert_strict_outcome(comm, late=True, inside="agree", outside="allgather")


@pytest.mark.mpi(min_size=2)
def test_strict_report_interrupted_while_waiting_holds_the_interrupt(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # h2: the sync point completes at once; rank 1 is slow formatting its rows
    # of the strict report, and rank 0 is interrupted while it waits for them
    # in the report's gather (Manager.allgather): held until the gather is
    # done, then raised on rank 0; the others raise the report.
    if comm.Get_rank() == 1:
        real = _scope._origin

        def slow(origin: Any) -> str:
            time.sleep(LATE)
            return real(origin)

        monkeypatch.setattr(_scope, "_origin", slow)
    # Interrupted in the gather of the report, not in the agreement (see above).
    _assert_strict_outcome(comm, late=False, inside="allgather", outside="agree")


# -- h11: view ---------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_view_interrupted_while_waiting_holds_the_interrupt(comm: MPI.Intracomm) -> None:
    cgc.collect(comm, generation=None, timeout=TIMEOUT)  # the private duplicate exists
    mgr = cgc.manager(comm)
    seen, text, where = interrupted_on_rank_0(
        comm, lambda: cgc.view(comm, file=None, timeout=TIMEOUT)
    )
    broken = mgr.broken
    after = collect_ok(comm)
    states = everyone(comm, (seen, isinstance(text, str), broken, after))
    wheres = everyone(comm, where)
    assert "view" in wheres[0] and "allgather" in wheres[0], (wheres[0], states)
    # The gather completes on every rank; rank 0 raises its interrupt after it.
    n = comm.Get_size()
    assert states == [("KeyboardInterrupt", False, None, ("ok", 0))] + [
        ("ok", True, None, ("ok", 0))
    ] * (n - 1), states


# -- h1: a name that is not a str ------------------------------------------------


def _refuses_names_that_are_not_str(comm: MPI.Intracomm) -> None:
    # Sync points send names to the other ranks in their error reports: a
    # name that does not pickle (a lambda) hung them. Refused at once, here.
    mgr = cgc.manager(comm)
    o = Obj()
    for name in (lambda: None, 5):
        try:
            cgc.register(o, noop, comm=comm, name=name)  # type: ignore[arg-type]
            raised: tuple[str, ...] = ("nothing",)
        except BaseException as exc:  # noqa: BLE001 (not kept: its frames hold o)
            raised = (
                type(exc).__name__,
                *(k.__name__ for k in (cgc.RegistrationError, TypeError) if isinstance(exc, k)),
            )
        assert raised == ("RegistrationError", "RegistrationError", "TypeError"), (name, raised)
        assert (mgr.next_key, mgr.registered, mgr.alive()) == (0, 0, []), (name, mgr)
    # None and a str still work (and the refused object was not kept).
    reg = cgc.register(o, noop, comm=comm, name=None)
    p = Obj()
    named = cgc.register(p, noop, comm=comm, name="p")
    assert (reg.key, named.key, named.name) == (0, 1, "p")
    del o, p
    assert cgc.collect(comm, generation=None, timeout=TIMEOUT).destroyed == 2


class TestNameMustBeAStr:
    COMM = MPI.COMM_SELF

    def test_a_name_that_is_not_a_str_is_refused_before_anything_is_registered(
        self, comm: MPI.Intracomm
    ) -> None:
        _refuses_names_that_are_not_str(comm)


@pytest.mark.mpi(min_size=2)
def test_a_name_that_is_not_a_str_is_refused_at_a_first_registration(
    comm: MPI.Intracomm,
) -> None:
    # On a larger communicator the first registration makes the private
    # duplicate (a collective): refused before it, alike on every rank.
    _refuses_names_that_are_not_str(comm)


# -- h12: an exception whose str() raises an interrupt ------------------------------


@pytest.mark.mpi(min_size=2)
def test_a_failure_whose_str_raises_an_interrupt_hangs_no_rank(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()

    class Weird(RuntimeError):
        def __str__(self) -> str:
            raise KeyboardInterrupt("from __str__")

    def destroy() -> None:
        if rank == 1:
            raise Weird()

    o = Obj()
    cgc.register(o, destroy, comm=comm, name="weird")
    del o
    seen, _ = attempt(lambda: cgc.collect(comm, generation=None, timeout=10))
    states = everyone(comm, seen)
    # The error report still reaches every rank: rank 1 raises the interrupt
    # its str() raised, the others the DestroyError (not a timeout).
    assert states == ["DestroyError", "KeyboardInterrupt"] + ["DestroyError"] * (
        comm.Get_size() - 2
    ), states


# -- h6: the first registration on a communicator ----------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("in_scope", [False, True])
def test_a_first_registration_interrupted_while_waiting_completes_on_every_rank(
    comm: MPI.Intracomm, in_scope: bool
) -> None:
    # The first registration on a fresh communicator makes its private
    # duplicate, waiting for a late rank 1; rank 0 is interrupted meanwhile:
    # the duplicate is still made and the object registered on every rank,
    # rank 0's register then raising the interrupt. Outside a scope the wait
    # has no deadline (MPI's Wait: the signal's handler runs once it
    # returns); in a scope with a timeout it polls against the scope's.
    held = [Obj()]
    ref = weakref.ref(held[0])

    def first() -> cgc.Registration:
        return cgc.register(held[0], noop, comm=comm, name="first")

    if in_scope:
        got: list[tuple[str, Any, list[str]]] = []

        def body() -> None:
            with cgc.collective_scope(comm, gc="auto", exit_collect=None, timeout=TIMEOUT):
                got.append(interrupted_on_rank_0(comm, first))

        left = attempt(body)[0]  # and the scope's exit sync point
        seen, reg, where = got[0] if got else ("not reached", None, [])
    else:
        left = "ok"
        seen, reg, where = interrupted_on_rank_0(comm, first)
    mgr = cgc.manager(comm)
    snap = mgr.snapshot()
    state = (
        len(cgc.pending(comm)),
        [(r.key, r.name, r() is held[0]) for r in snap.alive],
        snap.next_key,
        snap.broken,
    )
    returned = None if reg is None else (type(reg).__name__, reg.key)
    held.clear()  # dropped on every rank
    del reg, snap
    dead = ref() is None
    after = collect_ok(comm)
    states = everyone(comm, (seen, left, returned, state, dead, after))
    wheres = everyone(comm, where)
    assert "dup" in wheres[0], (wheres[0], states)  # making the private duplicate
    registered = (0, [(0, "first", True)], 1, None)
    n = comm.Get_size()
    assert states == [("KeyboardInterrupt", "ok", None, registered, True, ("ok", 1))] + [
        ("ok", "ok", ("Registration", 0), registered, True, ("ok", 1))
    ] * (n - 1), states


# -- h7: close ------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_close_interrupted_while_waiting_lets_go_on_every_rank(comm: MPI.Intracomm) -> None:
    cgc.collect(comm, generation=None, timeout=TIMEOUT)  # the private duplicate exists
    mgr = cgc.manager(comm)
    seen, _, where = interrupted_on_rank_0(comm, lambda: mgr.close(timeout=TIMEOUT))
    broken = mgr.broken
    states = everyone(comm, (seen, broken is not None and "closed" in broken, broken))
    wheres = everyone(comm, where)
    assert "close" in wheres[0], (wheres[0], states)
    # close's last sync point completes everywhere, so every manager lets go;
    # rank 0 raises its interrupt after.
    assert [s[:2] for s in states] == [("KeyboardInterrupt", True)] + [("ok", True)] * (
        comm.Get_size() - 1
    ), states


# -- h3, h4: at exit (jobs of their own) -----------------------------------------------

# Each rank's stdout and stderr go to files of their own (out.RANK, err.RANK in
# the directory given as argv[1]): mpiexec may splice the ranks' lines.
_JOB_HEAD = """
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

_EXIT_CHAIN_JOB = (
    _JOB_HEAD
    + """
comm = MPI.COMM_WORLD


def destroy_a(holder):
    print(f"destroy A ran on rank {rank}", flush=True)


def destroy_b():
    print(f"destroy B ran on rank {rank}", flush=True)


b = Obj()
cgc.register(b, destroy_b, comm=comm, name="B")
holder = [b]
del b
a = Obj()
cgc.register(a, destroy_a, holder, comm=comm, name="A")  # A's arguments hold B
del holder, a  # dropped on every rank: A is queued, B dies when A's destroy runs
print(f"script end on rank {rank}", flush=True)
"""
)

_EXIT_INTERRUPT_JOB = (
    _JOB_HEAD
    + """
comm = MPI.COMM_WORLD
sub = cgc.dup(comm)


def on_world():
    print(f"destroy W ran on rank {rank}", flush=True)


def on_sub():
    if rank == 0:
        raise KeyboardInterrupt("stop at exit")


w = Obj()
cgc.register(w, on_world, comm=comm, name="W")
s = Obj()
cgc.register(s, on_sub, comm=sub, name="S")
del w, s  # both queued on every rank: agreed at exit, the derived communicator first
print(f"script end on rank {rank}", flush=True)
"""
)


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


def _report(proc: subprocess.CompletedProcess[str], outs: list[str], errs: list[str]) -> str:
    parts = [f"exit code {proc.returncode}", proc.stdout, proc.stderr]
    for r in range(4):
        parts += [f"--- rank {r} stdout:\n{outs[r]}", f"--- rank {r} stderr:\n{errs[r]}"]
    return "\n".join(parts)


@pytest.mark.launcher
def test_at_exit_a_destroy_that_drops_a_managed_object_has_it_destroyed_too(
    tmp_path: Path,
) -> None:
    # h3: at exit there is not just one agreement: what A's destroy drops (B,
    # alike on every rank) is agreed and destroyed as well, not leaked.
    proc, outs, errs, _ = run_job(tmp_path, _EXIT_CHAIN_JOB, COLLECTIVE_GC_EXIT_TIMEOUT="20")
    report = _report(proc, outs, errs)
    assert proc.returncode == 0, report
    for rank in range(4):
        assert f"script end on rank {rank}" in outs[rank], report
        assert f"destroy A ran on rank {rank}" in outs[rank], report
        assert f"destroy B ran on rank {rank}" in outs[rank], report
        assert "leaked at exit" not in errs[rank], report
    assert "leaked at exit" not in proc.stderr, report


@pytest.mark.launcher
def test_at_exit_an_interrupt_in_a_derived_destroy_leaves_the_parent_agreed(
    tmp_path: Path,
) -> None:
    # h4: rank 0's interrupt in S's destroy (on a cgc.dup communicator) during
    # the exit agreement is raised only after that agreement's collectives;
    # the parent's exit agreement still runs on every rank (W is destroyed
    # everywhere), and no rank waits for the exit timeout.
    proc, outs, errs, took = run_job(tmp_path, _EXIT_INTERRUPT_JOB, COLLECTIVE_GC_EXIT_TIMEOUT="20")
    report = _report(proc, outs, errs)
    for rank in range(4):
        assert f"script end on rank {rank}" in outs[rank], report
        assert f"destroy W ran on rank {rank}" in outs[rank], report
    assert took < 10.0, f"the job took {took:.1f} s (exit timeout 20 s)\n{report}"
    assert "KeyboardInterrupt" in errs[0], report


# -- a third review: sync points whose participants differ between the ranks --------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["gc", "strict"])
def test_scopes_whose_options_differ_between_ranks_are_a_mismatch_on_every_rank(
    comm: MPI.Intracomm, differ: str
) -> None:
    # gc="managed" adds a participant that may make one more collective;
    # strict=True one that gathers the report. Differing between the ranks,
    # they made collectives on some ranks only (a raw MPI error on one rank,
    # a hang on the others): now the agreement sees it first.
    rank = comm.Get_rank()
    options: dict[str, Any] = (
        {"gc": "managed" if rank == 0 else "auto"}
        if differ == "gc"
        else {"gc": "off", "strict": rank == 0}
    )
    o = Obj()
    o.peer = o  # dies in the cyclic collector: strict mode has something to report
    cgc.register(o, noop, comm=comm, name="x")
    del o
    gc.collect()
    seen: list[str] = []

    def body() -> None:
        with cgc.collective_scope(comm, exit_collect=None, timeout=TIMEOUT, **options) as scope:
            for _ in range(3):
                try:
                    scope.sync()
                    seen.append("ok")
                except cgc.CollectiveMismatchError as exc:
                    seen.append("mismatch" if "different participants" in str(exc) else str(exc))
                    break
                except BaseException as exc:  # noqa: BLE001 (what it must not be)
                    seen.append(type(exc).__name__)
                    break

    # The scope's exit sync point is refused: the manager is unusable.
    left = attempt(body)[0]
    broken = cgc.manager(comm).broken is not None
    states = everyone(comm, (seen, left, broken))
    assert states == [(["mismatch"], "CollectiveGCError", True)] * comm.Get_size(), states
    for reg in cgc.manager(comm).alive() + cgc.manager(comm).pending():
        reg.detach()  # nothing left for the exit agreement of an unusable manager
