"""Participants: votes, their field, their fingerprint, ``finish`` and ``may_raise`` seen
alike on every rank.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _agree

from _util import (
    FINISHED,
    JOB_HEAD,
    Asked,
    Finisher,
    GcDisabled,
    Obj,
    Recorder,
    everyone,
    job_report,
    noop,
    outcome_of,
    run_job,
    same_on_all,
    sync_with,
)


def test_the_participants_fingerprint_has_64_bits() -> None:
    values = {_agree.fingerprint(f"p{i}") for i in range(20_000)}
    assert len(values) == 20_000
    assert any(v >= 1 << 48 or v < 0 for v in values)  # all 64 bits are used
    assert all(-(1 << 63) <= v < 1 << 63 for v in values)  # one int64 word


@pytest.mark.parametrize("vote", [256, -1, 1 << 40])
def test_a_vote_out_of_range_is_a_clear_error(comm: MPI.Intracomm, vote: int) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    mgr = cgc.manager(comm)
    p = Recorder(5, vote)
    mgr.add_participant(p)
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    seen_all = everyone(comm, seen)
    assert seen_all[0] in ("ValueError", "CollectiveGCError"), (seen_all, p.seen)


def test_a_participant_in_the_scope_policy_field_is_refused_or_kept_apart(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    mgr = cgc.manager(comm)
    p = Recorder(0, 0x80)
    mgr.add_participant(p)
    with cgc.collective_scope(comm, gc="managed", exit_collect=None) as scope:
        try:
            scope.sync()
            seen = "ok"
        except cgc.CollectiveGCError as exc:
            seen = "refused" if "field" in str(exc) else "other"
        full = scope.collections
    # Either the clash is refused, or each participant reads only its own votes
    # (no collection: nothing was allocated to ask for one).
    verdict = everyone(comm, (seen, p.seen, full))
    assert all(v[0] == "refused" for v in verdict) or all(
        v == ("ok", [0x80, 0x80], 0) for v in verdict
    ), verdict


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("with_failure", [False, True])
def test_a_finish_raising_on_one_rank_is_seen_alike(
    comm: MPI.Intracomm, with_failure: bool
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    rank = comm.Get_rank()

    class Fragile(cgc.Participant):
        def finish(self, mgr: cgc.Manager, flags: int) -> None:
            if rank == 0:
                raise RuntimeError("finish failed on rank 0")

    def fails() -> None:
        raise ValueError("destroy failed")

    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, fails if with_failure else noop, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    del o
    mgr.add_participant(Fragile())
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=3))
    verdict = everyone(comm, (seen, mgr.broken is None))
    assert all(v == verdict[0] for v in verdict) and verdict[0][0] != "ok", verdict


def test_a_finish_raising_on_rank_0_is_a_destroy_error_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # On any size, one rank included: the same report as a destroy's.
    mgr = cgc.manager(comm)
    fragile = Finisher("fragile", 0, ValueError("finish failed"), True)
    after = Finisher("after", -1, None, False)
    failures: Any = None
    try:
        sync_with(mgr, fragile, after)
    except cgc.DestroyError as exc:
        failures = exc.failures
        del exc
    verdict = everyone(comm, (failures, list(FINISHED), mgr.broken))
    expected = [(0, -1, "the finish of Finisher", "ValueError: finish failed")]
    assert all(v == (expected, ["fragile", "after"], None) for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 0


def test_a_finish_that_said_it_would_not_raise_is_reported_by_the_next_agreement(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14): it raised on its
    rank only. Now it is kept like a failed destroy of that sync point, and
    the family's next agreement raises it on every rank."""
    mgr = cgc.manager(comm)
    liar = Finisher("liar", 0, ValueError("unexpected"), False)
    after = Finisher("after", -1, None, False)
    seen = outcome_of(lambda: sync_with(mgr, liar, after))
    then = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    verdict = everyone(comm, (seen, then, list(FINISHED), mgr.broken))
    # No collective was left half-way, and every rank is in step.
    assert all(v == ("ok", "DestroyError", ["liar", "after"], None) for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 0


@pytest.mark.mpi(min_size=2)
def test_a_may_raise_that_raises_is_a_yes_and_an_error_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    mgr = cgc.manager(comm)
    asked = Asked(-1, ValueError("may_raise is broken"))
    failures: Any = None
    try:
        sync_with(mgr, asked)
    except cgc.DestroyError as exc:
        failures = [(r, k, n) for r, k, n, _ in exc.failures]
        del exc
    verdict = everyone(comm, (failures, list(FINISHED), mgr.broken))
    expected = [(r, -1, "the may_raise of Asked") for r in range(comm.Get_size())]
    assert all(v == (expected, ["asked"], None) for v in verdict), verdict


@pytest.mark.mpi(min_size=2)
def test_a_quiet_scope_sync_point_makes_no_finish_check(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    # The scope's own participants (its policy, strict mode's flags, derived
    # communicators) say may_raise only when they run code that can raise:
    # a sync point that neither destroys nor collects stays one collective.
    checks: list[int] = []
    real = _agree.any_flags

    def counted(*args: Any, **kwargs: Any) -> int:
        checks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_agree, "any_flags", counted)
    cgc.dup(comm).Free()  # a derived communicator: its participant is on the manager
    with cgc.collective_scope(comm, gc="managed", strict=True, exit_collect=None, timeout=30) as s:
        s.sync()
        gc.collect()  # nothing is due to the collector now: no rank votes for a collection
        before = len(checks)
        for _ in range(5):
            s.sync()
        after = len(checks)
    assert same_on_all(comm, (before, after))
    assert after == before, (before, after)


def test_a_participant_that_does_not_override_finish_adds_no_collective() -> None:
    """Found by the hostile tests of core v2 (issue 14)."""

    class Voter(cgc.Participant):
        field = 3

    assert not Voter().may_raise(0)
    assert Finisher("x", 0, None, True).may_raise(0)
    assert cgc.Participant.may_raise(Recorder(0, 0), 0)  # it overrides finish


def _fails_on_rank_1(rank: int) -> Any:
    def fails_on_rank_1(_: object) -> None:
        if rank == 1:
            raise RuntimeError("this destroy fails on rank 1")

    return fails_on_rank_1


def _a_failure_kept_on_rank_1(comm: MPI.Intracomm) -> str:
    """A sync point of ``comm`` whose one destroy fails on rank 1 only: kept
    there for the family's next agreement. What the sync point raised."""
    owner = Obj()
    cgc.register(owner, _fails_on_rank_1(comm.Get_rank()), None, comm=comm, name="fails on rank 1")
    del owner
    return outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))


@pytest.mark.mpi(min_size=2)
def test_a_bad_vote_leaves_the_failures_it_was_to_report_for_the_next(
    comm: MPI.Intracomm,
) -> None:
    """A destroy that failed on rank 1 only is kept for the family's next
    agreement. When that agreement finds a vote out of range (on rank 0),
    every rank refuses the sync point before destroying anything; the kept
    failure must then be reported by the one after, on every rank, not
    vanish. From a review of the report step (stop 57): the bad vote's error
    dropped the failures its sync point had taken to report."""
    import time

    rank = comm.Get_rank()
    first = _a_failure_kept_on_rank_1(comm)
    bad = Recorder(5, 300 if rank == 0 else 0)
    second = outcome_of(
        lambda: cgc.manager(comm).sync(participants=[bad], deadline=time.monotonic() + 30)
    )
    third = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    verdicts = everyone(comm, (first, second, third))
    assert all(v == ("ok", "CollectiveGCError", "DestroyError") for v in verdicts), verdicts


@pytest.mark.mpi(min_size=2)
def test_a_finish_failing_in_a_closes_last_sync_point_is_reported_everywhere(
    comm: MPI.Intracomm,
) -> None:
    """A close runs final sync points until one destroys nothing; the last of
    them has no agreement after it. A finish (one that says it never raises)
    failing there on rank 0 was kept for a next agreement that never came:
    lost, with no error on any rank. A final sync point asks whether
    anything failed, so that close raises DestroyError on every rank. From
    a review of the report step (stop 57)."""
    lib = comm.Dup()
    try:
        mgr = cgc.manager(lib)
        cgc.collect(lib, generation=None)  # the family exists
        mgr.add_participant(Finisher("last", 0, RuntimeError("fails on rank 0"), False))
        closed = outcome_of(mgr.close)
    finally:
        lib.Free()
    verdicts = everyone(comm, closed)
    assert verdicts == ["DestroyError"] * comm.Get_size(), verdicts


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_from_a_finish_is_its_ranks_beside_kept_failures(
    comm: MPI.Intracomm,
) -> None:
    """A destroy failed on rank 1 at the sync point before, kept for this
    one; here a finish raises KeyboardInterrupt on rank 0. Every rank reports
    both, and rank 0 raises the interrupt (a finish's documented promise:
    an interrupt is re-raised on its rank), the others DestroyError. From a
    review of the report step (stop 57): the interrupt became a DestroyError
    whenever failures of an earlier sync point were reported beside it."""
    first = _a_failure_kept_on_rank_1(comm)
    mgr = cgc.manager(comm)
    second = outcome_of(
        lambda: sync_with(mgr, Finisher("ki", 0, KeyboardInterrupt("on rank 0"), True))
    )
    third = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    verdicts = everyone(comm, (first, second, third))
    assert verdicts[0] == ("ok", "KeyboardInterrupt", "ok"), verdicts
    assert all(v == ("ok", "DestroyError", "ok") for v in verdicts[1:]), verdicts


@pytest.mark.mpi(min_size=2)
def test_a_close_destroys_what_a_failing_destroy_dropped_after_a_report(
    comm: MPI.Intracomm,
) -> None:
    """A close runs final sync points while they destroy something, and stops
    after two in a row raised (a finish that raises at every one). Its first
    reports a failure kept from before (on rank 1) and destroys nothing; its
    second runs a destroy that drops another managed object and fails: two
    raised in a row, yet the second destroyed something, and what it dropped
    must be destroyed by a third, not detached as a leak. From a review of
    the report step (stop 57)."""
    rank = comm.Get_rank()
    lib = comm.Dup()
    log: list[str] = []

    def drops_then_fails(held: list[object]) -> None:
        held.clear()
        raise RuntimeError("this destroy fails after dropping one more")

    try:
        with GcDisabled():
            owner = Obj()
            cgc.register(owner, _fails_on_rank_1(rank), None, comm=lib, name="fails on rank 1")
            del owner
            first = outcome_of(lambda: cgc.collect(lib, generation=None, timeout=30))
            last, held = Obj(), [Obj()]
            cgc.register(held[0], log.append, "dropped", comm=lib, name="dropped")
            cgc.register(last, drops_then_fails, held, comm=lib, name="drops then fails")
            del last, held
            closed = outcome_of(lambda: cgc.manager(lib).close(timeout=30))
    finally:
        lib.Free()
    verdicts = everyone(comm, (first, closed, log))
    assert all(v == ("ok", "DestroyError", ["dropped"]) for v in verdicts), verdicts


class RaisingVote(cgc.Participant):
    """A vote that raises on one rank (a participant's bug there)."""

    field = 5

    def __init__(self, rank: int, error: type[BaseException] = ValueError) -> None:
        self.rank, self.error = rank, error

    def vote(self, mgr: cgc.Manager) -> int:
        if mgr.rank == self.rank:
            raise self.error(f"this vote fails on rank {self.rank}")
        return 0


@pytest.mark.mpi(min_size=2)
def test_a_vote_raising_on_one_rank_is_refused_on_every_rank(comm: MPI.Intracomm) -> None:
    """A participant's vote raises on rank 0 only: the sync point is refused
    on every rank alike, as for a vote outside 0..255 (nothing destroyed, the
    family still usable), and rank 0's error says what the vote raised.
    From a review of the report step (stop 57): the exception left rank 0's
    sync point before its agreement, and the other ranks waited there until
    their deadline, or for ever without one."""
    import time

    log: list[str] = []
    owner = Obj()
    cgc.register(owner, log.append, "destroyed", comm=comm)
    del owner
    message = ""
    try:
        cgc.manager(comm).sync(participants=[RaisingVote(0)], deadline=time.monotonic() + 20)
        seen = "ok"
    except cgc.CollectiveGCError as exc:
        seen, message = type(exc).__name__, str(exc)
    before = list(log)
    then = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    named = "RaisingVote's vote raised ValueError: this vote fails on rank 0" in message
    verdicts = everyone(comm, (seen, named, before, then, log))
    assert verdicts[0] == ("CollectiveGCError", True, [], "ok", ["destroyed"]), verdicts
    assert all(v == ("CollectiveGCError", False, [], "ok", ["destroyed"]) for v in verdicts[1:])


def _with_a_childs_participant(comm: MPI.Intracomm, part: RaisingVote) -> list[Any]:
    """Every rank's outcomes of three sync points of ``comm`` (the first with
    ``part`` added to a child family made by splitting ``comm`` in reverse
    rank order, whose rank 0 is ``comm``'s last), the child freed after."""
    rank = comm.Get_rank()
    child = cgc.split(comm, 0, key=-rank)
    cgc.collect(child, generation=None, timeout=30)  # the child's family exists
    cgc.collect(comm, generation=None, timeout=30)  # and is the parent's child
    # A quiet finish: else the look would want a visit before asking the vote.
    part.quiet_finish = True
    cgc.manager(child).add_participant(part)
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=20))
    cgc.manager(child).remove_participant(part)
    # (Known on the child's ranks at the visit, it is reported by the
    # parent's next agreement.)
    then = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    after = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    del child
    for _ in range(3):
        cgc.collect(comm, generation=None, timeout=30)  # frees the child
    return everyone(comm, (seen, then, after))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_vote_raising_an_interrupt_on_one_rank_is_held_there_and_refused_elsewhere(
    comm: MPI.Intracomm, interrupt: type[BaseException]
) -> None:
    """A participant's vote raises KeyboardInterrupt or SystemExit (its
    ``sys.exit()``) on rank 0 only: rank 0 still takes part in the
    agreement, which refuses the sync point on every rank alike (nothing
    destroyed, the family usable), and then raises its interrupt, with a
    note naming the refusal; the other ranks raise the refusal. From the
    review of stop 57's diff: only an Exception was caught, and an
    interrupt left rank 0's sync point before its agreement."""
    import time

    log: list[str] = []
    owner = Obj()
    cgc.register(owner, log.append, "destroyed", comm=comm)
    del owner
    noted = False
    try:
        vote = RaisingVote(0, interrupt)
        cgc.manager(comm).sync(participants=[vote], deadline=time.monotonic() + 20)
        seen = "ok"
    except (interrupt, cgc.CollectiveGCError) as exc:
        seen = type(exc).__name__
        noted = any("nothing was destroyed" in n for n in getattr(exc, "__notes__", []))
    before = list(log)
    then = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    verdicts = everyone(comm, (seen, noted, before, then, log))
    assert verdicts[0] == (interrupt.__name__, True, [], "ok", ["destroyed"]), verdicts
    assert all(v == ("CollectiveGCError", False, [], "ok", ["destroyed"]) for v in verdicts[1:])


@pytest.mark.mpi(min_size=2)
def test_a_held_vote_interrupt_is_raised_when_the_sync_point_then_times_out(
    comm: MPI.Intracomm,
) -> None:
    """Rank 0's vote raises KeyboardInterrupt (held for the end of the
    collectives), then rank 0's deadline passes while the others are late.
    Rank 0 raises the interrupt, what its user asked for, with the timeout as
    its context, and its family is unusable; the late ranks learn of the
    timeout. From the reviews of stop 58: the interrupt was only a note on
    the CollectiveTimeoutError, which code that catches timeouts and tries
    again swallows with it."""
    import time

    rank = comm.Get_rank()
    cgc.collect(comm, generation=None, timeout=30)  # the family: made in time
    raised: tuple[str, str] = ("nothing", "nothing")
    try:
        if rank == 0:
            vote = RaisingVote(0, KeyboardInterrupt)
            cgc.manager(comm).sync(participants=[vote], deadline=time.monotonic() + 0.5)
        else:
            time.sleep(2.0)  # rank 0 times out meanwhile
            cgc.collect(comm, generation=None, timeout=30)
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
        raised = (type(exc).__name__, type(exc.__context__).__name__)
    broken = cgc.manager(comm).broken is not None
    verdicts = everyone(comm, (raised, broken))
    assert verdicts[0] == (("KeyboardInterrupt", "CollectiveTimeoutError"), True), verdicts
    assert all(v[0][0] == "CollectiveTimeoutError" and v[1] for v in verdicts[1:]), verdicts


_CHILD_INTERRUPT_JOB = (
    JOB_HEAD
    + """
import time

from collective_gc.testing import family


class InterruptingVote(cgc.Participant):
    field = 5
    quiet_finish = True

    def vote(self, mgr):
        if mgr.rank == 0:
            raise KeyboardInterrupt("a child's vote on its rank 0")
        return 0


def outcome(fn):
    try:
        fn()
    except BaseException as exc:
        return type(exc).__name__
    return "ok"


final = sys.argv[2] == "final"
comm = MPI.COMM_WORLD.Dup()
inside = rank < 2
child = cgc.split(comm, 0 if inside else MPI.UNDEFINED, key=rank)
if inside:
    cgc.collect(child, generation=None, timeout=30)
cgc.collect(comm, generation=None, timeout=30)
if inside:
    cgc.manager(child).add_participant(InterruptingVote())
o = Obj()
cgc.register(o, time.sleep, 2.5 if rank == 1 else 0.0, comm=comm)
del o
raised = ("nothing", "nothing")
try:
    cgc.manager(comm).sync(deadline=time.monotonic() + 1.0, final=final)
except BaseException as exc:
    raised = (type(exc).__name__, type(exc.__context__).__name__)
time.sleep(3.0)  # the late rank's notice has come
broken = cgc.manager(comm).broken is not None
# The parent's ranks outside the child learn it at their next collective.
then = outcome(lambda: cgc.collect(comm, generation=None, timeout=10))
print(raised, broken, then in ("CollectiveGCError", "CollectiveTimeoutError"), flush=True)
"""
)


@pytest.mark.launcher
@pytest.mark.parametrize("final", ["final", "not final"])
def test_a_childs_held_vote_interrupt_is_raised_when_the_child_then_times_out(
    tmp_path: Path, final: str
) -> None:
    """A child family of two ranks: its vote raises KeyboardInterrupt on its
    rank 0 (held for the end of its collectives), and its other rank is
    late into the visit (a destroy of the parent's sleeps past the
    deadline), so the child's sync point times out. Rank 0 must raise the
    interrupt, the timeout its context, and the parent must be abandoned
    there as on the late rank (the timeout's path), whether or not the
    parent's sync point is final; the others learn it at their next
    collective. From a review of this stop's change: the visit took the
    interrupt for an ordinary failure, so a final parent raised its own
    timeout, the interrupt dropped, and a non-final one stayed usable on
    rank 0 only. A job of its own: the late rank's notices, sent once the
    others had given up, stay unreceived on the families' duplicates, and
    MPICH, reusing a freed one's context, delivered one to a later test's
    communicator."""
    proc, outs, errs, _ = run_job(
        tmp_path, _CHILD_INTERRUPT_JOB.replace("sys.argv[2]", repr(final))
    )
    report = job_report(proc, outs, errs)
    lines = [out.strip() for out in outs]
    assert lines[0] == "('KeyboardInterrupt', 'CollectiveTimeoutError') True True", report
    assert lines[1].endswith(" True True"), report
    assert all(line.endswith(" True") for line in lines[2:]), report


@pytest.mark.mpi(min_size=2)
def test_a_childs_vote_raising_an_interrupt_on_one_rank_is_raised_there_only(
    comm: MPI.Intracomm,
) -> None:
    """As for a vote that raises an Exception: the parent's look at the
    child takes a vote raising SystemExit on one rank for a wish to visit
    (raised there, it would leave the parent's sync point before its
    agreement on that rank only), the child's own sync point holds the
    interrupt until its collectives are done and refuses the vote on
    every rank; the interrupt is raised on its rank, and the parent's next
    agreement reports the refusal on every rank."""
    last = comm.Get_size() - 1
    verdicts = _with_a_childs_participant(comm, RaisingVote(0, SystemExit))
    expected = [
        ("SystemExit" if r == last else "ok", "DestroyError", "ok") for r in range(len(verdicts))
    ]
    assert verdicts == expected, verdicts


class NoneVote(RaisingVote):
    """A vote that is not an int on one rank (a participant's bug there)."""

    def vote(self, mgr: cgc.Manager) -> Any:
        return None if mgr.rank == self.rank else 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", [RaisingVote, NoneVote])
def test_a_childs_vote_raising_on_one_rank_is_reported_on_every_rank(
    comm: MPI.Intracomm, kind: type[RaisingVote]
) -> None:
    """A parent's sync point asks each child whether it has something (its
    participants' votes, looked at); a vote raising there on rank 0 sends
    the parent to visit the child, whose own sync point refuses it on every
    rank: the parent reports that, on every rank (at its next agreement,
    as any failure of a visit). So does a vote that is not an int (None)
    there, in both twins. From a review of the report step (stop 57): the
    look raised on rank 0 alone, before the parent's agreement; and (stop
    58) the Python look took a None vote for no wish, the C one for a bad
    vote."""
    verdicts = _with_a_childs_participant(comm, kind(0))
    assert all(v == ("ok", "DestroyError", "ok") for v in verdicts), verdicts
