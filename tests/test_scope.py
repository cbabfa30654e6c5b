"""collective_scope: gc modes, agreed collections, strict mode, nesting, sync_point."""

from __future__ import annotations

import gc
import random
import signal
import sys
import warnings
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.testing as cgc_testing
from collective_gc import _state

from _util import (
    CheckedLog,
    Obj,
    everyone,
    make_cycle,
    noop,
    same_on_all,
)


def _all(comm: MPI.Comm) -> str:
    """How the strict error counts every rank of ``comm``: "4 of 4"."""
    return f"{comm.Get_size()} of {comm.Get_size()}"


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
                cgc.CyclicFinalizationError,
                match=rf"^5 managed object\(s\) .* on {_all(comm)} rank",
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
                    cgc.CyclicFinalizationError,
                    match=rf"^1 managed object\(s\) .* on {_all(comm)} rank",
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
                        cgc.CyclicFinalizationError,
                        match=rf"^1 managed object\(s\) .* on {_all(comm)} rank",
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
    # The family first, on every rank: the exit sync's collectives are then
    # on its private duplicate, not a first collective on ``comm`` made by
    # one rank (an abandoned duplication the others' next collective there
    # could match).
    cgc.collect(comm, generation=None, timeout=30)
    if comm.Get_rank() == last:
        with pytest.raises(KeyError) as info:
            with cgc.collective_scope(comm, timeout=0.5):
                raise KeyError("only here")
        assert "exit sync" in "".join(getattr(info.value, "__notes__", []))
        assert gc.isenabled() is not False  # gc state restored
    comm.Barrier()
    cgc.manager(comm).mark_unusable("the end of this test")  # the others skip it at exit too


@pytest.mark.mpi(min_size=2)
def test_an_error_on_one_rank_in_a_scopes_first_use_is_told_to_the_others(
    comm: MPI.Intracomm,
) -> None:
    """Every rank enters a scope on a communicator never used before; the
    body raises on the last rank at once, the others work on for longer
    than the scope's timeout. The last rank's exit sync gives up at its
    deadline and its error propagates with a note; the others' exit sync
    points are told so by its notice (the family's watch), not left to
    time out on a family their exit was about to make. From stop 57's
    note: the exit sync after the error was the last rank's first
    collective on the communicator (a duplication it alone posted and
    abandoned, which the others' own first collective there then matched);
    the family is made as the scope is entered now."""
    import time

    last = comm.Get_size() - 1
    rank = comm.Get_rank()
    seen = "nothing"
    try:
        with cgc.collective_scope(comm, timeout=0.5):
            if rank == last:
                raise KeyError("only here")
            time.sleep(1.5)
    except KeyError as exc:
        seen = "KeyError, noted" if "exit sync" in "".join(exc.__notes__) else "KeyError"
    except cgc.CollectiveGCError as exc:
        seen = "told" if f"rank {last} gave up" in str(exc) else str(exc)
    comm.Barrier()
    cgc.manager(comm).mark_unusable("the end of this test")  # (skipped at exit too)
    assert everyone(comm, seen) == ["told"] * last + ["KeyError, noted"]


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


# -- @sync_point: finding the communicator -------------------------------------------


class _KeywordSolver:
    """A wrapper whose solve takes its vectors by position or by keyword, and a
    keyword-only tolerance, decorated with the documented comm callable."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.solved: list[tuple[object, object, object]] = []

    @cgc.sync_point(comm=lambda self, *args: self.comm)
    def solve(self, b: object, x: object, *, tol: object = None) -> str:
        self.solved.append((b, x, tol))
        return "solved"


def test_sync_point_comm_callable_takes_keyword_calls(comm: MPI.Intracomm) -> None:
    """Issue 41, section 3: with ``comm=lambda self, *args: self.comm``,
    ``solve(b=..., x=...)`` ran the solve, then raised ``TypeError: <lambda>()
    got an unexpected keyword argument 'b'``, and no sync point ran. Now each
    spelling of the call syncs on ``self.comm`` (no scope is open: a
    collect there, which destroys what was dropped), and a keyword-only
    argument goes to a callable that takes it, and not to one that does not."""
    log = CheckedLog(comm)
    s = _KeywordSolver(comm)
    calls = [
        ((), {"b": 1, "x": 2}, "b, x by keyword", "k1"),
        ((1,), {"x": 2}, "x by keyword", "k2"),
        ((), {"x": 2, "b": 1, "tol": 1e-8}, "a keyword-only one too", "k3"),
    ]
    for args, kwargs, how, key in calls:
        o = Obj()
        cgc.register(o, log.destroy, key, comm=comm)
        del o
        assert s.solve(*args, **kwargs) == "solved", how
        assert log.keys[-1] == key, f"{how}: no sync point ran after the solve"
    assert s.solved == [(1, 2, None), (1, 2, None), (1, 2, 1e-8)]

    seen: list[object] = []

    class Tolerant(_KeywordSolver):
        @cgc.sync_point(comm=lambda self, b, x, tol=None: seen.append(tol) or self.comm)
        def solve(self, b: object, x: object, *, tol: object = None) -> str:
            return "solved"

    assert Tolerant(comm).solve(x=2, b=1, tol=3) == "solved"
    assert seen == [3]


def test_sync_point_refuses_before_the_call_when_its_comm_callable_fails(
    comm: MPI.Intracomm,
) -> None:
    """Issue 41, section 3: the comm callable ran after the solve, so when it
    raised the solve had run on every rank and its sync point had not. Now
    the communicator is found first: a callable that raises, or returns
    something that is not a communicator, fails the call before the function
    runs, saying so, and the next sync point is in step on every rank."""
    ran: list[str] = []

    class Broken:
        @cgc.sync_point(comm=lambda self, *args: self.missing)
        def solve(self) -> None:
            ran.append("raising callable")

        @cgc.sync_point(comm=lambda self, *args: 42)
        def solve_bad_comm(self) -> None:
            ran.append("non-communicator")

    with pytest.raises(AttributeError) as info:
        Broken().solve()
    assert "Broken.solve was not called" in "".join(info.value.__notes__)
    with pytest.raises(TypeError, match=r"returned 42, not an MPI communicator.*not called"):
        Broken().solve_bad_comm()
    assert ran == []
    first = cgc.collect(comm).sync  # the ranks are in step: the next sync points run
    assert cgc.collect(comm).sync == first + 1


def _private_solve(x: int) -> int:
    return x + 1


def public_solve(x: int, comm: MPI.Comm | None = None) -> int:
    """A public function around a private sync point, as collective_gc.petsc's
    solve is around its _solve."""
    fn = cgc.sync_point(_private_solve, comm=comm)
    return fn(x)  # type: ignore[no-any-return]


def test_sync_point_without_comm_or_scope_names_the_call_and_the_fix() -> None:
    """Issue 41, section 3: a bare ``cp.solve(ksp, b, x)`` outside a scope
    raised "_solve is a sync point, but no collective_scope is open ... no
    comm was given to @sync_point", after the solve: a private name, and not
    the fix. Now the error names what the program called and how to give it a
    communicator, and comes before anything ran."""
    ran: list[int] = []

    class Solver:
        @cgc.sync_point
        def solve(self) -> None:
            ran.append(1)

    with pytest.raises(cgc.CollectiveGCError) as info:
        Solver().solve()
    msg = str(info.value)
    assert "Solver.solve() is a sync point" in msg
    assert "@collective_gc.sync_point(comm=comm)" in msg and "collective_scope(comm)" in msg
    assert "refused before" in msg and ran == []
    with pytest.raises(cgc.CollectiveGCError) as info:
        public_solve(1)
    msg = str(info.value)
    assert "public_solve() ends in a sync point" in msg and "_private_solve" not in msg
    assert "public_solve(..., comm=comm)" in msg
    assert public_solve(1, comm=MPI.COMM_SELF) == 2  # the fix it names works


def test_strict_error_counts_objects_and_ranks_apart(comm: MPI.Intracomm) -> None:
    """Issue 41, section 3: one object finalized cyclically on each of 4 ranks
    was reported as "4 managed object(s)". The error now counts objects (one
    key on every rank) and the ranks that finalized them, apart."""
    size = comm.Get_size()
    log = CheckedLog(comm)
    with cgc.collective_scope(comm, strict=True, gc="off") as scope:
        make_cycle(comm, log, "everywhere")
        gc.collect()
        with pytest.raises(cgc.CyclicFinalizationError) as info:
            scope.sync()
        head = str(info.value).splitlines()[0]
        assert head.startswith(
            f"1 managed object(s) were finalized by the cyclic collector on {size} of {size} "
            f"rank(s) ({list(range(size))}; {size} finalization(s), one per object per rank"
        ), head
        if comm.Get_rank() == 0:  # on rank 0 only: the other ranks drop it by refcount
            make_cycle(comm, log, "here")
            gc.collect()
        else:
            o = Obj()
            cgc.register(o, log.destroy, "here", comm=comm)
            del o
        with pytest.raises(cgc.CyclicFinalizationError) as info:
            scope.sync()
        assert str(info.value).startswith(
            f"1 managed object(s) were finalized by the cyclic collector on 1 of {size} "
            "rank(s) ([0]; 1 finalization(s)"
        ), str(info.value)
    assert log.keys == ["everywhere", "here"]


# -- issue 39: the promise, round 5 ------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["decorator", "collect"])
def test_strict_mode_sees_a_cyclic_death_drained_on_a_congruent_communicator(
    comm: MPI.Intracomm, how: str
) -> None:
    """Issue 39, item 3. A strict scope on the communicator; a library's
    solve is a ``@cgc.sync_point(comm=d)`` on its own ``Dup()`` of it (no
    scope of its own: ``cgc.collect(d)`` runs), or calls ``cgc.collect(d)``.
    ``d`` is congruent with the scope's communicator: one family, so that
    sync point drains the managed object that died in the cyclic collector.
    README: "Strict mode raises CyclicFinalizationError on every rank when a
    managed object died in the cyclic collector": at that sync point, or at
    the latest at the scope's next one or its exit, never not at all."""
    d = comm.Dup()

    @cgc.sync_point(comm=d)
    def solve() -> None:
        pass

    where = "nowhere"
    try:
        with cgc.collective_scope(comm, strict=True) as scope:
            o = Obj()
            o.peer = o
            cgc.register(o, noop, comm=comm, name="cyclic")
            del o
            gc.collect()
            where = "the library's sync point"
            if how == "decorator":
                solve()
            else:
                cgc.collect(d, generation=None)
            where = "the scope's sync point"
            scope.sync()
            where = "the scope's exit"
        where = "nowhere"
    except cgc.CyclicFinalizationError:
        pass
    finally:
        d.Free()
    seen = comm.allgather(where)
    assert seen[0] != "nowhere" and len(set(seen)) == 1, seen


@pytest.mark.parametrize("policy", ["managed", "auto", "off"])
def test_many_scopes_on_one_communicator_keep_nothing_of_the_earlier_ones(
    comm: MPI.Intracomm, policy: str
) -> None:
    """A scope around each of many short solves, as the docs advise: each
    scope's sync points take a participant of its own, which the family
    takes for its steady state. Once a scope is done, nothing of it may
    stay. From a review of the scopes (stop 57): the family cached each
    scope's participant in a weak dictionary whose values held it, so that
    none ever left (some twenty objects per scope, for the life of the
    family)."""
    # (No exit collection: a full one per scope is the test's whole cost.)
    for _ in range(5):
        with cgc.collective_scope(comm, gc=policy, timeout=30, exit_collect=None) as scope:  # type: ignore[arg-type]
            scope.sync()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(100):
            with cgc.collective_scope(comm, gc=policy, timeout=30, exit_collect=None) as scope:  # type: ignore[arg-type]
                scope.sync()
        del scope
        gc.collect()
        grown = len(gc.get_objects()) - before
    finally:
        if was:
            gc.enable()
    verdicts = comm.allgather(grown)
    assert all(g < 50 for g in verdicts), verdicts


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"signal {signum}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_signal_in_a_scopes_exit_collection_waits_for_its_exit_sync(
    comm: MPI.Intracomm,
) -> None:
    """A scope's exit sync point comes after a collection on every rank,
    which may be long (a large heap). A signal arriving in it (a watchdog's
    alarm here; a Ctrl-C, a scheduler's SIGTERM) is held, as one arriving in
    the sync point itself, and raised once every rank has left the exit
    sync point: the family stays usable. On rank 0 the body leaves five
    million cycles and arms the alarm, which comes while the collector
    frees them. From a review of the scopes (stop 57): the collection ran
    outside the protected region, so the signal left rank 0's exit sync
    point unmade, and the other ranks waited in it until their deadline."""
    rank = comm.Get_rank()
    cgc.collect(comm, generation=None, timeout=30)  # the family exists
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        try:
            with cgc.collective_scope(comm, gc="managed", timeout=30):
                if rank == 0:
                    for _ in range(5_000_000):
                        cycle: list[Any] = []
                        cycle.append(cycle)
                    del cycle
                    signal.setitimer(signal.ITIMER_REAL, 0.05)
            got = "ok"
        except TimeoutError:
            got = "TimeoutError"
        except cgc.CollectiveGCError as exc:
            got = type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    then = "ok"
    try:
        cgc.collect(comm, generation=None, timeout=30)
    except Exception as exc:  # noqa: BLE001 (named in the verdict)
        then = type(exc).__name__
    verdicts = comm.allgather((got, then, cgc.manager(comm).broken is None))
    assert verdicts[0] == ("TimeoutError", "ok", True), verdicts
    assert all(v == ("ok", "ok", True) for v in verdicts[1:]), verdicts


class _Interrupted(BaseException):
    pass


def _interrupt(signum: int, frame: Any) -> None:
    raise _Interrupted


def _records_origins(comm: MPI.Comm) -> bool:
    """Whether a registration made now records where it was made."""
    owner = Obj()
    reg = cgc.register(owner, noop, comm=comm)
    recorded = reg.origin is not None
    reg.detach()
    return recorded


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("at", ["start", "enter"])
def test_a_ctrl_c_at_the_first_instruction_of_a_scopes_exit_closes_it_first(
    comm: MPI.Intracomm, at: str
) -> None:
    """A Ctrl-C whose handler runs at the very first instruction of a
    scope's ``__exit__``, on every rank: before any region could begin. The
    scope must still run its exit sync point and close, then raise the
    interrupt; Python never calls ``__exit__`` again, so an interrupt raised
    there left the scope open for ever, its exit sync point unmade (from
    stop 58's note on the scopes' edges). A profile hook stands in for the
    interpreter as ``__exit__`` begins: it calls the SIGINT handler
    installed, with that frame, as a signal arriving then would be. (A
    signal the hook raised would run its handler in the hook's own frame.)
    ``at="enter"``: as ``__exit__`` calls its region's ``enter`` (C: after
    the call, in ``__exit__``'s frame; the pure twin's: as that method
    starts, in its own frame), before it counts the region; from a review
    of the first version of this, which covered the start only."""
    log: list[int] = []
    code = cgc.collective_scope.__exit__.__code__
    enter = _state.PythonRegion.enter.__code__

    def hook(frame: Any, event: str, arg: Any) -> None:
        starts = event == "call" and frame.f_code is code
        if at == "enter":
            starts = (
                event == "c_return"
                and frame.f_code is code
                and getattr(arg, "__name__", "") == "enter"
            ) or (event == "call" and frame.f_code is enter and frame.f_back.f_code is code)
        if starts:
            sys.setprofile(None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)  # type: ignore[operator]

    scope = cgc.collective_scope(comm)
    raised = False
    try:
        with scope:
            o = Obj()
            cgc.register(o, log.append, 1, comm=comm)
            del o
            sys.setprofile(hook)
    except KeyboardInterrupt:
        raised = True
    finally:
        sys.setprofile(None)
    still_open = cgc.current_scope() is scope
    if still_open:
        scope.__exit__(None, None, None)
    assert everyone(comm, (raised, still_open, log)) == [(True, False, [1])] * comm.Get_size()


def test_a_scope_opens_whole_or_leaves_nothing_under_interrupts() -> None:
    """A signal's handler raising at any point while strict scopes (a
    watch participant added on entry) that track origins are entered and
    exited: a scope either opens whole (and its exit puts everything back,
    also when the handler runs at the first instruction of ``__exit__``) or
    leaves nothing behind: no scope open, the collector as before, origins not
    recorded, no participant left on the family. Also two
    scopes that track origins, ended in the other order, leave origins
    recorded while either is open. From a review of the scopes (stop 57):
    entering was not a protected region (a handler raising between its
    steps, or after them, where __exit__ is never called, left the scope on
    the stack), and each scope's exit put back the origins setting it
    found, switching it off under another scope still open."""
    comm = MPI.COMM_SELF.Dup()
    rng = random.Random(7)
    was = gc.isenabled()
    previous = signal.signal(signal.SIGALRM, _interrupt)
    cut = 0
    try:
        for _ in range(400):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2e-4))
                with cgc.collective_scope(comm, strict=True, track_origins=True, gc="managed"):
                    pass
                signal.setitimer(signal.ITIMER_REAL, 0)
            except _Interrupted:
                cut += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        stuck = 0
        while (scope := cgc.current_scope()) is not None:
            stuck += 1  # (asserted below: cleaned up first)
            scope.__exit__(None, None, None)
        left = (
            cgc.current_scope(),
            gc.isenabled() == was,
            _records_origins(comm),
            cgc.manager(comm).participants,
        )
        first = cgc.collective_scope(comm, track_origins=True)
        second = cgc.collective_scope(comm, track_origins=True)
        first.__enter__()
        second.__enter__()
        first_open = _records_origins(comm)
        # (Misnested: the first's exit refuses, but puts back what it did.)
        with pytest.raises(cgc.CollectiveGCError, match="innermost first"):
            first.__exit__(None, None, None)
        second_open = _records_origins(comm)
        second.__exit__(None, None, None)
        after = _records_origins(comm)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        comm.Free()
    assert cut > 50  # (the interrupts came, at many points)
    assert stuck == 0, f"{stuck} scopes cut at an edge of __enter__ or __exit__ stayed open"
    assert left == (None, True, False, ()), left
    assert (first_open, second_open, after) == (True, True, False)


def _solver_steps(comm: MPI.Comm) -> Any:
    with cgc.collective_scope(comm):
        yield 1
        yield 2


def test_a_scope_left_open_in_a_generator_the_collector_closes_runs_no_sync_point(
    comm: MPI.Intracomm,
) -> None:
    """A generator suspended inside a scope, then dropped in a reference
    cycle: the cyclic collector closes it, which exits the scope inside the
    collector, at a different moment on each rank. The exit sync point
    (MPI) must not run there: the scope is closed without it, and the
    error says why and what to do (printed as unraisable, as the
    collector does for any exception raised in it). From a review of the
    scopes (stop 57): the exit sync point ran inside gc.collect()."""
    cgc.collect(comm, generation=None, timeout=30)
    before = cgc_testing.family(comm)
    assert before is not None
    steps = _solver_steps(comm)
    next(steps)
    holder: list[Any] = [steps]
    holder.append(holder)  # a cycle: only the cyclic collector frees it
    del steps, holder
    seen: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    after = cgc_testing.family(comm)
    assert after is not None
    assert cgc.current_scope() is None and after.seq == before.seq
    assert any(
        s.startswith("CollectiveGCError") and "exited by the cyclic garbage collector" in s
        for s in seen
    ), seen
    cgc.collect(comm, generation=None, timeout=30)  # the family goes on
