"""Registration: keys, the C constructor and its one-call path against Registry.add, names,
objects that cannot be weakly referenced, registrations from several threads.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import tracemalloc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.testing as cgc_testing
from collective_gc import _registration, _registry
from collective_gc import _state as _state_module

from _util import (
    TIMEOUT,
    WORLD,
    CheckedLog,
    GcDisabled,
    Obj,
    Tiny,
    everyone,
    noop,
)

# Where the C extension is blocked (COLLECTIVE_GC_PURE_PYTHON=1, make test's
# pure-Python leg); test_the_c_finalizer_is_built_here fails where it is not built.
needs_c = pytest.mark.skipif(
    _registration.SPEEDUPS is None,
    reason="the C extension is blocked (COLLECTIVE_GC_PURE_PYTHON=1) or not built",
)


def closure_over(x: object) -> Any:
    return lambda: x


def live_keys(comm: MPI.Comm) -> list[int]:
    return sorted(r.key for r in cgc.manager(comm).snapshot().alive)


def holding_a_key() -> bool:
    """Whether this thread is inside Registry.add (the Python path) with the
    key read and the next one not yet stored: the window a registration on
    another thread must not enter."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "add" and code.co_filename == _registry.__file__:
            return "key" in frame.f_locals
        frame = frame.f_back
    return False


class Holdup:
    """Hold one thread inside Registry.add between reading the key and storing
    the next one, in a collection an allocation there started, until
    released; other threads run meanwhile."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.inside = threading.Event()
        self.go = threading.Event()

    def register_held(self, comm: MPI.Intracomm, keep: list[Obj]) -> cgc.Registration:
        """On this thread: register a new object through Registry.add (a
        keyword argument keeps it off the C path), to be held there."""
        self.thread = threading.get_ident()
        o = Obj()
        keep.append(o)
        gc.set_threshold(1)  # the registration's allocation starts a collection
        return cgc.register(o, noop, comm=comm, tag="slow")

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if (
            phase == "start"
            and threading.get_ident() == self.thread
            and not self.inside.is_set()
            and holding_a_key()
        ):
            self.inside.set()
            self.go.wait(30)


@pytest.fixture
def holdup() -> Iterator[Holdup]:
    h = Holdup()
    saved = gc.get_threshold()
    gc.callbacks.append(h)
    try:
        yield h
    finally:
        h.go.set()
        gc.callbacks.remove(h)
        gc.set_threshold(*saved)


@needs_c
def test_the_c_path_gives_the_next_key_and_stores_the_registration(comm: MPI.Intracomm) -> None:
    """From the registration in one C call (``_speedups.add_plain``)."""
    mgr = cgc.manager(comm)
    first = cgc.register(Obj(), noop, comm=comm)  # makes the private duplicate on size > 1
    objs = [Obj() for _ in range(5)]
    regs = [cgc.register(o, noop, i, "x", comm=comm, name=f"n{i}") for i, o in enumerate(objs)]
    assert [r.key for r in regs] == list(range(first.key + 1, first.key + 6))
    assert mgr.next_key == first.key + 6
    assert [r.name for r in regs] == [f"n{i}" for i in range(5)]
    assert all(r.alive and r() is o for r, o in zip(regs, objs))
    # Made in C: the C finalizer, and no second registration for the same object.
    assert regs[0].__callback__ == _registration.GC.finalize
    with pytest.raises(cgc.RegistrationError, match="already registered"):
        cgc.register(objs[0], noop, comm=comm)
    del objs
    stats = cgc.collect(comm, generation=None, timeout=30)
    assert stats.destroyed == 6 and mgr.registered == 0


def test_what_the_c_path_leaves_to_registry_add(comm: MPI.Intracomm) -> None:
    """The same refusals and the same registrations whichever path is taken.

    From the registration in one C call (``_speedups.add_plain``).
    """
    mgr = cgc.manager(comm)
    o = Obj()
    # Another weak reference to the object: Registry.add registers it.
    other = weakref.ref(o)
    r1 = cgc.register(o, noop, comm=comm)
    assert r1.alive and other() is o and r1.key == mgr.next_key - 1
    p = Obj()
    for bad in (p, p.__init__, closure_over(p)):
        with pytest.raises(cgc.RegistrationError, match="refers to the registered"):
            cgc.register(p, noop, bad, comm=comm)
    del bad
    with pytest.raises(cgc.RegistrationError, match="refers to the registered"):
        cgc.register(p, closure_over(p), comm=comm)
    with pytest.raises(cgc.RegistrationError, match="weakly"):
        cgc.register(object(), noop, comm=comm)
    with pytest.raises(cgc.RegistrationError, match="callable"):
        cgc.register(p, 42, comm=comm)  # type: ignore[arg-type]
    # A callable argument that does not refer to the object, a closure
    # destroy: fine, through Registry.add.
    q = Obj()
    seen: list[Any] = []
    r2 = cgc.register(p, seen.append, noop, comm=comm)
    r3 = cgc.register(q, lambda: seen.append("q"), comm=comm)
    assert (r2.key, r3.key) == (r1.key + 1, r1.key + 2) and mgr.next_key == r1.key + 3
    del o, p, q
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 3
    assert seen == ["q", noop]  # newest first


def test_a_pure_python_process_registers_without_the_c_path(
    comm: MPI.Intracomm, pure_python: None
) -> None:
    """From the registration in one C call (``_speedups.add_plain``); the
    switch it tested is now COLLECTIVE_GC_PURE_PYTHON=1, read once at import."""
    o = Obj()
    reg = cgc.register(o, noop, comm=comm)
    assert reg.__callback__ == _registration.GC.finalize
    # The Python twins, not the C types: the state and the collector's.
    assert type(_registration.GC).__module__ == "collective_gc._state"
    assert type(cgc_testing.family(comm)) is cgc_testing.Family
    assert cgc_testing.speedups() == "python"
    del o
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 1


def test_the_c_state_checks_what_it_is_made_with(speedups_c: Any) -> None:
    """The C types hold their state in declared fields and take their
    collaborators when made (no set-up call, no slots of Python classes read
    by offset): what they are given is checked then, with a clear TypeError.

    From issue 38 (the C boundary); before it, a class that lacked a slot
    the C stored into made ``import collective_gc`` fail (issue 23)."""
    from collective_gc._syncpoint import CollectStats

    gc_state = _registration.GC
    with pytest.raises(TypeError, match="RegistrationFields"):
        speedups_c.FamilyState(0, 1, gc_state, Obj, CollectStats)
    with pytest.raises(TypeError):
        speedups_c.FamilyState(0, 1, object(), _registration.Registration, CollectStats)
    with pytest.raises(TypeError, match="RegistrationFields"):
        speedups_c.new_registration(Obj, noop, Obj(), None, print, 0, noop, (), None, None)
    state = speedups_c.FamilyState(0, 1, gc_state, _registration.Registration, CollectStats)
    with pytest.raises(TypeError, match="FamilyState"):
        state.set_children((object(),))
    # And the real ones work as ever.
    comm = MPI.COMM_SELF.Dup()
    try:
        o = Obj()
        reg = cgc.register(o, noop, comm=comm)
        assert reg.__callback__ == gc_state.finalize and reg.key == 0
        del o
        assert cgc.collect(comm, generation=None).destroyed == 1
    finally:
        cgc.manager(comm).close()
        comm.Free()


def test_a_registration_half_way_on_another_thread_is_not_overtaken(holdup: Holdup) -> None:
    """Any thread may register on COMM_SELF: a C-path registration that starts
    while another thread is inside Registry.add (held in a collection its
    allocation started, before it stored the next key) must wait for it, not
    take the same key.

    From the registration in one C call (``_speedups.add_plain``).
    """
    comm = MPI.COMM_SELF.Dup()
    try:
        mgr = cgc.manager(comm)
        start = mgr.next_key
        held: list[Any] = []
        others: list[Any] = []
        keep: list[Obj] = []

        def slow_one() -> None:
            held.append(holdup.register_held(comm, keep))

        def fast_ones() -> None:
            for _ in range(200):
                o = Obj()
                keep.append(o)
                others.append(cgc.register(o, noop, comm=comm))

        a = threading.Thread(target=slow_one)
        a.start()
        assert holdup.inside.wait(30), "the slow registration never got held"
        b = threading.Thread(target=fast_ones)
        b.start()
        b.join(0.5)  # it waits for the held registration's lock
        holdup.go.set()
        a.join(30)
        b.join(30)
        assert not a.is_alive() and not b.is_alive()
        keys = [r.key for r in held + others]
        assert len(keys) == 201 and len(set(keys)) == 201, keys
        assert sorted(keys) == list(range(start, start + 201))
        assert held[0].key == start  # it was held with its key read: the others came after
        assert mgr.next_key == start + 201
        assert live_keys(comm) == sorted(keys)
        del keep[:]
        assert cgc.collect(comm, generation=None, timeout=30).destroyed == 201
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_c_path_registration_during_a_held_one_is_refused_on_a_parallel_comm(
    comm: MPI.Intracomm, holdup: Holdup
) -> None:
    """On a communicator of size > 1 a second registering thread is refused:
    the C path must not slip past a registration held half-way through.

    From the registration in one C call (``_speedups.add_plain``).
    """
    mgr = cgc.manager(comm)
    cgc.register(Obj(), noop, comm=comm)  # the private duplicate exists
    cgc.collect(comm, generation=None, timeout=30)  # from now on any one thread may register
    start = mgr.next_key
    keep: list[Obj] = []
    outcome: list[str] = []

    def slow_one() -> None:
        holdup.register_held(comm, keep)

    def fast_one() -> None:
        o = Obj()
        keep.append(o)
        try:
            cgc.register(o, noop, comm=comm)
            outcome.append("ok")
        except cgc.RegistrationError as exc:
            outcome.append(
                "refused" if "'held-registrar' was registering" in str(exc) else str(exc)
            )

    a = threading.Thread(target=slow_one, name="held-registrar")
    a.start()
    held = holdup.inside.wait(30)
    if held:
        b = threading.Thread(target=fast_one)
        b.start()
        b.join(30)
    holdup.go.set()
    a.join(30)
    verdict = everyone(WORLD, (held, outcome, mgr.next_key - start))
    assert all(v == (True, ["refused"], 1) for v in verdict), verdict
    del keep[:]
    cgc.collect(comm, generation=None, timeout=30)


class Reregisters:
    """In a cycle; when the collector finalizes it, registers a new object."""

    made: list[cgc.Registration] = []
    comm: MPI.Intracomm | None = None

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        assert Reregisters.comm is not None
        Reregisters.made.append(cgc.register(KEEP.pop(), noop, comm=Reregisters.comm))


KEEP: list[Obj] = []


def test_a_finalizer_registering_during_the_first_registration_on_its_communicator() -> None:
    """The first registration on a communicator joins (or makes) its family,
    which runs much Python code; a collection there whose finalizers register
    on that communicator must not join a second family: every key once, every
    registration in the one family. Where the collection falls depends on
    the allocations the first registration makes, which differ between
    Python versions, so it is made to fall after each of its first 150.

    Found by the Python 3.12 stack leg (3.12 runs a collection due when a
    Python function starts): two registrations got key 0, one of them in a
    family the manager then forgot.
    """
    saved = gc.get_threshold()
    for allocations in range(1, 150):
        comm = MPI.COMM_SELF.Dup()
        try:
            mgr = cgc.manager(comm)  # (local: the first registration joins the family)
            Reregisters.comm, Reregisters.made = comm, []
            KEEP[:] = [Obj() for _ in range(5)]
            o = Obj()
            gc.collect()
            for _ in range(5):
                Reregisters()  # garbage in a cycle, left to the next collection
            gc.set_threshold(allocations)
            first = cgc.register(o, noop, comm=comm)
            gc.set_threshold(*saved)
            gc.collect()
            made = Reregisters.made
            regs = [first, *made]
            keys = sorted(r.key for r in regs)
            assert keys == list(range(mgr.next_key - len(regs), mgr.next_key)), (allocations, keys)
            assert [r.key for r in mgr.snapshot().alive] == [first.key], allocations
            queued = {r.key: r for r in mgr.pending()}  # made's objects died at once
            assert all(queued.get(r.key) is r for r in made), allocations
            del o
            assert cgc.collect(comm, generation=None).destroyed == len(regs), allocations
        finally:
            gc.set_threshold(*saved)
            Reregisters.comm, Reregisters.made = None, []
            KEEP.clear()
            cgc.collect(comm, generation=None, timeout=30)
            comm.Free()


def test_a_finalizer_registering_inside_the_c_paths_collection() -> None:
    """The C path's allocation may start the collector, whose finalizers may
    register on the same communicator on this very thread: every key once.

    From the registration in one C call (``_speedups.add_plain``).
    """
    comm = MPI.COMM_SELF.Dup()
    saved = gc.get_threshold()
    try:
        mgr = cgc.manager(comm)
        start = mgr.next_key
        Reregisters.comm, Reregisters.made = comm, []
        KEEP[:] = [Obj() for _ in range(300)]
        objs, regs = [], []
        gc.collect()
        gc.set_threshold(5)
        for _ in range(300):
            Reregisters()  # garbage in a cycle: finalized by some later collection
            o = Obj()
            objs.append(o)
            regs.append(cgc.register(o, noop, comm=comm))
        gc.set_threshold(*saved)
        gc.collect()
        made = Reregisters.made
        assert made, "no finalizer registered anything: the test tested nothing"
        keys = [r.key for r in regs + made]
        assert len(set(keys)) == len(keys) == mgr.next_key - start, keys
        assert sorted(keys) == list(range(start, mgr.next_key))
        snap = {r.key: r for r in mgr.snapshot().alive}
        assert all(snap.get(r.key) is r for r in regs), "a registration is not stored"
    finally:
        gc.set_threshold(*saved)
        Reregisters.comm = None
        KEEP.clear()
        objs = regs = []
        cgc.collect(comm, generation=None, timeout=30)
        comm.Free()


@needs_c
def test_drained_keys_come_out_sorted_whatever_order_they_died_in() -> None:
    """On a communicator of size 1 the drained keys are the agreed ones: any
    order but newest first would show in the destroys.

    From the registration in one C call (``_speedups.add_plain``).
    """
    import random

    comm = MPI.COMM_SELF.Dup()
    try:
        for order in ("forward", "backward", "shuffled"):
            objs: list[Obj | None] = [Obj() for _ in range(300)]
            done: list[int] = []
            regs = [cgc.register(o, done.append, i, comm=comm) for i, o in enumerate(objs)]
            if order == "forward":
                for i in range(len(objs)):
                    objs[i] = None
            elif order == "backward":
                objs.clear()  # a list frees its items from the end
            else:
                for i in random.Random(5).sample(range(len(objs)), len(objs)):
                    objs[i] = None
            assert cgc.collect(comm, generation=None, timeout=30).destroyed == 300
            assert done == list(range(299, -1, -1)), order
            assert not any(r.alive for r in regs)
    finally:
        comm.Free()


def test_a_registration_stored_while_a_sync_point_empties_the_registry_is_kept() -> None:
    """A sync point that destroys the last registrations may give the
    registry's memory back; a registration another thread stores just then
    (here: while the sync point's destroy runs, after its keys were taken)
    must not be wiped.

    From the registration in one C call (``_speedups.add_plain``).
    """
    comm = MPI.COMM_SELF.Dup()
    try:
        cgc.manager(comm)
        done: list[str] = []
        late: list[Any] = []
        registered = threading.Event()

        def register_late() -> None:
            p = Obj()
            late.append(p)
            late.append(cgc.register(p, done.append, "late", comm=comm))
            registered.set()

        def first(tag: str) -> None:
            done.append(tag)
            threading.Thread(target=register_late).start()
            assert registered.wait(30)

        o = Obj()
        cgc.register(o, first, "first", comm=comm)
        del o
        assert cgc.collect(comm, generation=None, timeout=30).destroyed == 1
        assert done == ["first"], done
        reg = late[1]
        assert reg.alive and cgc.manager(comm).registered == 1
        late.clear()
        del reg
        assert cgc.collect(comm, generation=None, timeout=30).destroyed == 1
        assert done == ["first", "late"]
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_two_threads_registering_plain_destroys_at_once_are_refused(
    comm: MPI.Intracomm,
) -> None:
    """Issue 25, defect 3: an I/O thread and the main thread register
    plain-function destroys (the C path) at the same time on every rank. Their
    calls never overlap, so nothing was refused, and about 6,000 keys named
    different objects on different ranks. Now the thread that is second to
    register since the last sync point gets a RegistrationError naming both.

    From the registration in one C call (``_speedups.add_plain``).
    """
    mgr = cgc.manager(comm)
    cgc.register(Obj(), noop, comm=comm)  # the private duplicate exists
    cgc.collect(comm, generation=None, timeout=30)
    keep: list[Obj] = []
    regs: list[cgc.Registration] = []
    refusals: list[tuple[str, str]] = []
    start = threading.Barrier(2)

    def register_many() -> None:
        start.wait(30)
        for _ in range(20_000):
            o = Obj()
            keep.append(o)
            try:
                regs.append(cgc.register(o, noop, comm=comm))
            except cgc.RegistrationError as exc:
                refusals.append((threading.current_thread().name, str(exc)))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the two threads interleave many times
    try:
        io = threading.Thread(target=register_many, name="io-thread")
        io.start()
        register_many()
        io.join(60)
    finally:
        sys.setswitchinterval(interval)
    named = [
        "'io-thread'" in text and "'MainThread'" in text and "was registering" in text
        for _, text in refusals
    ]
    verdict = everyone(WORLD, (len(refusals), named))
    # Each rank refused one thread (which one may differ), naming both.
    assert all(v == (1, [True]) for v in verdict), (verdict, refusals[:1])
    # The ranks' registrations now differ: forget them here, no sync point.
    for reg in regs:
        reg.detach()
    del keep[:]
    assert mgr.registered == 0


def test_a_registration_is_made_with_its_fields() -> None:
    """The constructor both twins bind (one C call where the extension is
    built): key, names, origin, state, and the finalizer that pushes it.
    From the core v2 redesign (issue 14)."""
    from collective_gc import _state

    inbox: list[object] = []
    o = Obj()
    fin = _registration.GC.finalize
    reg = _state.new_registration(
        _registration.Registration, fin, o, None, inbox.append, 7, noop, (1,), None, None
    )
    named = _state.new_registration(
        _registration.Registration, fin, o, None, inbox.append, 8, noop, (), "n", None
    )
    seen = (reg.key, reg.name, reg.typename, reg.origin, reg.cyclic, reg.queued_at, reg.alive)
    assert seen == (7, "Obj", "Obj", None, False, -1, True)
    assert named.name == "n" and reg() is o and reg._args == (1,)
    del o
    assert {id(r) for r in inbox} == {id(reg), id(named)}  # the finalizer pushed both
    with pytest.raises(TypeError):
        _state.new_registration(
            _registration.Registration, fin, 3, None, print, 0, noop, (), None, None
        )

    class MakesNone(_registration.Registration):
        """A subclass whose __new__ makes no registration: nothing is written into what
        it made (the C twin wrote the fields into it)."""

        __slots__ = ()

        def __new__(cls, *args: Any) -> Any:
            return None

    with pytest.raises(TypeError):
        _state.new_registration(MakesNone, fin, Obj(), None, print, 0, noop, (), None, None)


# Every field of a registration: the public ones and the private ones its
# owner's state keeps (the C twin has the same names: tests/test_layout.py).
_FIELDS = _state_module.PythonRegistrationFields.__slots__


def test_a_registrations_fields_are_read_only(comm: MPI.Intracomm) -> None:
    """A write or a delete of any field of a registration is refused, and its
    destroy still runs once, at the sync point. From a review of the C
    registration (issue 38): written from Python, a C registration's ``_args``
    that is not a tuple crashed the process at its destroy, ``_destroy = None``
    made the destroy pass skip a live registration (its destroy lost), and a
    deleted ``name`` dropped its row from a failure's report."""
    log = CheckedLog(comm)
    o = Obj()
    reg = cgc.register(o, log.destroy, "only", comm=comm, name="o")
    before = [getattr(reg, f) for f in _FIELDS]
    refused = []
    for field in _FIELDS:
        for value in (5, None, "x", (1, 2)):
            try:
                setattr(reg, field, value)
            except AttributeError:
                refused.append(field)
        try:
            delattr(reg, field)
        except AttributeError:
            refused.append(field)
    assert refused == [f for f in _FIELDS for _ in range(5)]
    assert [getattr(reg, f) for f in _FIELDS] == before
    del o
    (queued,) = cgc.pending(comm)  # the library's own write of queued_at
    assert queued is reg and reg.queued_at >= 0 and reg.state == "queued"
    assert cgc.collect(comm, generation=None, timeout=TIMEOUT).destroyed == 1
    assert log.keys == ["only"] and reg.state == "destroyed"


def test_a_registration_refused_inside_a_destroy_keeps_keys_in_step(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    rank = comm.Get_rank()
    made: list[str] = []

    def destroy(tag: str) -> None:
        # Refused on every rank: the key counter must not move anywhere.
        cgc.register(Obj(), noop, comm=comm)
        made.append(tag)

    mgr = cgc.manager(comm)
    with GcDisabled():
        objs = [Obj() for _ in range(500)]
        for i, o in enumerate(objs):
            cgc.register(o, destroy if i == 7 else noop, str(i), comm=comm)
        del objs, o
        before = mgr.next_key
        cgc.collect(comm, generation=None, timeout=60)  # the refusals are kept, then reported:
        with pytest.raises(cgc.DestroyError, match="from inside a destroy") as info:
            cgc.collect(comm, generation=None, timeout=60)
        assert {r for r, *_ in info.value.failures} == set(range(comm.Get_size()))
        assert mgr.next_key == before and made == []
        assert everyone(comm, (mgr.next_key, mgr.sync_count)) == [(before, 2)] * comm.Get_size()
        # The window moved alike on every rank: the next sync points agree.
        for _ in range(3):
            batch = [Obj() for _ in range(700)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            assert cgc.collect(comm, generation=None, timeout=60).destroyed == 700
    assert mgr.broken is None, rank


class _Slotted(Obj):
    __slots__ = ("extra",)


class _NoWeak:
    __slots__ = ("a",)


class _NoWeakSub(_NoWeak):
    __slots__ = ("b",)


class _WeakSlots:
    __slots__ = ("a", "__weakref__")


def test_objects_that_cannot_be_weakly_referenced_take_no_key() -> None:
    """Found by the hostile tests of core v2 (issue 14). C or Python: as the
    process decided (make test runs both)."""
    comm = MPI.COMM_SELF.Dup()
    try:
        mgr = cgc.manager(comm)
        for bad in (3, (1, 2), [1], _NoWeak(), _NoWeakSub(), "s"):
            with pytest.raises(cgc.RegistrationError, match="weakly referenced"):
                cgc.register(bad, noop, comm=comm)
        assert mgr.next_key == 0 and mgr.registered == 0
        ok = _WeakSlots()
        reg = cgc.register(ok, noop, comm=comm)
        sub = _Slotted()
        reg2 = cgc.register(sub, noop, comm=comm)
        assert (reg.key, reg.typename, reg2.key, reg2.typename) == (0, "_WeakSlots", 1, "_Slotted")
        del ok, sub
        assert cgc.collect(comm, generation=None).destroyed == 2
    finally:
        cgc.manager(comm).close()
        comm.Free()


def test_the_c_constructor_keeps_no_reference_it_does_not_own(speedups_c: Any) -> None:
    """Refcounts of everything new_registration stores go back to where they were.

    Found by the hostile tests of core v2 (issue 14).
    """
    assert _registration.SPEEDUPS is not None
    comm = MPI.COMM_SELF.Dup()
    try:

        class Named:  # a heap type: PyType_GetName gives a new reference to its name
            pass

        def destroy(*args: Any) -> None:
            pass

        args = (object(), object())
        name = "".join(["a", "name", str(os.getpid())])  # not interned
        counts = lambda: (  # noqa: E731
            sys.getrefcount(destroy),
            sys.getrefcount(args),
            sys.getrefcount(name),
            sys.getrefcount(Named.__name__),
            sys.getrefcount(Named),
        )
        cgc.collect(comm, generation=None)
        before = counts()
        for _ in range(3):
            objs = [Named() for _ in range(1000)]
            regs = [cgc.register(o, destroy, *args, comm=comm, name=name) for o in objs]
            regs += [cgc.register(Obj(), destroy, *args, comm=comm) for _ in range(10)]
            del objs
            assert cgc.collect(comm, generation=None).destroyed == 1010
            del regs
        gc.collect()
        assert counts() == before
    finally:
        cgc.manager(comm).close()
        comm.Free()


def test_a_million_registrations_do_not_grow_memory() -> None:
    """Found by the hostile tests of core v2 (issue 14). C or Python: as the
    process decided (make test runs both)."""
    comm = MPI.COMM_SELF.Dup()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    try:
        mgr = cgc.manager(comm)
        chunk = 100_000

        def rounds(n: int) -> None:
            for _ in range(n):
                for _ in range(chunk):
                    o = Tiny()
                    mgr.register(o, noop, (), {}, None)
                o = None
                assert cgc.collect(comm, generation=None).destroyed == chunk

        with GcDisabled():
            rounds(2)  # warm up: the dicts and arrays at their working size
            r0 = rss()
            rounds(5)
            rgrown = rss() - r0
            tracemalloc.start()
            # One round traced before the base: the registry's dict table,
            # refilled from empty, may be reallocated once at its working size
            # (5 MiB, seen on the Python passes), which is no growth.
            rounds(1)
            base = tracemalloc.get_traced_memory()[0]
            rounds(2)
            grown = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
        assert mgr.next_key == 10 * chunk and mgr.registered == 0
        assert grown < 2_000_000, grown
        assert rgrown < 32_000_000, rgrown
    finally:
        cgc.manager(comm).close()
        comm.Free()


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
    """Found by a hostile review of the promise (reproducer h1)."""

    COMM = MPI.COMM_SELF

    def test_a_name_that_is_not_a_str_is_refused_before_anything_is_registered(
        self, comm: MPI.Intracomm
    ) -> None:
        _refuses_names_that_are_not_str(comm)


@pytest.mark.mpi(min_size=2)
def test_a_name_that_is_not_a_str_is_refused_at_a_first_registration(
    comm: MPI.Intracomm,
) -> None:
    """Found by a hostile review of the promise (reproducer h1)."""
    # On a larger communicator the first registration makes the private
    # duplicate (a collective): refused before it, alike on every rank.
    _refuses_names_that_are_not_str(comm)
