"""Faults: failing destroys, dying ranks, signals, late finalizers, fork, bad input."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import CheckedLog, Obj
from conftest import mpiexec_cmd, mpiexec_env


def noop(*args: object) -> None:
    pass


SCRIPTS = Path(__file__).parent / "scripts"


# -- in-process, serial and under mpiexec -n 4 --------------------------------


def test_destroy_raising_on_every_rank(comm: MPI.Intracomm) -> None:
    log = CheckedLog(comm)

    def bad(tag: int) -> None:
        log.destroy(tag)
        raise ValueError(f"cannot destroy {tag}")

    objs = [Obj() for _ in range(2)]
    for i, o in enumerate(objs):
        cgc.register(o, bad, i, comm=comm, name=f"r{i}")
    del o
    objs.clear()
    with pytest.raises(cgc.DestroyError) as info:
        cgc.collect(comm)
    assert log.keys == [1, 0]
    assert len(info.value.failures) == 2 * comm.Get_size()
    assert {f[0] for f in info.value.failures} == set(range(comm.Get_size()))
    assert cgc.collect(comm).pending == 0


def test_bad_input_loses_nothing(comm: MPI.Intracomm) -> None:
    log = CheckedLog(comm)
    queued = Obj()
    cgc.register(queued, log.destroy, "kept", comm=comm)
    del queued
    for bad in (
        lambda: cgc.register(1.5, print, comm=comm),  # not weakly referenceable
        lambda: cgc.register(Obj(), "close", comm=comm),  # not callable
        lambda: cgc.register(Obj(), print, comm="world"),  # not a communicator
    ):
        with pytest.raises((cgc.RegistrationError, TypeError)):
            bad()
    freed = comm.Dup()
    freed.Free()
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.register(Obj(), print, comm=freed)
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.collect(freed)
    # Nothing queued was lost, and the refusals consumed no key.
    assert cgc.manager(comm).next_key == 1
    assert cgc.collect(comm).destroyed == 1 and log.keys == ["kept"]


@pytest.mark.mpi(min_size=2)
def test_collect_on_a_communicator_this_rank_is_not_in(comm: MPI.Intracomm) -> None:
    sub = comm.Split(0 if comm.Get_rank() else MPI.UNDEFINED, 0)
    if comm.Get_rank() == 0:
        with pytest.raises(ValueError, match="not in it"):
            cgc.collect(sub)
    else:
        assert cgc.collect(sub).destroyed == 0
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_destroy_blocking_on_one_rank_with_timeout(comm: MPI.Intracomm) -> None:
    # Rank 0's destroy "hangs" (longer than the timeout); the others must not
    # wait for it for ever: their sync point raises CollectiveTimeoutError.
    o = Obj()
    slow = comm.Get_rank() == 0
    cgc.register(o, time.sleep, 2.0 if slow else 0.0, comm=comm)
    del o
    if slow:
        try:
            cgc.collect(comm, timeout=0.5)
        except cgc.CollectiveTimeoutError:
            pass  # it may or may not match the others' abandoned requests
    else:
        with pytest.raises(cgc.CollectiveTimeoutError, match="error check"):
            cgc.collect(comm, timeout=0.5)
    comm.Barrier()
    cgc.manager(comm).mark_unusable("the end of this test")


# Forking a process that has threads (MPI's, the reaper) is what this tests;
# Python 3.12+ warns of it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_never_runs_parent_destroys_or_syncs(comm: MPI.Intracomm) -> None:
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


# -- whole jobs, from the serial session ---------------------------------------


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
    proc = _mpiexec([sys.executable, str(SCRIPTS / "after_finalize.py")])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.count("ok") == 4
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.launcher
def test_shutdown_with_the_reaper_busy() -> None:
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
    # Only the forking thread exists in the child: a lock another thread held
    # at the fork (the reaper thread claiming a registration, a sync point on
    # another thread) is never released there. Our fork handler must not
    # take such a lock, and later calls must not wait on one.
    from collective_gc import _gcpolicy, _lookup, local

    cgc.collect(comm, generation=None)
    mgr = cgc.manager(comm)
    locks = [
        local._REAPER.ledger.lock,
        mgr._lock,
        mgr._books.registry.lock,
        _lookup._REGISTRY_LOCK,
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
