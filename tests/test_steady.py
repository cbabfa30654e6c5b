"""The steady state of a sync point: one collective, every step taking its
fast case (in one C call where the extension is built, else the Python
steps themselves); whatever is unusual goes on in the Python steps from the
agreement, with the same outcome. Which way each sync point went is read
through collective_gc.testing.outcomes, the same in both legs.

Every test runs on COMM_WORLD's duplicate (the ``comm`` fixture) on 4 ranks,
and on COMM_SELF serially where it means something there. Each one records
what the steady state returned, so that a test shows which way each sync
point went, and asserts the same results on every rank.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.testing as cgc_testing
from collective_gc import _agree, _comms, _switch

from _util import GcDisabled, Obj, everyone, noop

pytestmark = pytest.mark.mpi(min_size=2)


def test_the_c_steady_state_runs_where_it_is_required() -> None:
    """``make test`` builds the extension with MPI (CGC_REQUIRE_STEADY=1): a
    build that silently fell back to the Python steps would leave the floor
    unmeasured. The pure-Python leg runs the twin, on purpose."""
    from collective_gc import _state

    if _switch.PURE_PYTHON:
        assert _switch.speedups() == "python"
        assert _state.FamilyState.__module__ == "collective_gc._state"
    elif os.environ.get("CGC_REQUIRE_STEADY", "") not in ("", "0"):
        assert _switch.speedups() == "c+mpi", _switch.speedups()
        assert _state.FamilyState.__module__ == "collective_gc._speedups"
    else:
        pytest.skip("the C steady state is not required on this stack")


def test_an_empty_sync_point_is_the_steady_state(comm: MPI.Intracomm, outcomes: list[str]) -> None:
    cgc.collect(comm, generation=None, timeout=30)  # the first: the family, the buffer
    outcomes.clear()
    for _ in range(5):
        stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 0 and stats.pending == 0
    assert everyone(comm, outcomes) == [["steady"] * 5] * comm.Get_size()


def test_a_sync_point_with_a_deadline_is_the_steady_state(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    """A timeout only bounds the wait in the agreement: ``cgc.collect(...,
    timeout=)`` and a scope's sync points with a ``timeout`` take the steady
    state as those without one do, and destroy there. (Issue 38: the
    DOLFINx loop's scope has ``timeout=120``, and none of its sync points
    took the steady state.)"""
    log: list[int] = []
    cgc.collect(comm, generation=None, timeout=30)
    outcomes.clear()
    for _ in range(3):
        assert cgc.collect(comm, generation=None, timeout=30).destroyed == 0
    with GcDisabled(), cgc.collective_scope(comm, timeout=30) as scope:
        scope.sync()  # the scope's first: its participant joins the fingerprint
        o = Obj()
        cgc.register(o, log.append, 1, comm=comm)
        scope.sync()  # reshapes the window for the registration
        del o
        seen = len(outcomes)
        assert scope.sync().destroyed == 1
        assert scope.sync().destroyed == 0
        ways = outcomes[seen:]
    got = everyone(comm, (outcomes[:3], ways, log))
    assert all(g == (["steady"] * 3, ["steady"] * 2, [1]) for g in got), got


def test_keys_dropped_everywhere_are_destroyed_in_the_steady_state(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    log: list[int] = []
    cgc.collect(comm, generation=None, timeout=30)
    with GcDisabled():
        for step in range(6):
            objs = [Obj() for _ in range(50)]
            for i, o in enumerate(objs):
                cgc.register(o, log.append, 50 * step + i, comm=comm)
            del o
            objs.clear()
            assert cgc.collect(comm, generation=None).destroyed == 50
    # Newest first, every step.
    assert log == [50 * s + i for s in range(6) for i in reversed(range(50))]
    # The first sync point after registrations reshapes the window's buffer:
    # the steps; the others, the steady state.
    got = everyone(comm, outcomes)
    assert all(g == got[0] for g in got), got
    assert got[0].count("steady") >= 4, got


def test_objects_kept_for_many_sync_points_die_in_the_steady_state(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    """A solver cache's pattern: each step registers three objects and drops
    those of 24 steps before. Their keys are older than the sync points just
    before, but within the bits the window's buffer has anyway: the same one
    collective as for objects dropped at once. (Issue 38: bench_step's case
    of this ran 6.9x plain petsc4py at 2 ranks, every sync point taking a
    second round for the old keys.)"""
    log: list[int] = []
    kept: list[list[Obj]] = []
    cgc.collect(comm, generation=None, timeout=30)
    with GcDisabled():
        for step in range(80):
            objs = [Obj() for _ in range(3)]
            for i, o in enumerate(objs):
                cgc.register(o, log.append, 3 * step + i, comm=comm)
            kept.append(objs)
            del o, objs
            if len(kept) > 24:
                kept.pop(0)
            if step == 40:
                outcomes.clear()
            assert cgc.collect(comm, generation=None).destroyed == (3 if step >= 24 else 0)
        window = cgc_testing.family(comm)
        kept.clear()
        assert cgc.collect(comm, generation=None).destroyed == 72
    assert log[:9] == [2, 1, 0, 5, 4, 3, 8, 7, 6]
    assert sorted(log) == list(range(240))
    got = everyone(comm, (outcomes, window is not None and window.window))
    assert all(g == got[0] for g in got), got
    # Every sync point of the second half, and the last one (the 72 kept):
    # the steady state, with the window's first key 72 or more keys back.
    ways, (first, _bits) = got[0]
    assert ways == ["steady"] * 41, ways
    assert first <= 240 - 72 - 3, got[0]


def test_keys_dropped_on_some_ranks_go_on_from_the_agreement(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    """Rank 0 keeps its object one sync point longer: the others drained
    the key, agreed on nothing, and went on in the Python steps with it
    pending; the next sync point destroys it everywhere."""
    rank = comm.Get_rank()
    log: list[str] = []
    cgc.collect(comm, generation=None, timeout=30)
    cgc.collect(comm, generation=None, timeout=30)
    outcomes.clear()
    with GcDisabled():
        o = Obj()
        cgc.register(o, log.append, "late", comm=comm)
        cgc.collect(comm, generation=None, timeout=30)  # reshapes for the registration
        held = [o] if rank == 0 else []
        del o
        first = cgc.collect(comm, generation=None)
        held.clear()
        second = cgc.collect(comm, generation=None)
    verdict = everyone(comm, (first.destroyed, second.destroyed, log, outcomes[-2:]))
    expected_first = "steady" if rank == 0 else "resume"
    assert verdict[rank][3][0] == expected_first, verdict
    assert all(v[:3] == (0, 1, ["late"]) for v in verdict), verdict


def test_a_failed_destroy_in_the_steady_state_is_kept_and_reported(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    rank = comm.Get_rank()

    def fails_on_0() -> None:
        if rank == 0:
            raise RuntimeError("fails on rank 0")

    cgc.collect(comm, generation=None, timeout=30)
    with GcDisabled():
        o = Obj()
        cgc.register(o, fails_on_0, comm=comm, name="fragile")
        cgc.collect(comm, generation=None, timeout=30)
        outcomes.clear()
        del o
        stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 1
        with pytest.raises(cgc.DestroyError, match="fails on rank 0") as info:
            cgc.collect(comm, generation=None)
    assert [(r, n) for r, _, n, _ in info.value.failures] == [(0, "fragile")]
    got = everyone(comm, outcomes)
    # Rank 0 kept a failure: its next sync point takes the steps (the report
    # is theirs to make); the others find it in the agreement, and go on there.
    assert got == [["failed", "steps"]] + [["steady", "resume"]] * (comm.Get_size() - 1), got


class _Quiet(cgc.Participant):
    """Votes ``next`` in field 4; its finish notes its byte of the flags."""

    field = 4
    quiet_finish = True

    def __init__(self, raises: bool) -> None:
        self.next = 0
        self.raises = raises
        self.finished: list[int] = []

    def vote(self, mgr: cgc.Manager) -> int:
        return self.next

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        self.finished.append(self.votes(flags))

    def may_raise(self, flags: int) -> bool:
        return self.raises and self.votes(flags) != 0


@pytest.mark.parametrize("raises", [True, False], ids=["may-raise", "never-raises"])
def test_a_participant_that_votes_finishes_on_every_rank(
    comm: MPI.Intracomm, outcomes: list[str], raises: bool
) -> None:
    """A vote rides in the agreement's header (issue 38: no revote): the
    rank that votes goes on in the one call as the others do, and every
    rank finishes. Only a finish that may raise once voted for (it needs
    one more word after it) sends every rank to the steps, from the
    agreement; one that never raises (PETSc's cleanup) stays steady."""
    own = comm.Dup()  # the participant leaves with it
    mgr = cgc.manager(own)
    try:
        p = _Quiet(raises)
        mgr.add_participant(p)
        cgc.collect(own, generation=None, timeout=30)  # the participant's first sync point
        outcomes.clear()
        p.finished.clear()
        cgc.collect(own, generation=None)  # votes 0, quiet: nothing to finish
        p.next = 1 if own.Get_rank() == 0 else 0
        cgc.collect(own, generation=None)  # rank 0 votes: every rank finishes
        p.next = 0
        cgc.collect(own, generation=None)
        got = everyone(comm, (outcomes, p.finished))
        way = "resume" if raises else "steady"
        assert all(g == (["steady", way, "steady"], [1]) for g in got), got
    finally:
        mgr.close(timeout=30)
        own.Free()


def test_a_cyclic_death_takes_the_steps(comm: MPI.Intracomm, outcomes: list[str]) -> None:
    cgc.collect(comm, generation=None, timeout=30)
    with GcDisabled():
        o = Obj()
        cgc.register(o, noop, comm=comm, name="cyclic")
        cgc.collect(comm, generation=None, timeout=30)
        o.peer = o
        del o
        gc.collect()
        outcomes.clear()
        stats = cgc.collect(comm, generation=None)
    assert (stats.destroyed, stats.cyclic) == (1, 1)
    assert everyone(comm, outcomes) == [["steps"]] * comm.Get_size()


def test_a_rank_that_gives_up_wakes_one_waiting_in_the_steady_state(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    """Rank 0 has a deadline and gives up, in the steady state's wait (its
    notice names it; the steps raise the timeout from there); the others,
    in the steady state without one, are woken by its notice."""
    rank = comm.Get_rank()
    cgc.collect(comm, generation=None, timeout=30)
    outcomes.clear()
    if rank == 1:
        time.sleep(1.5)  # late: rank 0 gives up meanwhile
    t0 = time.monotonic()
    try:
        cgc.collect(comm, generation=None, timeout=0.3 if rank == 0 else None)
        seen = "ok"
    except cgc.CollectiveTimeoutError:
        seen = "CollectiveTimeoutError"
    took = time.monotonic() - t0
    verdict = everyone(comm, (seen, outcomes))
    assert all(v[0] == "CollectiveTimeoutError" for v in verdict), verdict
    assert took < 10
    # Ranks 2.. waited in the steady state's allreduce and were woken there;
    # rank 1 arrived after the notice (it completes the allreduce or sees
    # the notice, whichever MPI finds first: both raise).
    assert all(v[1] in (["watch"], ["resume"]) for v in verdict[2:]), verdict
    assert cgc.manager(comm).broken is not None


def test_the_message_has_no_word_per_rank(comm: MPI.Intracomm) -> None:
    """What the steady state sends: the header and the window, whatever the
    number of ranks or of communicators congruent with this one."""
    dups = [cgc.dup(comm) for _ in range(20)]
    cgc.collect(comm, generation=None, timeout=30)
    words, _, bits = cgc.manager(comm).message or (0, 0, 0)
    assert words == _agree.WORDS + bits // 64
    del dups
    cgc.collect(comm, generation=None, timeout=30)


def test_idle_derived_families_keep_the_steady_state(
    comm: MPI.Intracomm, outcomes: list[str]
) -> None:
    """A family with a live split under it (one registration in each half)
    stays in the steady state while nothing is dropped there; the ranks of
    the half that drops its object take the steps, the others go on from
    the agreement, and the half's sync point destroys it.

    From the live-communicators benchmark (issue 31): a family with any
    derived family took the Python steps at every sync point (4x the
    empty sync point)."""
    rank = comm.Get_rank()
    color = rank % 2
    log: list[str] = []
    with GcDisabled():
        sub = cgc.split(comm, color)
        held = Obj()
        cgc.register(held, log.append, f"half{color}", comm=sub)
        cgc.collect(comm, generation=None, timeout=30)  # the half's first sync point
        cgc.collect(comm, generation=None, timeout=30)
        outcomes.clear()
        for _ in range(5):
            cgc.collect(comm, generation=None)
        quiet = list(outcomes)
        outcomes.clear()
        if color == 0:
            held = None
        cgc.collect(comm, generation=None)
        dropped = list(outcomes)
    verdict = everyone(comm, (quiet, dropped, log))
    assert all(v[0] == ["steady"] * 5 for v in verdict), verdict
    for r, (_, went, destroyed) in enumerate(verdict):
        assert went == (["steps"] if r % 2 == 0 else ["resume"]), verdict
        assert destroyed == (["half0"] if r % 2 == 0 else []), verdict
    del held, sub
    cgc.collect(comm, generation=None, timeout=30)
    cgc.collect(comm, generation=None, timeout=30)


@pytest.mark.mpi(min_size=4)
def test_an_unreachable_family_costs_one_look(comm: MPI.Intracomm, outcomes: list[str]) -> None:
    """A communicator first used inside a scope whose communicator does not
    contain it waits to be reached (``_comms.unreached``); the scope's family
    looks once whether it can reach it, and its later sync points are
    steady again. From the live-communicators benchmark (issue 31)."""
    rank = comm.Get_rank()
    half = comm.Split(rank % 2, rank)
    across = comm.Split(rank // 2, rank)  # shares one rank with each half
    with GcDisabled():
        with cgc.collective_scope(half) as scope:
            scope.sync()
            held = Obj()
            cgc.register(held, noop, comm=across)  # its first collective: unreached
            outcomes.clear()
            for _ in range(4):
                scope.sync()
            went = list(outcomes)
            unreached = [m.size for m in _comms.unreached(warn=False)]
        del held
        cgc.collect(across, generation=None, timeout=30)
    verdict = everyone(comm, (went, unreached))
    # A rank whose ``across`` joined a family an earlier test left reached
    # has nothing unreached: all steady there (its half's other rank may
    # take the steps at the same sync point: the same collective).
    for seen, none in verdict:
        expected = ["steps", "steady", "steady", "steady"] if none else ["steady"] * 4
        assert seen == expected, verdict
        assert none in ([2], []), verdict
    assert any(none for _, none in verdict), f"no rank had an unreached family: {verdict}"
    half.Free()
    across.Free()
