"""keep: collective resources without a destroy call, held until their owner
has died on every rank and dropped at the agreed sync point.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import GcDisabled, everyone


class Collective:
    """A resource whose destructor is a collective (as an XDMFFile's HDF5
    close): a barrier on its communicator, and a log of the order."""

    def __init__(self, comm: MPI.Intracomm, name: str, log: list[str]) -> None:
        self.comm, self.name, self.log = comm, name, log

    def __del__(self) -> None:
        self.log.append(self.name)
        self.comm.Barrier()  # what the C++ destructor does: a collective, here


class Logged:
    """A resource that notes when its destructor runs (a local one)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def __del__(self) -> None:
        self.log.append(self.name)


class Owner:
    """A plain owner; tests put it in cycles."""


@pytest.mark.mpi(min_size=2)
def test_keep_drops_collective_resources_at_the_sync_point(comm: MPI.Intracomm) -> None:
    """Issue 22, item 3: an XDMFFile-like resource (collective destructor) in
    a step that dies in a cycle. Under plain GC the ranks run the destructor
    at different moments (the loop hung at step 2-3); with cgc.keep the last
    references are dropped at the sync point, on every rank, last first."""
    lib = comm.Dup()  # the resources' own communicator, not ours to sync
    log: list[str] = []
    with cgc.collective_scope(comm, timeout=60) as scope:
        for i in range(3):
            step: Any = Owner()
            step.me = step
            step.file = Collective(lib, f"file{i}", log)
            step.mesh = Collective(lib, f"mesh{i}", log)
            cgc.keep(step, step.mesh, step.file, comm=comm)
            del step
            if comm.Get_rank() == 0:
                gc.collect()  # one rank alone: with keep, nothing collective runs here
            assert log == [f"{n}{j}" for j in range(i) for n in ("file", "mesh")]
            gc.collect()
            scope.sync()
        assert log == [f"{n}{j}" for j in range(3) for n in ("file", "mesh")]
    lib.Free()


# -- an owner that lives again --------------------------------------------------


class Phoenix:
    """An owner whose ``__del__`` stores it in ``rescued``: it lives again.

    CPython's collector clears the weak references to what it found
    unreachable, and calls their callbacks, before it runs ``__del__``.
    """

    rescued: list[Phoenix] = []

    def __init__(self, rise: bool) -> None:
        self.rise = rise
        self.me = self  # a cycle: only the cyclic collector frees it

    def __del__(self) -> None:
        if self.rise:
            self.rise = False  # once: CPython runs __del__ once per object anyway
            Phoenix.rescued.append(self)


def test_a_resurrected_owners_resources_wait_for_its_real_death(comm: MPI.Intracomm) -> None:
    """Issue 32, item 2: an owner in a cycle whose ``__del__`` resurrects it.
    Its kept resource was dropped at the next sync point although the owner
    lived again (the registration's weak reference is cleared, and queued,
    before ``__del__`` runs). It must stay until the owner really dies: then
    it is dropped at the next sync point, on every rank."""
    log: list[str] = []
    with GcDisabled(), cgc.collective_scope(comm, timeout=60) as scope:
        owner = Phoenix(rise=True)
        reg = cgc.keep(owner, Logged("file", log), comm=comm)
        del owner
        gc.collect()
        assert len(Phoenix.rescued) == 1
        scope.sync()
        scope.sync()
        dropped_while_alive = list(log)
        alive = reg.alive
        Phoenix.rescued.clear()  # its real death (in a cycle: the collector)
        gc.collect()
        scope.sync()
        dropped_after = list(log)
    assert (
        everyone(comm, (dropped_while_alive, alive, dropped_after))
        == [([], True, ["file"])] * comm.Get_size()
    )


@pytest.mark.mpi(min_size=2)
def test_an_owner_resurrected_on_one_rank_keeps_every_ranks_resources(
    comm: MPI.Intracomm,
) -> None:
    """Issue 32, item 2, with the resurrection on rank 0 only: the others'
    owners die for good, rank 0's lives again. Nothing is dropped anywhere
    (the destructors are collective: dropping on some ranks only would hang)
    until rank 0's owner really dies; then every rank drops at the same sync
    point."""
    log: list[str] = []
    rank = comm.Get_rank()
    with GcDisabled(), cgc.collective_scope(comm, timeout=60) as scope:
        owner = Phoenix(rise=rank == 0)
        cgc.keep(owner, Logged("file", log), comm=comm)
        del owner
        gc.collect()
        for _ in range(3):
            scope.sync()
        before = list(log)
        Phoenix.rescued.clear()
        gc.collect()
        scope.sync()
        after = list(log)
    assert everyone(comm, (before, after)) == [([], ["file"])] * comm.Get_size()


def test_a_kept_owner_that_dies_in_a_cycle_is_seen_by_strict_mode(comm: MPI.Intracomm) -> None:
    """Strict mode names a kept owner that the cyclic collector freed, as it
    names a registered one, on every rank; its resources are dropped all the
    same."""
    log: list[str] = []
    with GcDisabled():
        with pytest.raises(cgc.CyclicFinalizationError) as info:
            with cgc.collective_scope(comm, strict=True, timeout=60) as scope:
                owner: Any = Owner()
                owner.me = owner
                cgc.keep(owner, Logged("file", log), comm=comm, name="stepfile")
                del owner
                gc.collect()
                scope.sync()
    assert "stepfile" in str(info.value)
    assert log == ["file"]


# -- what keep refuses ------------------------------------------------------------


def _refers_to_owner(owner: Any) -> list[tuple[str, object]]:
    def close() -> None:
        owner.close()

    return [
        ("the owner itself", owner),
        ("a bound method of it", owner.method),
        ("a partial over it", functools.partial(print, owner)),
        ("a closure over it", close),
    ]


class Method:
    """An owner with a method, for the resources that are bound methods of it."""

    def method(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_keep_refuses_a_resource_that_refers_to_the_owner(comm: MPI.Intracomm) -> None:
    """Issue 32, item 3: ``keep(owner, owner)`` was accepted, and the owner
    could then never die, silently. As register refuses a destroy that refers
    to its object, keep refuses the owner, a bound method of it, a partial or
    a closure over it among the resources, before anything is registered."""
    owner = Method()
    before = cgc.manager(comm).registered
    for what, resource in _refers_to_owner(owner):
        with pytest.raises(cgc.RegistrationError, match="refers to the owner") as info:
            cgc.keep(owner, Logged("ok", []), resource, comm=comm)
        assert "resource 1" in str(info.value), what
    assert cgc.manager(comm).registered == before


class Slotted:
    """An owner with no ``__dict__``."""

    __slots__ = ("__weakref__",)


def test_keep_refuses_an_owner_without_a_dict(comm: MPI.Intracomm) -> None:
    """keep marks its owner (see the next tests): an owner that cannot hold an
    attribute is refused, with what to do instead, before anything is
    registered."""
    before = cgc.manager(comm).registered
    with pytest.raises(cgc.RegistrationError, match="__dict__"):
        cgc.keep(Slotted(), Logged("ok", []), comm=comm)
    assert cgc.manager(comm).registered == before


def test_two_keeps_on_one_owner_are_both_dropped_newest_first(comm: MPI.Intracomm) -> None:
    """One owner may keep resources twice on one communicator (a library's
    keep and the user's): each is its own registration, both dropped at the
    sync point after the owner died, the newest first."""
    log: list[str] = []
    with cgc.collective_scope(comm, timeout=60) as scope:
        owner: Any = Owner()
        cgc.keep(owner, Logged("first", log), comm=comm)
        cgc.keep(owner, Logged("second", log), comm=comm)
        scope.sync()
        assert log == []
        del owner
        scope.sync()
    assert log == ["second", "first"]


# -- destructors that report errors only as "Exception ignored" -------------------


class Faulty:
    """A resource whose destructor fails on some ranks, as h5py's does when
    HDF5 refuses to close a file: Python can only print it ("Exception
    ignored in ...", through ``sys.unraisablehook``)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __del__(self) -> None:
        if self.fail:
            raise RuntimeError("can't close file, there are objects still open")


def test_a_destructor_error_only_printed_fails_the_destroy_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Issue 33: ``keep(self, dset, f)`` reported 200 destroyed and no error
    while h5py printed "Exception ignored in ObjectID.__dealloc__" and left
    every file unreadable. What a destructor reports only through
    ``sys.unraisablehook`` while the kept resources are dropped is now a
    failure of that destroy: DestroyError on every rank, naming rank 0's
    error. The hook in place before is back after."""
    before = sys.unraisablehook
    rank = comm.Get_rank()
    with cgc.collective_scope(comm, timeout=60) as scope:
        owner: Any = Owner()
        cgc.keep(owner, Faulty(fail=rank == 0), comm=comm, name="stepfile")
        del owner
        scope.sync()  # the drop fails on rank 0: the family's next collective says so
        with pytest.raises(cgc.DestroyError) as info:
            scope.sync()
    err = info.value
    assert [(r, n) for r, _, n, _ in err.failures] == [(0, "stepfile")]
    assert "objects still open" in err.failures[0][3]
    assert "Exception ignored" in err.failures[0][3]
    assert sys.unraisablehook is before


def test_an_unraisable_on_another_thread_is_not_taken(comm: MPI.Intracomm) -> None:
    """While one thread drops kept resources, an error another thread's
    destructor reports goes where it always went (here: the hook the test
    installed), not into the drop; the drop itself is clean."""
    seen: list[str] = []
    other_done = threading.Event()

    def elsewhere() -> None:
        Faulty(fail=True)  # dies at once, on this thread: unraisable here
        other_done.set()

    class Waits:
        def __del__(self) -> None:
            t = threading.Thread(target=elsewhere)
            t.start()
            t.join(30)  # the other thread's error happens during this drop

    def hook(args: Any) -> None:
        seen.append(str(args.exc_value))

    before = sys.unraisablehook
    sys.unraisablehook = hook
    try:
        with cgc.collective_scope(comm, timeout=60) as scope:
            owner: Any = Owner()
            cgc.keep(owner, Waits(), comm=comm)
            del owner
            scope.sync()  # no DestroyError
        assert other_done.is_set()
        assert seen == ["can't close file, there are objects still open"]
        assert sys.unraisablehook is hook
    finally:
        sys.unraisablehook = before
