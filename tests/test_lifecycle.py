"""Lifecycle: close, exit, fork and freed communicators; whole jobs (marker ``launcher``) for
what happens at exit, after MPI_Finalize and on signals.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import (
    JOB_HEAD,
    WORLD,
    CheckedLog,
    Obj,
    job_report,
    noop,
    run_job,
)
from conftest import mpiexec_cmd, mpiexec_env


def test_close_after_a_failed_last_sync_point_then_reuse(comm: MPI.Intracomm) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    rank = comm.Get_rank()
    ran: list[str] = []

    def fails(tag: str) -> None:
        ran.append(tag)
        raise ValueError(tag)

    mgr = cgc.manager(comm)
    a, b, c = Obj(), Obj(), Obj()
    cgc.register(a, fails, "a", comm=comm)
    rb = cgc.register(b, ran.append, "b", comm=comm)
    rc = cgc.register(c, ran.append, "c", comm=comm)
    del a
    if rank == 0:
        del b  # queued on rank 0 only
    with pytest.raises(cgc.DestroyError):
        mgr.close(timeout=30)
    assert mgr.broken is None  # the close did not happen: its sync point raised
    with pytest.warns(cgc.ExitLeakWarning):
        mgr.close(timeout=30)
    solo = comm.Get_size() == 1
    assert ran == (["b", "a"] if solo else ["a"])
    assert not rb.alive and not rc.alive
    assert rb.state == ("destroyed" if solo else "detached") and rc.state == "detached"
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.collect(comm, timeout=30)
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.register(Obj(), noop, comm=comm)
    del c
    if rank != 0:
        del b
    gc.collect()
    assert ran == (["b", "a"] if solo else ["a"])  # detached: b's and c's finalizers did nothing
    assert mgr.pending() == []


def test_finalizers_after_close_or_after_the_manager_is_forgotten_do_nothing() -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    comm = MPI.COMM_SELF.Dup()
    try:
        mgr = cgc.manager(comm)
        ran: list[int] = []
        objs = [Obj() for _ in range(100)]
        regs = [cgc.register(o, ran.append, i, comm=comm) for i, o in enumerate(objs)]
        with pytest.warns(cgc.ExitLeakWarning, match="100 registration"):
            mgr.close()
        del objs
        gc.collect()
        assert ran == [] and all(r.state == "detached" for r in regs)
        assert mgr.pending() == [] and mgr.registered == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.close()
    finally:
        comm.Free()


_EXIT_CHAIN_JOB = (
    JOB_HEAD
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


@pytest.mark.launcher
def test_at_exit_a_destroy_that_drops_a_managed_object_has_it_destroyed_too(
    tmp_path: Path,
) -> None:
    """Found by a hostile review of the promise (reproducer h3)."""
    # h3: at exit there is not just one agreement: what A's destroy drops (B,
    # alike on every rank) is agreed and destroyed as well, not leaked.
    proc, outs, errs, _ = run_job(tmp_path, _EXIT_CHAIN_JOB, COLLECTIVE_GC_EXIT_TIMEOUT="20")
    report = job_report(proc, outs, errs)
    assert proc.returncode == 0, report
    for rank in range(4):
        assert f"script end on rank {rank}" in outs[rank], report
        assert f"destroy A ran on rank {rank}" in outs[rank], report
        assert f"destroy B ran on rank {rank}" in outs[rank], report
        assert "leaked at exit" not in errs[rank], report
    assert "leaked at exit" not in proc.stderr, report


def test_manager_of_a_freed_communicator() -> None:
    """Issue 11, defects 2 and 7."""
    comm = WORLD.Dup()
    log = CheckedLog(WORLD)
    o = Obj()
    cgc.register(o, log.destroy, "after-free", comm=comm)
    mgr = cgc.manager(comm)
    del o
    comm.Free()
    assert mgr.comm_freed
    with pytest.raises(cgc.CollectiveGCError, match="was freed"):
        mgr.comm  # noqa: B018 (the property is the test)
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.collect(comm)
    # Its pending destroy is not lost: the manager still agrees over its own
    # duplicate (the exit agreement does this for a program that never asks).
    assert mgr.sync().destroyed == 1
    assert log.keys == ["after-free"]


def test_freed_communicators_do_not_accumulate() -> None:
    """Issue 11, defects 2 and 7."""
    before = len(cgc.managers())
    for _ in range(300):
        comm = WORLD.Dup()
        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        cgc.collect(comm, generation=None)
        comm.Free()
    cgc.manager(MPI.COMM_SELF)  # a lookup is a safe point to let go of freed managers
    assert len(cgc.managers()) <= before + 2, len(cgc.managers())


SCRIPTS = Path(__file__).parent / "scripts"


# Forking a process that has threads (MPI's, the reaper) is what this tests;
# Python 3.12+ warns of it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_never_runs_parent_destroys_or_syncs(comm: MPI.Intracomm) -> None:
    """From the fault tests of the reliability work."""
    log: list[str] = []
    o = Obj()
    cgc.register(o, log.append, "parent", comm=comm)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            del o
            gc.collect()
            try:
                cgc.collect(comm, generation=None)
            except cgc.CollectiveGCError as exc:
                code = 0 if "forked child" in str(exc) else 2
            os.write(w, repr(log).encode())
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    seen = os.read(r, 100).decode()
    os.close(r)
    assert os.WEXITSTATUS(status) == 0 and seen == "[]"
    del o
    assert cgc.collect(comm).destroyed == 1 and log == ["parent"]


class _Resource:
    """Stands in for what a registration's destroy holds (a PETSc object,
    an HDF5 file): its destructor, which would close it, notes the process
    it ran in."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __del__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _close(resource: _Resource) -> None:
    pass  # (the resource's own destructor runs when the call lets go of it)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_keeps_the_parents_resources_without_destroying_them(
    comm: MPI.Intracomm, tmp_path: Path
) -> None:
    """A collective registration's call holds the parent's resources. A
    forked child must neither run the destroy nor let go of them: the last
    reference dropped runs the resource's own destructor there (an HDF5
    file's close, collective over MPI, in a process sharing the parent's MPI
    state). Only the parent's sync point destroys them.
    From a review of the exit and fork handling (stop 58): the child's fork
    handler detached the registrations and dropped their calls, and the
    resources' destructors ran in the child."""
    path = tmp_path / f"closed.{comm.Get_rank()}"
    owner = Obj()
    cgc.register(owner, _close, _Resource(path), comm=comm)
    pid = os.fork()
    if pid == 0:
        try:
            del owner
            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    in_child = path.read_text().split() if path.exists() else []
    del owner
    cgc.collect(comm, generation=None)
    closed = path.read_text().split()
    assert (status, in_child, closed) == (0, [], [str(os.getpid())])


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("where", ["comm=None", "COMM_SELF"])
def test_a_forked_child_keeps_the_parents_rank_local_resources_too(
    where: str, tmp_path: Path
) -> None:
    """A rank-local registration's call holds the parent's resources as much
    as a collective one's (a buffered writer, whose destructor flushes into
    the parent's file; a temporary file, whose destructor deletes it). A
    forked child must neither run the destroy nor let go of them: only the
    parent destroys them. Before: the families' calls were kept (collective
    ones, and a family of size 1's, on COMM_SELF), but the child's fork
    handler let go of the rank-local reaper's (comm=None), and the
    resources' destructors ran in the child."""
    path = tmp_path / f"closed.{WORLD.Get_rank()}"
    comm = MPI.COMM_SELF.Dup() if where == "COMM_SELF" else None
    try:
        owner = Obj()
        cgc.register(owner, _close, _Resource(path), comm=comm)
        pid = os.fork()
        if pid == 0:
            try:
                del owner
                gc.collect()
                cgc.local.flush(timeout=5)
                gc.collect()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        in_child = path.read_text().split() if path.exists() else []
        del owner
        if comm is None:
            assert cgc.local.flush(timeout=10)
        else:
            cgc.collect(comm, generation=None)
        closed = path.read_text().split() if path.exists() else []
        assert (status, in_child, closed) == (0, [], [str(os.getpid())])
    finally:
        if comm is not None:
            cgc.manager(comm).close()
            comm.Free()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_lets_go_of_the_loaders_segments() -> None:
    """A forked child lets go of the registrations' calls of the per-rank
    loader's shared-memory segments (collective_gc.data). A child's mapping
    of a segment is its own copy, which the loader's fork handler unmaps or
    replaces with private memory (an element of the child views it); kept by
    the registration's call, the child would hold that memory (a private copy
    of the slot) for its whole life, long after its last element on it died."""
    from collective_gc.data import _shm

    if not _shm.supported():
        pytest.skip("no memfd segments on this platform")
    fd, mapping = _shm.create(_shm.PAGE, "collective_gc-test-fork")
    os.close(fd)
    segment = _shm.Segment(mapping, _shm.PAGE, "a segment")  # held as an element would hold it
    mapped = weakref.ref(mapping)
    del mapping
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            del segment  # the child's last element on it dies
            gc.collect()
            code = 0 if mapped() is None else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    del segment
    assert cgc.local.flush(timeout=10)
    assert (os.waitstatus_to_exitcode(status), mapped()) == (0, None)


def _mpiexec(args: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*mpiexec_cmd(4, 100), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpiexec_env(),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.launcher
def test_uncaught_exception_mid_loop_ends_the_job(tmp_path: Path) -> None:
    """From the fault tests of the reliability work."""
    t0 = time.monotonic()
    proc = _mpiexec(
        [sys.executable, "-m", "mpi4py", str(SCRIPTS / "uncaught_midloop.py"), str(tmp_path / "m")]
    )
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "solver diverged on rank 2" in err
    assert elapsed < 30, elapsed  # aborted, not hung (and not held up by an exit agreement)


@pytest.mark.launcher
def test_sigterm_to_the_whole_job(tmp_path: Path) -> None:
    """From the fault tests of the reliability work."""
    marker = tmp_path / "looping"
    proc = _mpiexec([sys.executable, "-m", "mpi4py", str(SCRIPTS / "long_loop.py"), str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never started looping"
        time.sleep(0.1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode != 0
    left = subprocess.run(
        ["pgrep", "-f", str(SCRIPTS / "long_loop.py")], capture_output=True, text=True
    )
    assert left.stdout.strip() == "", "ranks survived SIGTERM"


@pytest.mark.launcher
def test_finalizers_after_mpi_finalize_do_nothing() -> None:
    """From the fault tests of the reliability work."""
    proc = _mpiexec([sys.executable, str(SCRIPTS / "after_finalize.py")])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.count("ok") == 4
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.launcher
def test_shutdown_with_the_reaper_busy() -> None:
    """From the fault tests of the reliability work."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "busy_reaper.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 12  # bounded: it does not wait for all 40 x 0.3 s
    assert "reaper is still busy at exit" in proc.stderr


# Forking a process that has threads (MPI's, the reaper) is what this tests;
# Python 3.12+ warns of it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_returns_from_fork_while_other_threads_hold_our_locks(
    comm: MPI.Intracomm,
) -> None:
    """From the fault tests of the reliability work."""
    # Only the forking thread exists in the child: a lock another thread held
    # at the fork (the reaper thread claiming a registration, a sync point on
    # another thread) is never released there. Our fork handler must not
    # take such a lock, and later calls must not wait on one.
    from collective_gc import _collective, _gcpolicy, _lookup, _manager, local

    cgc.collect(comm, generation=None)
    fam = _manager.family(cgc.manager(comm))
    assert fam is not None
    locks = [
        local._REAPER.ledger.lock,
        fam.lock,
        fam.registry.lock,
        _lookup._REGISTRY_LOCK,
        _collective._LOCK,
        _manager._FIRST,
        _gcpolicy.POLICY.lock,
    ]
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        for lock in locks:
            lock.acquire()
        taken.set()
        release.wait(60)
        for lock in reversed(locks):
            lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    cgc.collect(comm)  # the lookup, the GC policy, the manager
                except cgc.CollectiveGCError as exc:
                    code = 0 if "forked child" in str(exc) else 2
                local.register(Obj(), noop)  # a new reaper, its own lock
                local.flush(10)
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on a lock another thread held at the fork")
    assert os.WEXITSTATUS(status) == 0


# Each rank registers an object on a duplicate of COMM_WORLD, drops it, and
# exits without a sync point: the exit agreement must destroy it everywhere.
_EXIT_AGREEMENT_AFTER = (
    JOB_HEAD
    + """
world = MPI.COMM_WORLD.Dup()


def destroyed(r):
    print(f"destroyed on rank {r}", flush=True)


o = Obj()
cgc.register(o, destroyed, rank, comm=world)
del o
"""
)


@pytest.mark.launcher
def test_an_exit_timeout_set_wrong_after_import_is_warned_of_and_the_exit_agreement_runs(
    tmp_path: Path,
) -> None:
    """``COLLECTIVE_GC_EXIT_TIMEOUT`` is read again at exit, so that a value
    the program sets after import counts; a bad one is warned of, and the
    value read at import is used. From a review of the exit handling (stop
    58): it raised ValueError in the exit handler, which ran no exit
    agreement and destroyed nothing, without a leak warning."""
    source = _EXIT_AGREEMENT_AFTER + "os.environ['COLLECTIVE_GC_EXIT_TIMEOUT'] = '30s'\n"
    proc, outs, errs, _ = run_job(tmp_path, source)
    report = job_report(proc, outs, errs)
    assert proc.returncode == 0, report
    assert [o.strip() for o in outs] == [f"destroyed on rank {r}" for r in range(4)], report
    warned = ["'30s' is not a positive number of seconds", "using 10.0 s, the value read at import"]
    assert all(w in e for e in errs for w in warned), report


_SHOWN = {
    "interactive": (
        "import code\nif rank == 0:\n    code.InteractiveInterpreter().runsource('1/0')\n"
    ),
    "logged": (
        "def log_it():\n"
        "    try:\n"
        "        1 / 0\n"
        "    except ZeroDivisionError:\n"
        "        sys.excepthook(*sys.exc_info())\n"
        "if rank == 0:\n"
        "    log_it()\n"
    ),
}


@pytest.mark.launcher
@pytest.mark.parametrize("how", sorted(_SHOWN))
def test_an_error_shown_and_handled_is_no_death_at_exit(tmp_path: Path, how: str) -> None:
    """An error that Python code hands to ``sys.excepthook`` and goes on
    after (``code.InteractiveInterpreter`` does, for each error it shows; a
    program may, to log one) is no uncaught exception: the rank still takes
    part in the exit agreement. From a review of the exit handling (stop
    58): rank 0 took it for its death, skipped the exit agreement, and the
    other ranks waited in it until their deadline, every destroy lost."""
    source = _EXIT_AGREEMENT_AFTER + _SHOWN[how]
    proc, outs, errs, took = run_job(tmp_path, source, COLLECTIVE_GC_EXIT_TIMEOUT="20")
    report = job_report(proc, outs, errs)
    assert proc.returncode == 0, report
    assert [o.strip() for o in outs] == [f"destroyed on rank {r}" for r in range(4)], report
    assert "ZeroDivisionError" in errs[0] and "uncaught" not in errs[0], report


@pytest.mark.launcher
def test_a_death_through_a_hook_that_wraps_ours_is_still_a_death(tmp_path: Path) -> None:
    """A library's sys.excepthook installed after collective_gc's calls ours
    from Python (a crash reporter's). An uncaught exception on rank 0 is
    still its death: rank 0 leaks its pending destroy and says so at once,
    rather than waiting in an exit agreement the others never reach (until
    the exit timeout, 60 s here). From a review of this stop's exit fix: a
    hook called with any Python caller was taken for no death."""
    source = _EXIT_AGREEMENT_AFTER + (
        "import time\n"
        "previous = sys.excepthook\n"
        "sys.excepthook = lambda *info: previous(*info)\n"
        "if rank == 0:\n"
        "    raise RuntimeError('rank 0 dies')\n"
        "time.sleep(60)\n"
    )
    proc, outs, errs, took = run_job(tmp_path, source, COLLECTIVE_GC_EXIT_TIMEOUT="60")
    report = job_report(proc, outs, errs)
    assert proc.returncode != 0 and took < 40, report
    assert "exiting on an uncaught exception: 1 pending" in errs[0], report
