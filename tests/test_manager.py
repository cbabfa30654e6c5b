"""The collective manager: keys, queueing, agreement, order, errors.

Each test runs on a fresh duplicate of COMM (the ``comm`` fixture); the same
tests run on COMM_SELF (serially and on every rank) and on COMM_WORLD under
``mpiexec -n 4``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _registration

from _util import WORLD, CheckedLog, GcDisabled, Obj, make_cycle, same_on_all


class ManagerTests:
    COMM: MPI.Intracomm

    def test_keys_agree_and_manager_is_unique(self, comm: MPI.Intracomm) -> None:
        objs = [Obj() for _ in range(5)]
        regs = [cgc.register(o, print, comm=comm) for o in objs]
        keys = [r.key for r in regs]
        assert keys == list(range(5))
        assert same_on_all(comm, keys)
        assert cgc.manager(comm) is cgc.manager(MPI.Intracomm(comm))
        assert cgc.manager(comm) is not cgc.manager(self.COMM)
        for r in regs:
            r.detach()

    def test_nothing_destroyed_before_sync(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        o = Obj()
        reg = cgc.register(o, log.destroy, 1, comm=comm)
        del o
        assert log.keys == []
        assert reg.state == "queued" and reg.alive
        assert [r.key for r in cgc.pending(comm)] == [0]
        stats = cgc.collect(comm)
        assert log.keys == [1]
        assert (stats.destroyed, stats.pending, stats.cyclic) == (1, 0, 0)
        assert reg.state == "destroyed" and not reg.alive

    def test_cyclic_finalization_only_queues(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with GcDisabled():
            regs = [make_cycle(comm, log, i) for i in range(10)]
            gc.collect()  # finalizes the cycles here, outside any sync point
            assert log.keys == []
            assert all(r.state == "queued" for r in regs)
            stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 10 and stats.cyclic == 10
        assert log.keys == list(range(9, -1, -1))  # newest first

    def test_newest_first_on_every_rank(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        objs = [Obj() for _ in range(50)]
        for i, o in enumerate(objs):
            cgc.register(o, log.destroy, i, comm=comm)
        del o
        # Drop in a different order on each rank.
        order = list(range(50))
        import random

        random.Random(comm.Get_rank()).shuffle(order)
        for i in order:
            objs[i] = None  # type: ignore[call-overload]
        cgc.collect(comm)
        assert log.keys == list(range(49, -1, -1))

    def test_partially_pending_keys_stay(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        rank, size = comm.Get_rank(), comm.Get_size()
        objs = {i: Obj() for i in range(size)}
        for i in range(size):
            cgc.register(objs[i], log.destroy, i, comm=comm)
        # Rank r drops objects 0..r: object i is dropped on every rank only if i == 0.
        for i in range(rank + 1):
            del objs[i]
        stats = cgc.collect(comm)
        assert log.keys == [0]
        assert stats.pending == rank
        # Now every rank drops the rest: all are destroyed, newest first.
        objs.clear()
        stats = cgc.collect(comm)
        assert log.keys == [0] + list(range(size - 1, 0, -1))
        assert stats.pending == 0

    def test_rank_with_nothing_pending(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        o = Obj()
        cgc.register(o, log.destroy, "late", comm=comm)
        if comm.Get_rank() != 0:
            del o
        stats = cgc.collect(comm)
        assert stats.destroyed == 0 and stats.pending == (comm.Get_rank() != 0)
        if comm.Get_rank() == 0:
            del o
        assert cgc.collect(comm).destroyed == 1 and log.keys == ["late"]

    def test_explicit_destroy_then_finalization_destroys_once(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        o = Obj()
        reg = cgc.register(o, log.destroy, "x", comm=comm)
        reg.destroy()
        reg.destroy()
        assert log.keys == ["x"] and not reg.alive
        del o
        assert cgc.collect(comm).destroyed == 0
        assert log.keys == ["x"]
        # Also when the object died first and the destroy is explicit afterwards.
        o = Obj()
        reg = cgc.register(o, log.destroy, "y", comm=comm)
        del o
        reg.destroy()
        assert cgc.collect(comm).destroyed == 0
        assert log.keys == ["x", "y"]

    def test_detach(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        o = Obj()
        reg = cgc.register(o, log.destroy, 1, comm=comm)
        assert reg.detach() and not reg.detach()
        del o
        assert cgc.collect(comm).destroyed == 0 and log.keys == []
        assert "detached" in repr(reg)

    def test_destroy_raising_on_one_rank(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        bad_rank = comm.Get_size() - 1

        def destroy(tag: int) -> None:
            log.destroy(tag)
            if tag == 1 and comm.Get_rank() == bad_rank:
                raise RuntimeError("boom")

        objs = [Obj() for _ in range(3)]
        for i, o in enumerate(objs):
            cgc.register(o, destroy, i, comm=comm, name=f"res{i}")
        del o
        objs.clear()
        assert cgc.collect(comm).destroyed == 3  # the failure is kept for the next collective
        assert log.keys == [2, 1, 0]  # every agreed destroy still ran
        with pytest.raises(cgc.DestroyError) as info:
            cgc.collect(comm)  # every rank raises it here, destroying nothing
        assert info.value.failures == [(bad_rank, 1, "res1", "RuntimeError: boom")]
        msg = str(info.value)
        assert f"rank {bad_rank}, key 1 ('res1')" in msg and "sync point 0" in msg
        assert "reported at sync point 1" in msg
        assert len(info.value.local) == (comm.Get_rank() == bad_rank)
        # The manager is still usable.
        assert cgc.collect(comm).destroyed == 0

    def test_reentrant_destroy_queues_for_next_sync(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        holder = {"inner": Obj()}
        cgc.register(holder["inner"], log.destroy, "inner", comm=comm)

        def destroy_outer(h: dict[str, Obj]) -> None:
            log.destroy("outer")
            h.clear()  # drops the last reference to a managed object
            with pytest.raises(cgc.CollectiveGCError, match="inside a destroy"):
                cgc.register(Obj(), print, comm=comm)
            with pytest.raises(cgc.CollectiveGCError, match="inside a destroy"):
                cgc.collect(comm)

        outer = Obj()
        cgc.register(outer, destroy_outer, holder, comm=comm)
        del holder, outer
        stats = cgc.collect(comm)
        assert log.keys == ["outer"] and stats.pending == 1
        stats = cgc.collect(comm)
        assert log.keys == ["outer", "inner"] and stats.pending == 0

    def test_finalization_on_another_thread(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        box = [Obj()]
        cgc.register(box[0], log.destroy, "t", comm=comm)
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()
        assert log.keys == []
        assert cgc.collect(comm).destroyed == 1 and log.keys == ["t"]

    def test_cyclic_gc_on_another_thread(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with GcDisabled():
            regs = [make_cycle(comm, log, i) for i in range(3)]
            t = threading.Thread(target=gc.collect)
            t.start()
            t.join()
            assert log.keys == [] and all(r.state == "queued" for r in regs)
            stats = cgc.collect(comm, generation=None)
        assert stats.cyclic == 3 and log.keys == [2, 1, 0]

    def test_registration_does_not_keep_object_alive(self, comm: MPI.Intracomm) -> None:
        o = Obj()
        o.reg = cgc.register(o, print, "unused", comm=comm)
        ref = weakref.ref(o)
        with GcDisabled():
            del o
            assert ref() is None  # freed by refcounting alone: no cycle through the registration
        cgc.manager(comm).pending()[0].detach()

    def test_self_reference_refused(self, comm: MPI.Intracomm) -> None:
        o = Obj()
        import functools

        for destroy, args in [
            (o.__init__, ()),
            (functools.partial(print, o), ()),
            (print, (o,)),
            (lambda: o, ()),
        ]:
            with pytest.raises(cgc.RegistrationError, match="itself"):
                cgc.register(o, destroy, *args, comm=comm)
        with pytest.raises(cgc.RegistrationError, match="keyword argument 'x'"):
            cgc.register(o, print, comm=comm, x=o)
        with pytest.raises(cgc.RegistrationError, match="callable"):
            cgc.register(o, 42, comm=comm)  # type: ignore[arg-type]
        with pytest.raises(cgc.RegistrationError, match="weakly referenced"):
            cgc.register(3, print, comm=comm)
        # Refusals consumed no key.
        assert cgc.manager(comm).next_key == 0

    def test_same_object_twice_refused(self, comm: MPI.Intracomm) -> None:
        o = Obj()
        reg = cgc.register(o, print, comm=comm)
        with pytest.raises(cgc.RegistrationError, match="already registered .* key 0"):
            cgc.register(o, print, comm=comm)
        reg.detach()
        cgc.register(o, print, comm=comm).detach()

    def test_repr_shows_state(self, comm: MPI.Intracomm) -> None:
        o = Obj()
        reg = cgc.register(o, print, comm=comm, name="ksp")
        text = repr(reg)
        assert "key=0" in text and "'ksp'" in text and "alive" in text
        assert f"size {comm.Get_size()}" in text
        assert "1 registered" in repr(cgc.manager(comm))
        reg.detach()

    def test_many_pending_both_agreement_methods(self, comm: MPI.Intracomm) -> None:
        # Dense keys use the bitmap; a stale old key on one rank plus sparse
        # keys force the sorted-array intersection.
        log: list[int] = []
        rank = comm.Get_rank()
        objs = [Obj() for _ in range(3000)]
        for i, o in enumerate(objs):
            cgc.register(o, log.append, i, comm=comm)
        del o
        keep = {i for i in range(3000) if (i + rank) % 7 == 0}
        objs = [o if i in keep else None for i, o in enumerate(objs)]  # type: ignore[misc]
        stats = cgc.collect(comm)
        if comm.Get_size() == 1:
            expected = [i for i in range(2999, -1, -1) if i not in keep]
        else:
            all_keep = set().union(*comm.allgather(keep))
            expected = [i for i in range(2999, -1, -1) if i not in all_keep]
        assert log == expected and stats.destroyed == len(expected)
        log.clear()
        # Sparse: keep every object except every 1000th.
        objs2 = [Obj() for _ in range(20000)]
        for i, o in enumerate(objs2):
            cgc.register(o, log.append, i, comm=comm)
        del o
        sparse = list(range(0, 20000, 1000))
        for i in sparse:
            objs2[i] = None  # type: ignore[call-overload]
        stats = cgc.collect(comm)
        assert log == sparse[::-1]
        # Detach what is left (alive here, or dropped here but kept on another
        # rank): it would be named in an ExitLeakWarning at exit.
        for r in cgc.manager(comm).alive() + cgc.pending(comm):
            r.detach()
        objs.clear()
        objs2.clear()


class TestManagerSelf(ManagerTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi(min_size=2)
class TestManagerWorld(ManagerTests):
    COMM = MPI.COMM_WORLD


def test_bad_communicators() -> None:
    with pytest.raises(TypeError, match="intracommunicator"):
        cgc.collect("world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="COMM_NULL"):
        cgc.collect(MPI.COMM_NULL)


def test_the_typed_state_is_the_extensions_here(speedups_c: Any) -> None:
    """Optional for users (the Python twins do the same), but this machine
    builds it, so the rest of the suite runs with the C types (and once more
    with the twins, in make test's pure-Python leg): every one of them is
    bound from the one decision."""
    from collective_gc import _interrupts, _registration, _state

    assert _state.FamilyState is speedups_c.FamilyState
    assert issubclass(_registration.Registration, speedups_c.RegistrationFields)
    assert type(_registration.GC) is speedups_c.GcState
    assert type(_interrupts.REGION) is speedups_c.Region


def test_finalizers_queue_note_cycles_and_skip_alike() -> None:
    """With the C finalizer, or the Python one in the pure-Python leg."""
    comm = MPI.COMM_SELF.Dup()
    try:
        log = CheckedLog(comm)
        with GcDisabled():
            # A refcount death queues; a cyclic-GC death queues and is noted.
            o = Obj()
            plain = cgc.register(o, log.destroy, "plain", comm=comm)
            cyc = make_cycle(comm, log, "cyc")
            del o
            gc.collect()
            assert plain.state == cyc.state == "queued"
            assert not plain.cyclic and cyc.cyclic
            # A cyclic-GC death on another thread is noted too.
            other = make_cycle(comm, log, "other")
            t = threading.Thread(target=gc.collect)
            t.start()
            t.join()
            assert other.cyclic
            # Destroyed or detached before the object dies: nothing queued.
            a, b = Obj(), Obj()
            ra = cgc.register(a, log.destroy, "a", comm=comm)
            rb = cgc.register(b, log.destroy, "b", comm=comm)
            ra.destroy()
            assert rb.detach()
            del a, b
            stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 3 and stats.cyclic == 2
        assert log.keys == ["a", "other", "cyc", "plain"]
        # Once shut down (or in a forked child) a finalizer does nothing at all.
        o = Obj()
        late = cgc.register(o, log.destroy, "late", comm=comm)
        _registration.set_shut_down(True)
        try:
            del o
        finally:
            _registration.set_shut_down(False)
        assert cgc.manager(comm).snapshot().pending == []
        assert late.detach()
    finally:
        comm.Free()


def test_destroys_that_raise_are_all_reported() -> None:
    comm = MPI.COMM_SELF.Dup()
    log: list[int] = []

    def destroy(i: int) -> None:
        log.append(i)
        if i % 3 == 0:
            raise ValueError(f"destroy {i} fails")

    try:
        with GcDisabled():
            objs = [Obj() for _ in range(8)]
            regs = [
                cgc.register(o, destroy, i, comm=comm, name=f"o{i}") for i, o in enumerate(objs)
            ]
            regs[4].destroy()  # destroyed explicitly first: skipped at the sync point
            del objs
            cgc.collect(comm, generation=None)
            with pytest.raises(cgc.DestroyError) as info:
                cgc.collect(comm, generation=None)
        assert log == [4, 7, 6, 5, 3, 2, 1, 0]
        assert [(k, n, m) for _, k, n, m in info.value.failures] == [
            (regs[i].key, f"o{i}", f"ValueError: destroy {i} fails") for i in (6, 3, 0)
        ]
        assert all(r.state == "destroyed" for r in regs)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_local_calls_on_one_rank_make_no_collective() -> None:
    """Issue 11, defect 10."""
    comm = WORLD.Dup()
    try:
        if comm.Get_rank() == 0:
            # With a collective hidden inside, any of these would hang here.
            assert cgc.pending(comm) == []
            assert cgc.current_scope(comm) is None
            cgc.collective_scope(comm)  # constructed, not entered
            assert cgc.pending(comm) == []
        comm.Barrier()
    finally:
        comm.Free()
