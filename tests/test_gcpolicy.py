"""The scopes' GC policy: freezing the long-lived heap at agreed full collections, and
giving the collector back as it was (_gcpolicy).

The agreed collections of a managed scope call ``collect(g, agreed=True)``; these
tests call it themselves inside real scopes (on COMM_SELF: the policy is per
process), so that they hold whichever way the scope reaches it.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _gcpolicy
from collective_gc._gcpolicy import POLICY

from _util import JOB_HEAD, CheckedLog, Obj, job_report, make_cycle, run_job


class Node:
    __slots__ = ("peer", "__weakref__")

    def __init__(self) -> None:
        self.peer: object = None


def heap(n: int) -> list[list[object]]:
    """n small containers, each in a cycle with the list that holds them."""
    cells: list[list[object]] = []
    for _ in range(n):
        cells.append([cells])
    return cells


def thawed() -> bool:
    """Whether the permanent generation holds nothing but what the collector
    itself put there (CPython 3.12's immortal objects; none elsewhere)."""
    return gc.get_freeze_count() <= POLICY.collector_frozen


@pytest.fixture
def policy() -> Iterator[None]:
    """A low freeze threshold; the test fails if it leaves anything frozen."""
    old = POLICY.freeze_min
    POLICY.freeze_min = 1_000
    try:
        yield
    finally:
        POLICY.freeze_min = old
        left = gc.get_freeze_count()
        if not thawed():
            gc.unfreeze()
        assert left <= POLICY.collector_frozen, "objects left frozen after the scopes closed"


@pytest.fixture
def self_comm() -> Iterator[MPI.Intracomm]:
    c = MPI.COMM_SELF.Dup()
    yield c
    cgc.collect(c)


def test_an_agreed_full_collection_freezes_the_heap_and_the_scope_exit_thaws_it(
    policy: None, self_comm: MPI.Intracomm
) -> None:
    cells = heap(5_000)
    probe = cells[-1]
    with cgc.collective_scope(self_comm):
        _gcpolicy.collect(2, agreed=True)
        assert gc.get_freeze_count() >= len(cells)
        # Later full collections do not walk the frozen heap: it is in no generation.
        assert not any(o is probe for o in gc.get_objects(2))
        _gcpolicy.collect(2, agreed=True)
        assert not any(o is probe for o in gc.get_objects(2))
    assert thawed()
    assert any(o is probe for o in gc.get_objects(2))  # back where a full collection sees it
    assert gc.isenabled()


def test_no_freeze_below_the_threshold_or_outside_a_managed_scope(
    policy: None, self_comm: MPI.Intracomm
) -> None:
    POLICY.freeze_min = 10**9
    with cgc.collective_scope(self_comm):
        _gcpolicy.collect(2, agreed=True)
        assert thawed()
    POLICY.freeze_min = 1_000
    _gcpolicy.collect(2, agreed=True)  # no scope open
    assert thawed()
    with cgc.collective_scope(self_comm, gc="auto"):
        _gcpolicy.collect(2, agreed=True)
        assert thawed()


def test_garbage_that_died_after_the_freeze_is_collected_and_destroyed_at_the_scope_exit(
    policy: None, self_comm: MPI.Intracomm
) -> None:
    log = CheckedLog(self_comm)
    cells = heap(5_000)
    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a cycle, alive when the heap is frozen
    dead = weakref.ref(a)
    with cgc.collective_scope(self_comm) as scope:
        make_cycle(self_comm, log, "frozen")  # garbage made before the freeze ...
        mine = Obj("managed")
        mine.peer = mine
        cgc.register(mine, log.destroy, "after", comm=self_comm)
        _gcpolicy.collect(2, agreed=True)  # ... collected by the full collection that freezes
        assert gc.get_freeze_count() > len(cells)
        del a, b, mine  # now cyclic garbage, but frozen
        _gcpolicy.collect(2, agreed=True)
        assert dead() is not None  # an agreed collection does not walk the frozen heap
        scope.sync()
        assert log.keys == ["frozen"]
    # The exit collection thawed first, found both, and the exit sync destroyed "after".
    assert dead() is None
    assert log.keys == ["frozen", "after"]
    assert thawed()


def test_the_collector_is_restored_when_the_body_raises(
    policy: None, self_comm: MPI.Intracomm
) -> None:
    heap_ = heap(5_000)
    for was in (True, False):
        (gc.enable if was else gc.disable)()
        try:
            with pytest.raises(KeyError):
                with cgc.collective_scope(self_comm):
                    _gcpolicy.collect(2, agreed=True)
                    assert gc.get_freeze_count() >= len(heap_)
                    raise KeyError("body")
            assert gc.isenabled() is was
            assert thawed()
        finally:
            gc.enable()


def test_a_freeze_made_by_the_user_is_left_alone(self_comm: MPI.Intracomm) -> None:
    old = POLICY.freeze_min
    POLICY.freeze_min = 1_000
    cells = heap(5_000)
    gc.collect()
    gc.freeze()  # the user's (a pre-fork server's, say)
    theirs = gc.get_freeze_count()

    def still_theirs() -> bool:
        # Frozen objects freed by refcounting leave the count; a freeze by the
        # policy would add the new heap, a thaw would empty it.
        return len(cells) <= gc.get_freeze_count() <= theirs

    try:
        with cgc.collective_scope(self_comm):
            more = heap(5_000)
            _gcpolicy.collect(2, agreed=True)
            assert still_theirs()  # the policy froze nothing
            _gcpolicy.collect(2)  # nor does the exit collection thaw theirs
            assert still_theirs()
        assert still_theirs()
        assert len(cells) == len(more)
    finally:
        POLICY.freeze_min = old
        gc.unfreeze()  # theirs (on 3.12 the collector's too: the next collection puts those back)


def test_scopes_on_two_threads_share_the_frozen_heap_until_the_last_one_closes(
    policy: None,
) -> None:
    # exit_collect=0: no exit collection to thaw the heap (a full one would, to
    # find everything), so what thaws it is the last managed scope closing.
    cells = heap(5_000)
    comms = [MPI.COMM_SELF.Dup() for _ in range(2)]
    step = threading.Barrier(2, timeout=60)
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def first() -> None:
        with cgc.collective_scope(comms[0], exit_collect=0):
            step.wait()  # both open
            _gcpolicy.collect(2, agreed=True)
            seen["frozen"] = gc.get_freeze_count()
            step.wait()  # frozen
        step.wait()  # first closed
        step.wait()  # second checked

    def second() -> None:
        with cgc.collective_scope(comms[1], exit_collect=0):
            step.wait()
            step.wait()
            step.wait()  # the first scope closed; this one is open
            seen["after first"] = gc.get_freeze_count()
            seen["enabled after first"] = gc.isenabled()
        step.wait()

    def run(fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            step.abort()

    threads = [threading.Thread(target=run, args=(f,)) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert isinstance(seen["frozen"], int) and seen["frozen"] >= len(cells)
    after = seen["after first"]
    assert isinstance(after, int) and after >= len(cells)  # still frozen: a scope is open
    assert seen["enabled after first"] is False
    assert thawed() and gc.isenabled()
    for c in comms:
        cgc.collect(c)


_FROZEN_GARBAGE_JOB = (
    JOB_HEAD
    + """
import gc

comm = MPI.COMM_WORLD


def destroyed(tag):
    print(f"destroy {tag} ran on rank {rank}", flush=True)


# A: dies in a cycle while the program has the collector off.
gc.disable()
a = Obj()
a.peer = a
cgc.register(a, destroyed, "A", comm=comm, name="A")
del a
# B: dies in a cycle inside a managed scope (the collector is off there), and
# the program freezes the heap before the scope ends.
with cgc.collective_scope(comm, exit_collect=None):
    b = Obj()
    b.peer = b
    cgc.register(b, destroyed, "B", comm=comm, name="B")
    del b
    gc.freeze()  # a pre-fork server's freeze: A and B with the rest
print(f"script end on rank {rank}", flush=True)
"""
)


@pytest.mark.launcher
def test_garbage_frozen_by_the_program_is_destroyed_at_exit(tmp_path: Path) -> None:
    """Issue 32, defect 6: managed cycles that died while the collector was
    off, then ``gc.freeze()``: frozen, the collector never finds them. Before:
    their destroys never ran and no ExitLeakWarning named them. Now the exit
    thaws the permanent generation before its collection, so the exit
    agreement finds and destroys them on every rank."""
    proc, outs, errs, took = run_job(tmp_path, _FROZEN_GARBAGE_JOB)
    report = job_report(proc, outs, errs)
    assert proc.returncode == 0, report
    for rank in range(4):
        assert f"script end on rank {rank}" in outs[rank], report
        for tag in "AB":
            assert f"destroy {tag} ran on rank {rank}" in outs[rank], report
        assert "ExitLeakWarning" not in errs[rank], report
