"""The shape of core v2 (issue 14): the key window and its fallback, participants,
snapshot and close, collect(obj). On COMM_SELF and on every rank of COMM_WORLD."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import CheckedLog, Obj


def noop(*args: Any) -> None:
    pass


class CoreTests:
    COMM: MPI.Intracomm

    # -- the window and its fallback ----------------------------------------

    def test_keys_older_than_the_window_are_still_agreed(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        old = [Obj(i) for i in range(10)]
        for i, o in enumerate(old):
            cgc.register(o, log.destroy, ("old", i), comm=comm)
        # Many sync points with registrations move the window far past keys 0..9.
        for _ in range(12):
            batch = [Obj() for _ in range(300)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            assert cgc.collect(comm, generation=None).destroyed == 300
        del old
        stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 10 and stats.pending == 0
        assert log.keys == [("old", i) for i in reversed(range(10))]

    def test_a_burst_larger_than_the_window_is_agreed_in_one_sync_point(
        self, comm: MPI.Intracomm
    ) -> None:
        cgc.collect(comm, generation=None)
        objs = [Obj() for _ in range(5000)]
        regs = [cgc.register(o, noop, comm=comm) for o in objs]
        del objs
        assert cgc.collect(comm, generation=None).destroyed == 5000
        assert not any(r.alive for r in regs)

    def test_old_keys_pending_on_some_ranks_only_stay_pending(self, comm: MPI.Intracomm) -> None:
        rank = comm.Get_rank()
        keep = [Obj(i) for i in range(20)]
        regs = [cgc.register(o, noop, comm=comm) for o in keep]
        for _ in range(10):
            batch = [Obj() for _ in range(200)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            cgc.collect(comm, generation=None)
        # Every rank but the last drops the even ones; the last rank drops them
        # only after one more sync point: the other ranks hold them pending.
        last = comm.Get_size() - 1
        if rank != last or comm.Get_size() == 1:
            del keep[::2]
        cgc.collect(comm, generation=None)
        if comm.Get_size() > 1:
            assert all(r.alive for r in regs)
            if rank != last:
                assert [r.key for r in cgc.pending(comm)] == [r.key for r in regs[::2]]
            del keep[::2]
        cgc.collect(comm, generation=None)
        assert [r.alive for r in regs] == [i % 2 == 1 for i in range(20)]
        del keep
        assert cgc.collect(comm, generation=None).destroyed == 10

    # -- participants -----------------------------------------------------------

    def test_a_participant_votes_and_sees_the_or_on_every_rank(self, comm: MPI.Intracomm) -> None:
        seen: list[int] = []

        class Max(cgc.Participant):
            field = 3

            def vote(self, mgr: cgc.Manager) -> int:
                # a thermometer code of (rank % 4): the OR is the code of the max
                return (1 << (mgr.rank % 4)) - 1

            def finish(self, mgr: cgc.Manager, flags: int) -> None:
                seen.append(self.votes(flags))

        mgr = cgc.manager(comm)
        mgr.add_participant(Max())
        cgc.collect(comm, generation=None)
        top = (1 << min(comm.Get_size() - 1, 3)) - 1
        assert seen == [top]
        assert all(v == seen for v in comm.allgather(seen))

    def test_two_participants_in_one_field_are_refused(self, comm: MPI.Intracomm) -> None:
        class P(cgc.Participant):
            field = 4

        mgr = cgc.manager(comm)
        mgr.add_participant(P())
        with pytest.raises(cgc.CollectiveGCError, match="field 4"):
            mgr.add_participant(P())

    # -- snapshot and close ------------------------------------------------------

    def test_snapshot_changes_nothing(self, comm: MPI.Intracomm) -> None:
        with cgc.collective_scope(comm, strict=True, gc="off", exit_collect=None) as scope:
            a, b = Obj(), Obj()
            a.peer, b.peer = b, a
            reg = cgc.register(a, noop, comm=comm)
            alive = Obj()
            cgc.register(alive, noop, comm=comm)
            del a, b
            gc.collect()
            snap = cgc.manager(comm).snapshot()
            assert snap == cgc.manager(comm).snapshot()
            assert [r.key for r in snap.cyclic] == [reg.key]
            assert [r.key for r in snap.pending] == [reg.key]
            assert reg.key not in [r.key for r in snap.alive]
            assert snap.broken is None
            # The snapshot did not drain: strict mode still sees the cyclic death.
            with pytest.raises(cgc.CyclicFinalizationError):
                scope.sync()

    def test_close_runs_a_last_sync_point_then_refuses(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        dead = Obj()
        cgc.register(dead, log.destroy, "dead", comm=comm)
        alive = Obj()
        reg = cgc.register(alive, log.destroy, "alive", comm=comm)
        del dead
        mgr = cgc.manager(comm)
        with pytest.warns(cgc.ExitLeakWarning, match="1 registration"):
            mgr.close()
        assert log.keys == ["dead"]
        assert reg.state == "detached"
        assert mgr not in cgc.managers()
        with pytest.raises(cgc.CollectiveGCError, match="closed"):
            cgc.register(Obj(), noop, comm=comm)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.close()  # a second close does nothing

    # -- collect(obj) ------------------------------------------------------------------

    def test_collect_takes_an_object_with_a_comm(self, comm: MPI.Intracomm) -> None:
        class Mesh:
            def __init__(self, comm: MPI.Intracomm) -> None:
                self.comm = comm

        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        assert cgc.collect(Mesh(comm), generation=None).destroyed == 1

        class Bad:
            comm = 3

        with pytest.raises(TypeError, match="not an mpi4py communicator"):
            cgc.collect(Bad())
        with pytest.raises(TypeError, match="or an object with a .comm"):
            cgc.collect(object())


class TestCoreSelf(CoreTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi
class TestCoreWorld(CoreTests):
    COMM = MPI.COMM_WORLD


def test_collect_takes_a_petsc_object(petsc: Any) -> None:
    from collective_gc import petsc as cp

    comm = MPI.COMM_WORLD.Dup()
    other = MPI.COMM_WORLD.Dup()
    try:
        cp.install(other)
        cp.install(comm)
        vec = petsc.Vec().createMPI(4, comm=comm)
        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        # A PETSc object holds PETSc's inner duplicate of comm: found anyway.
        assert cgc.collect(vec, generation=None).destroyed == 1
        vec.destroy()
        unmanaged = MPI.COMM_WORLD.Dup()
        stray = petsc.Vec().createMPI(4, comm=unmanaged)
        with pytest.raises(TypeError, match="cannot tell which communicator"):
            cgc.collect(stray)
        stray.destroy()
        unmanaged.Free()
    finally:
        cgc.collect(comm)
        cgc.collect(other)
        comm.Free()
        other.Free()


def test_both_registration_constructors_make_the_same_registration() -> None:
    from collective_gc import _registration

    assert _registration.SPEEDUPS is not None  # built here (test_the_c_sync_passes_are_built_here)
    makers = [_registration.new_registration_py, _registration.SPEEDUPS.new_registration]
    seen = []
    for make in makers:
        inbox: list[object] = []
        o = Obj()
        reg = make(_registration.finalizer(), o, None, inbox.append, 7, noop, (1,), None, None)
        named = make(_registration.finalizer(), o, None, inbox.append, 8, noop, (), "n", None)
        seen.append(
            (
                reg.key,
                reg.name,
                reg.typename,
                reg.origin,
                reg.cyclic,
                reg.queued_at,
                reg.alive,
                named.name,
                reg() is o,
            )
        )
        del o
        assert {id(r) for r in inbox} == {id(reg), id(named)}  # the finalizer pushed both
    assert seen[0] == seen[1] == (7, "Obj", "Obj", None, False, -1, True, "n", True)
    with pytest.raises(TypeError):
        makers[1](_registration.finalizer(), 3, None, print, 0, noop, (), None, None)
