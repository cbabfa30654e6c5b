"""Rank-local registrations (comm=None): reaped off-thread, exactly once."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest

import collective_gc as cgc
from collective_gc import local

from _util import GcDisabled, Obj


def test_reaped_off_thread_exactly_once() -> None:
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def destroy(i: int) -> None:
        with lock:
            calls.append((i, threading.get_ident()))

    objs = [Obj() for _ in range(200)]
    regs = [cgc.register(o, destroy, i, comm=None) for i, o in enumerate(objs)]
    with GcDisabled():
        for o in objs[::2]:
            o.peer = o  # half in self-cycles
        del o
        objs.clear()
        gc.collect()
    assert local.flush(timeout=10)
    assert sorted(i for i, _ in calls) == list(range(200))
    assert {t for _, t in calls} != {threading.get_ident()}
    assert all(not r.alive and r.state == "destroyed" for r in regs)
    # Explicit destroy afterwards does nothing.
    regs[0].destroy()
    assert len(calls) == 200


def test_explicit_destroy_races_with_reaper() -> None:
    count = [0]

    def destroy() -> None:
        count[0] += 1

    for _ in range(300):
        o = Obj()
        reg = cgc.register(o, destroy, comm=None)
        del o  # queued for the reaper ...
        reg.destroy()  # ... while the caller destroys explicitly
    assert local.flush(timeout=10)
    assert count[0] == 300


def test_reaper_error_is_reported_not_fatal(capfd: pytest.CaptureFixture[str]) -> None:
    def bad() -> None:
        raise OSError("cannot close")

    done: list[int] = []
    o1, o2 = Obj(), Obj()
    cgc.register(o1, bad, comm=None, name="segment")
    cgc.register(o2, done.append, 1, comm=None)
    del o1, o2
    assert local.flush(timeout=10)
    assert done == [1]
    err = capfd.readouterr().err
    assert "rank-local destroy of key" in err and "'segment'" in err and "cannot close" in err


def test_local_registration_does_not_keep_object_alive() -> None:
    o = Obj()
    o.reg = cgc.register(o, print, comm=None)
    ref = weakref.ref(o)
    with GcDisabled():
        del o
        assert ref() is None


# Forking a process that has threads (MPI's, the reaper) is what this tests;
# Python 3.12+ warns of it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_never_runs_parent_destroys(tmp_path: object) -> None:
    r, w = os.pipe()
    o = Obj()
    marker = []
    reg = cgc.register(o, marker.append, "parent", comm=None)
    pid = os.fork()
    if pid == 0:  # the child: drop the object, flush, report what ran
        try:
            del o
            gc.collect()
            local.flush(timeout=5)
            os.write(w, repr(marker).encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    child_saw = os.read(r, 1000).decode()
    os.close(r)
    assert status == 0 and child_saw == "[]"
    assert reg.alive and marker == []
    del o
    assert local.flush(timeout=10)
    assert marker == ["parent"]
