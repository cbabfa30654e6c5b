"""collective_scope: gc modes, agreed collections, strict mode, nesting, sync_point."""

from __future__ import annotations

import gc
import random
import warnings

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import (
    CheckedLog,
    Obj,
    make_cycle,
    noop,
    same_on_all,
)


class ScopeTests:
    COMM: MPI.Intracomm

    def test_gc_state_restored_and_exit_sync(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        assert gc.isenabled()
        with cgc.collective_scope(comm) as scope:
            assert not gc.isenabled()
            for i in range(5):
                make_cycle(comm, log, i)
        assert gc.isenabled()
        # The exit sync collected the cycles on every rank and destroyed them.
        assert log.keys == [4, 3, 2, 1, 0]
        assert scope.destroyed == 5 and scope.cyclic == 5 and scope.syncs == 1
        gc.disable()
        try:
            with cgc.collective_scope(comm, gc="auto"):
                assert gc.isenabled()
            assert not gc.isenabled()
        finally:
            gc.enable()

    def test_gc_restored_when_body_raises(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with pytest.raises(ZeroDivisionError):
            with cgc.collective_scope(comm):
                make_cycle(comm, log, "x")
                1 / 0  # noqa: B018 - every rank raises here
        assert gc.isenabled()
        assert log.keys == ["x"]  # the exit sync still ran

    def test_off_mode_never_collects(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with cgc.collective_scope(comm, gc="off") as scope:
            make_cycle(comm, log, 1)
            for _ in range(3):
                scope.sync()
        assert log.keys == [] and scope.collections == 0
        assert cgc.collect(comm).destroyed == 1

    def test_single_use_and_exit_order(self, comm: MPI.Intracomm) -> None:
        scope = cgc.collective_scope(comm)
        with scope:
            pass
        with pytest.raises(cgc.CollectiveGCError, match="single-use"):
            with scope:
                pass
        with pytest.raises(cgc.CollectiveGCError, match="not open"):
            scope.sync()
        outer = cgc.collective_scope(comm)
        inner = cgc.collective_scope(comm)
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(cgc.CollectiveGCError, match="innermost first"):
            outer.__exit__(None, None, None)
        # The misnested exit still closed the outer scope (state restored, as
        # trio's CancelScope does); the inner one closes normally.
        assert "exited" in repr(outer)
        assert cgc.current_scope(comm) is inner
        inner.__exit__(None, None, None)
        assert cgc.current_scope(comm) is None
        with pytest.raises(cgc.CollectiveGCError, match="not open"):
            outer.__exit__(None, None, None)
        assert gc.isenabled()

    def test_bad_arguments(self, comm: MPI.Intracomm) -> None:
        with pytest.raises(ValueError, match="gc must be"):
            cgc.collective_scope(comm, gc="sometimes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="strict must be"):
            cgc.collective_scope(comm, strict="yes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            cgc.collective_scope(comm, timeout=0)

    def test_strict_raises_on_every_rank(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with cgc.collective_scope(comm, strict=True, track_origins=True) as scope:
            keep = Obj()  # not in a cycle
            cgc.register(keep, log.destroy, "plain", comm=comm)
            if comm.Get_rank() == 0:
                # Only rank 0 has a cyclic finalization, yet every rank raises.
                reg = make_cycle(comm, log, "cyc")
                gc.collect()
            else:
                o = Obj()
                reg = cgc.register(o, log.destroy, "cyc", comm=comm, name="cyccyc")
            with pytest.raises(cgc.CyclicFinalizationError) as info:
                scope.sync()
            msg = str(info.value)
            assert "rank 0: Obj 'cyccyc'" in msg and f"(key {reg.key})" in msg
            assert "test_scope.py" in msg  # where it was registered
            if comm.Get_rank() != 0:
                del o  # dies by refcount on the other ranks: not a strict violation
            del keep
        assert sorted(log.keys) == ["cyc", "plain"]

    def test_strict_warn_and_count(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cgc.collective_scope(comm, strict="warn") as scope:
                make_cycle(comm, log, 7)
                gc.collect()
                scope.sync()
        assert scope.cyclic == 1
        assert any(issubclass(w.category, cgc.CyclicFinalizationWarning) for w in caught)
        with cgc.collective_scope(comm) as scope:
            make_cycle(comm, log, 8)
        assert scope.cyclic == 1 and log.keys == [7, 8]

    def test_strict_raises_after_the_program_replaced_gc_callbacks(
        self, comm: MPI.Intracomm
    ) -> None:
        """Issue 32, defect 5: a program (or a test framework) sets
        ``gc.callbacks[:] = [its_hook]`` before a strict scope, and five managed
        objects die in cycles inside it. Before: no CyclicFinalizationError
        (the collector's start and stop went unseen); now the scope puts its
        hook back at its entry, beside the program's."""
        log = CheckedLog(comm)
        saved = gc.callbacks[:]
        calls: list[str] = []

        def its_hook(phase: str, info: dict[str, int]) -> None:
            calls.append(phase)

        gc.callbacks[:] = [its_hook]
        try:
            with pytest.raises(
                cgc.CyclicFinalizationError, match=f"^{5 * comm.Get_size()} managed object"
            ):
                with cgc.collective_scope(comm, strict=True) as scope:
                    for i in range(5):
                        make_cycle(comm, log, i)
                    gc.collect()
                    scope.sync()
            assert its_hook in gc.callbacks and calls  # the program's hook stays, and runs
        finally:
            gc.callbacks[:] = saved
        assert sorted(log.keys) == [0, 1, 2, 3, 4]

    def test_strict_says_when_gc_callbacks_lost_its_hook_inside(self, comm: MPI.Intracomm) -> None:
        """Issue 32, defect 5: ``gc.callbacks`` emptied inside a strict scope,
        then a managed cycle collected: that death was not seen as cyclic, and
        the next sync point says so (a RuntimeWarning naming gc.callbacks and
        how many collections ran unseen) and puts the hook back, so that the
        next cyclic death raises CyclicFinalizationError as usual."""
        log = CheckedLog(comm)
        saved = gc.callbacks[:]
        try:
            with cgc.collective_scope(comm, strict=True, gc="off") as scope:
                gc.callbacks.clear()
                make_cycle(comm, log, "unseen")
                gc.collect()
                with pytest.warns(RuntimeWarning, match=r"gc\.callbacks.*1 collection"):
                    scope.sync()
                make_cycle(comm, log, "seen")
                gc.collect()
                with pytest.raises(
                    cgc.CyclicFinalizationError, match=f"^{comm.Get_size()} managed object"
                ):
                    scope.sync()
        finally:
            gc.callbacks[:] = saved
        assert log.keys == ["unseen", "seen"]

    def test_strict_is_not_fooled_by_a_rebound_gc_callbacks(self, comm: MPI.Intracomm) -> None:
        """Rebinding the module attribute (``gc.callbacks = []``) leaves the
        list the collector calls as it was: the hook still sees every
        collection, nothing is said, and a cyclic death still raises."""
        log = CheckedLog(comm)
        real = gc.callbacks
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                with cgc.collective_scope(comm, strict=True, gc="off") as scope:
                    gc.callbacks = []
                    make_cycle(comm, log, "c")
                    gc.collect()
                    with pytest.raises(
                        cgc.CyclicFinalizationError, match=f"^{comm.Get_size()} managed object"
                    ):
                        scope.sync()
        finally:
            gc.callbacks = real
        assert log.keys == ["c"]

    def test_sync_point_decorator(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)

        class Solver:
            def __init__(self) -> None:
                self.comm = comm

            @cgc.sync_point
            def solve(self) -> str:
                return "solved"

            @cgc.sync_point(comm=lambda self: self.comm)
            def solve_anywhere(self) -> str:
                return "solved"

        s = Solver()
        with cgc.collective_scope(comm) as scope:
            o = Obj()
            cgc.register(o, log.destroy, 1, comm=comm)
            del o
            assert s.solve() == "solved"
            assert log.keys == [1] and scope.syncs == 1
        with pytest.raises(cgc.CollectiveGCError, match="no collective_scope is open"):
            s.solve()
        o = Obj()
        cgc.register(o, log.destroy, 2, comm=comm)
        del o
        assert s.solve_anywhere() == "solved" and log.keys == [1, 2]


class TestScopeSelf(ScopeTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi(min_size=2)
class TestScopeWorld(ScopeTests):
    COMM = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_managed_collections_happen_at_the_same_sync_point(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    rng = random.Random(rank)
    events: list[tuple[int, int]] = []
    scope = cgc.collective_scope(comm)

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            events.append((scope.syncs, info["generation"]))

    old = gc.get_threshold()
    gc.set_threshold(100 + 200 * rank, 3, 3)  # different thresholds per rank
    try:
        with scope:
            gc.callbacks.append(record)  # inside: automatic collections before it don't count
            junk: list[object] = []
            for _ in range(60):
                junk.extend([] for _ in range(rng.randrange(0, 300 * (rank + 1))))
                if len(junk) > 3000:
                    junk.clear()
                scope.sync()
            del junk
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*old)
    assert len(events) > 5  # collections did happen ...
    assert same_on_all(comm, events)  # ... at the same sync points, same generations
    assert any(g == 2 for _, g in events) and any(g == 0 for _, g in events)


@pytest.mark.mpi(min_size=2)
def test_exit_sync_after_error_on_one_rank_does_not_hang(comm: MPI.Intracomm) -> None:
    # The body raises on the last rank only, while the others are busy
    # elsewhere: the failing rank's exit sync gives up at its deadline and its
    # own exception propagates, with a note, instead of hanging.
    last = comm.Get_size() - 1
    cgc.manager(comm)  # collective the first time, so on every rank
    if comm.Get_rank() == last:
        with pytest.raises(KeyError) as info:
            with cgc.collective_scope(comm, timeout=0.5):
                raise KeyError("only here")
        assert "exit sync" in "".join(getattr(info.value, "__notes__", []))
        assert gc.isenabled() is not False  # gc state restored
    comm.Barrier()
    cgc.manager(comm).mark_unusable("the end of this test")  # the others skip it at exit too


def test_two_nested_managed_scopes_on_one_comm(comm: MPI.Intracomm) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, noop, comm=comm)
    before = mgr.participants  # the derived-communicator visitor, since its first collective
    with cgc.collective_scope(comm, gc="managed", timeout=30) as outer:
        with cgc.collective_scope(comm, gc="managed", strict=True, timeout=30) as inner:
            junk = [[] for _ in range(5000)]  # the collector's counts ask for a collection
            del junk, o
            assert inner.sync().destroyed == 1
            assert cgc.current_scope(comm) is inner
        outer.sync()
        assert cgc.current_scope(comm) is outer
    assert cgc.current_scope(comm) is None
    assert mgr.broken is None and mgr.participants == before  # the scopes left none


def test_misnested_exit_restores_the_collector_and_the_stack() -> None:
    """Issue 11, defect 11."""
    comm = MPI.COMM_SELF.Dup()
    try:
        outer = cgc.collective_scope(comm, gc="auto")
        inner = cgc.collective_scope(comm, gc="managed")
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(cgc.CollectiveGCError, match="innermost first"):
            outer.__exit__(None, None, None)
        assert not gc.isenabled()  # inner (managed) is still open
        inner.__exit__(None, None, None)
        assert gc.isenabled() and cgc.current_scope() is None
    finally:
        comm.Free()
