"""A sync point, as the sequence of its steps.

A family's sync point on this rank (see :mod:`collective_gc._collective`:
the communicators congruent with one another share one), from a dead
object's point of view: its finalizer appended its registration to the
family's inbox. Then:

1. prepare: the participants' votes, which derived families (strict
   subsets: ``cgc.split``) this rank has something for, the failures kept
   from earlier sync points, and the drain of the inbox into the pending keys;
2. agree: one collective over the private communicator says which keys are
   pending on every rank, ORs the flags, votes and derived families' bits,
   and checks that every rank is at the same sync point; if some rank holds
   failures that no sync point has reported yet, they are reported now, on
   every rank, and nothing else is done;
3. destroy: those keys' destroys, newest first (:func:`._destroy.run`);
4. visit: the sync points of the derived families some rank wanted;
5. release: what waits to let go (a freed communicator's manager, a dropped
   ``cgc.dup``) once nothing is registered on it;
6. check (a final sync point only: a scope's exit, a close, the exit
   agreement, the pytest plugin): one more word says whether anything
   failed anywhere;
7. finish: the participants act on the agreed flags (one more word if any
   of them might raise);
8. report: what failed is raised on every rank if a collective of this sync
   point said so; else it is kept, and the family's next agreement reports
   it (step 2).

They are listed once, in :data:`STEPS`; :meth:`SyncPoint.run` runs them in
that order, and a tracer wraps each. Each step decides from agreed values
whether it has anything to do, so every rank takes the same branches and
makes the same collectives; in the steady state (nothing unusual anywhere)
each takes its fast case. Where the extension is built, a sync point that
turns out steady runs all of them in one C call
(:meth:`~collective_gc._state.FamilyState.steady`), which hands the rest to
these steps, from the step it stopped at, when it finds anything unusual.

A sync point whose destroys succeed makes one collective, and one whose
destroys fail costs nothing more: its failures are agreed by the next
collective of the family, which the program makes anyway (the next sync
point, the scope's exit, a close, exit). One :class:`SyncPoint` holds what a
sync point carries from step to step; the family's
:class:`~collective_gc._state.FamilyState` what its sync points share.

Participants (:class:`Participant`) are what takes part in a sync point
beside the destroys: a scope's GC policy, PETSc's own garbage cleanup. Each
may vote in a byte (its field) of the agreed flags and act on the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, get_type_hints

import numpy as np
from mpi4py import MPI

from . import _agree, _destroy, _tracing, _tree
from ._agree import FLAG_BAD_VOTE, FLAG_CYCLIC, FLAG_FAILED, FLAG_LEAVING
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    raise_in_place_of,
)
from ._registration import where
from ._tracing import Phases, Tracer
from ._transport import DONE, LATE, Deadline, allgather, gave_up_error, late_text

if TYPE_CHECKING:
    from ._collective import Collective
    from ._manager import Manager
    from ._state import FamilyState

__all__ = [
    "CollectStats",
    "Participant",
    "SyncPoint",
    "STEPS",
    "AGREE",
    "identities",
    "what_raised",
    "may_raise_ever",
    "keep_failures",
    "SCOPE_EXIT",
]


class CollectStats(NamedTuple):
    """What one sync point did on this rank.

    Attributes:
        destroyed: destroys run at this sync point (the same on every rank).
        pending: destroy requests still queued on this rank afterwards (keys
            not yet queued on every rank).
        cyclic: finalizations drained at this sync point that happened inside
            the cyclic collector.
        seconds: wall time of the sync point on this rank, including the local
            ``gc.collect``.
        sync: the sync-point number on this communicator's family (0 for the first).
        collected: what the local ``gc.collect`` returned, or None if skipped.
        visits: how many derived families (strict subsets: ``cgc.split``)
            some rank wanted visited at this sync point (the same on every
            rank; their destroys, which may drop more objects, are theirs).
    """

    destroyed: int
    pending: int
    cyclic: int
    seconds: float
    sync: int
    collected: int | None = None
    visits: int = 0


# This module's annotations are strings (``from __future__ import annotations``),
# which NamedTuple hands its generated __new__ unresolved, so help() and
# inspect.signature showed ``destroyed: ForwardRef('int')``: resolve them once.
CollectStats.__annotations__ = get_type_hints(CollectStats)
CollectStats.__new__.__annotations__ = dict(CollectStats.__annotations__)


class Participant:
    """Something that takes part in a family's sync points (subclass it).

    ``field`` (0..5, or None) is the byte of the agreed flags it votes in,
    fixed by its kind so that every rank reads the same byte. Every method
    runs on every rank of the communicator at every sync point, in the order
    participants were added (sync points' own participants last), with the
    manager it was added on (its communicator, rank and size).

    ``quiet_finish``: True if :meth:`finish` does nothing when its own byte
    of the agreed flags and the sync point's own flags (the low byte) are
    all 0: then it is not called (so such a sync point can take the steady
    state, which calls it only when its byte is set); False (the default)
    calls it at every sync point, which then never takes the steady state.
    """

    field: int | None = None
    quiet_finish: bool = False

    def vote(self, mgr: Manager) -> int:
        """This rank's byte (0..255), ORed over the ranks. Local, no MPI.
        It may be asked more than once a sync point, and between them (a
        parent family's sync point asks whether this one has something): a
        read, which changes nothing."""
        return 0

    def voter(self, mgr: Manager) -> Callable[[int], int]:
        """The vote as the steady state calls it, bound once at install:
        given the family's count of completed sync points, or -1 when a
        parent family's sync point only looks (whether this one has
        something for it: which ranks look differs, so a look must change
        nothing), it returns what :meth:`vote` would. The default calls
        :meth:`vote`; a participant whose vote is a C function returns it,
        so that a steady sync point runs no Python frame for it."""
        vote = self.vote

        def voted(clock: int) -> int:
            return vote(mgr)

        return voted

    def finish(self, mgr: Manager, flags: int) -> None:
        """After the destroys, with the agreed flags. May make collective
        calls on ``mgr.comm``.

        If it raises on any rank (when :meth:`may_raise` said it could), every
        rank raises :class:`DestroyError` naming it, after the other
        participants' finishes ran (an interrupt is re-raised on its rank)."""

    def may_raise(self, flags: int) -> bool:
        """Whether :meth:`finish`, given the agreed ``flags``, might raise on
        some ranks only. Then the sync point runs one more small collective
        after the finishes, so that a failure anywhere is raised on every
        rank at once. Answer from ``flags`` alone, so that every rank answers
        alike.

        It must not raise (if it does, alike on every rank, that counts as a
        yes and is reported). The default: True if the class overrides
        :meth:`finish`. A finish that raises where this said False is
        reported like a failed destroy of that sync point: on every rank by
        the family's next collective."""
        return type(self).finish is not Participant.finish

    def identity(self) -> str:
        """What the participant at the same place in every rank's sync point
        must share (its class and field, by default; a subclass adds what
        changes which collectives it makes). The agreement compares a
        fingerprint of these: ranks whose sync points have different
        participants (a scope's ``gc=`` or ``strict=`` differing between
        ranks, two threads' sync points paired differently) raise
        :class:`CollectiveMismatchError` on every rank, before anything is
        destroyed or any participant's collective is made."""
        return f"{type(self).__module__}.{type(self).__qualname__}/{self.field}"

    def votes(self, flags: int) -> int:
        """This participant's byte of the agreed ``flags``."""
        if self.field is None:
            return 0
        return (flags >> _agree.field_shift(self.field)) & 0xFF

    def view_rows(self, mgr: Manager) -> Iterable[tuple[str, str]]:
        """Rows for :func:`collective_gc.view` of ``mgr``'s communicator:
        ``(type name, description)`` of what this rank holds that collective_gc
        does not manage (PETSc's garbage, say). Local; no MPI."""
        return ()

    def leak_reasons(self, mgr: Manager) -> Iterable[str]:
        """Why objects registered on ``mgr``'s communicator are still alive
        on this rank, where it can tell (an owner kept alive by its own
        resource): for leak reports. Local; no MPI."""
        return ()


def identities(parts: Sequence[Participant]) -> str:
    """The participants' identities, joined (what the agreement fingerprints)."""
    return "\0".join(p.identity() for p in parts)


def may_raise_ever(p: Participant) -> bool:
    """Whether ``p``'s finish may raise for some agreed flags (a
    ``may_raise`` that raises says yes)."""
    try:
        return bool(p.may_raise(-1))
    except Exception:  # noqa: BLE001 (see Participant.may_raise)
        return True


def what_raised(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, whatever its ``str()`` does (it may raise too)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (whose str() raised)"


class SyncPoint:
    """One sync point of a family on this rank, run as its steps (see the
    module docs).

    The failures it collects hold tracebacks, whose frames hold this record:
    :meth:`run` drops them as it ends, however it ends (those kept for the
    family's next agreement move to the family), so that no reference cycle
    (with a user's objects in it, perhaps) outlives the sync point and waits
    for the cyclic collector.
    """

    __slots__ = (
        "fam",
        "core",
        "dl",
        "at_exit",
        "final",
        "parts",
        "owners",
        "identities",
        "fingerprint",
        "seq",
        "flags",
        "wanted",
        "offer",
        "keys",
        "cyclic",
        "count",
        "visited",
        "agreed",
        "resumed",
        "reporting",
        "quiet",
        "way",
        "phases",
        "bad",
        "failures",
        "caught",
        "sink",
    )

    def __init__(
        self,
        fam: Collective,
        deadline: Deadline,
        extra: Sequence[Participant],
        owner: Manager,
        at_exit: bool,
        final: bool,
        sink: list[tuple[int, _destroy.Failure]] | None = None,
    ) -> None:
        self.fam = fam
        self.core = fam.core
        # Where failures known on this rank only go (see report): the
        # family's, or a parent's visit (it reports them to all its ranks).
        self.sink = sink
        self.dl, self.at_exit, self.final = deadline, at_exit, final
        self.parts: Sequence[Participant] = fam.participants
        self.owners: Sequence[Manager] = fam.owners
        self.identities = fam.identities
        self.fingerprint = fam.fingerprint
        if extra:
            self._check_fields(extra)
            self.parts = fam.participants + list(extra)
            self.owners = fam.owners + [owner] * len(extra)
            self.identities = identities(self.parts)
            self.fingerprint = _agree.fingerprint(self.identities)
        self.seq = self.core.seq
        self.flags = 0
        self.wanted = 0  # the derived families' bits: this rank's, then agreed
        self.offer = _tree.NO_OFFER  # unreached families it may adopt (prepare, visit)
        self.keys: np.ndarray[Any, Any] = _NO_KEYS
        self.cyclic = 0
        self.count = 0
        self.visited = False
        self.agreed = False  # whether a collective of this sync point agreed on its failures
        self.resumed = False  # the steady state made this sync point's exchange
        self.reporting = False  # some rank kept failures: this one only reports them
        # Whether nothing unusual was known here before the exchange (the
        # steady state's first look), and which way the sync point went:
        # "steady" (every step took its fast case), "failed" (the same, but
        # destroys or finishes raised), "resume" (the exchange found
        # something unusual), "watch" (a rank gave up meanwhile), "steps".
        self.quiet = False
        self.way = "steps"
        self.phases: Phases | None = None  # traced: where the exchange marks its wait
        self.bad: list[str] = []  # participants' votes outside 0..255 or raising, on this rank
        # (sync point, failure): what failed here, and what the family kept
        # for this sync point's agreement to report.
        self.failures: list[tuple[int, _destroy.Failure]] = []
        # Interrupts of the sync point's own steps (not from a signal: those
        # wait for the end of the protected region: a second Ctrl-C between two
        # runs of destroys, an exception's str()), raised on this rank once the
        # collectives are done.
        self.caught: list[BaseException] = []

    def run(self, collected: int | None, t0: float, start: int = 0) -> CollectStats:
        """The steps, in order (:data:`STEPS`), from ``start``. Collective:
        from the agreement on, whether a step does anything depends on agreed
        values only (the keys, the flags, the participants), so every rank
        runs the same collectives. ``start`` is AGREE where the C steady
        state prepared this sync point and made its exchange, which found
        something unusual: the steps go on from there."""
        if start == AGREE:
            self.resumed = self.quiet = True
        tracer = _tracing.TRACER
        try:
            if tracer is None:
                for _, step in STEPS[start:]:
                    step(self)
            else:
                self._traced(tracer, t0, start)
        except BaseException as exc:
            # Left by an error of its collectives (a timeout, a mismatch)
            # while holding an interrupt of its own (a vote's): the interrupt
            # is raised, the error its context, as a wait's held interrupt is
            # (a program that catches timeouts and tries again would swallow
            # a mere note); one raised meanwhile is named on it. (In
            # functions of their own: this frame is in the traceback, and
            # must not hold another exception.)
            if isinstance(exc, Exception):
                held = _held(self.caught, self.failures, self.seq)
                if held:
                    raise_in_place_of(held[0], exc)
                    _raise_own(held)
            _name_held(exc, self.caught)
            raise
        finally:
            self.failures = self.caught = _NONE  # see the class docs
        return self._stats(collected, t0)

    def _traced(self, tracer: Tracer, t0: float, start: int) -> None:
        """:meth:`run`'s loop, each step that did something timed and handed
        to ``tracer`` (see collective_gc._tracing)."""
        clock = time.perf_counter
        phases: Phases = []
        self.phases = phases
        outcome = "ok"
        fam = self.fam
        tracer.sync_point_began(fam.name, fam.rank, self.seq, t0)
        try:
            for name, step in STEPS[start:]:
                began = clock()
                if step(self) is not False:
                    phases.append((name, began, clock()))
        except BaseException as exc:
            outcome = type(exc).__name__
            phases.append((name, began, clock()))
            raise
        finally:
            tracer.sync_point(
                fam.name, fam.rank, self.seq, t0, clock(), phases, self.count, outcome
            )

    def _stats(self, collected: int | None, t0: float) -> CollectStats:
        core = self.core
        return CollectStats(
            self.count,
            len(core.pending_keys()[0]) // 8 + len(core.inbox),
            self.cyclic,
            time.perf_counter() - t0,
            self.seq,
            collected,
            self.wanted.bit_count(),
        )

    # -- 1. prepare ------------------------------------------------------------

    def prepare(self) -> None:
        """The votes, the derived families this rank has something for, the
        failures kept from earlier sync points, the drain."""
        fam, core = self.fam, self.core
        quiet = fam.size > 1 and core.quiet() and all(p.quiet_finish for p in self.parts)
        if fam.size > 1:
            self.offer = _tree.reach(fam)
        if self.parts:
            self.flags = self._votes()
        self.wanted = _tree.wanted(fam) | self.offer.wanted
        self.flags |= self.offer.unripe
        if fam.recorded:
            self.flags |= FLAG_LEAVING
        if core.unreported:
            # Failures of earlier sync points, which this one reports: on
            # every rank, since the agreement tells every rank of them.
            self.failures.extend(core.take_unreported())
            self.flags |= FLAG_FAILED
        # (Always: the drain also cuts the interval the exchange reports.)
        self.cyclic = fam.registry.drain(self.seq)
        if self.cyclic:
            self.flags |= FLAG_CYCLIC
        self.quiet = quiet and not self.flags & (FLAG_CYCLIC | FLAG_BAD_VOTE | FLAG_FAILED)

    # -- 2. agree ----------------------------------------------------------------

    def agree(self) -> None:
        """The keys pending on every rank, and the agreed flags. Collective.
        Resumed (the steady state made the exchange), it reads what that found."""
        fam, core = self.fam, self.core
        r = fam.registry
        if fam.size == 1:
            raw, _ = core.pending_keys()
            self.keys = np.frombuffer(raw, np.int64) if raw else _NO_KEYS
            core.agreed(-1)
        else:
            # From here until the last collective, leaving by an exception on
            # this rank only makes the family unusable (see Collective.sync).
            what = fam.what("its agreement")
            self.dl.watch = core
            if self.resumed:
                # The steady state's exchange ended by a rank's notice (it
                # names that rank), or by this rank's own deadline (this
                # rank gave up: its notice names it).
                gone = core.gone
                found = DONE if gone is None else LATE if gone[0] == fam.rank else WATCHED_NOW
            else:
                began = time.perf_counter()
                found = core.exchange(
                    self.at_exit,
                    self.flags,
                    self.fingerprint,
                    self.wanted,
                    self.dl.at,
                )
                if self.phases is not None:
                    # Packing apart (a few stores), the allreduce's wait for the others.
                    self.phases.append(("wait", began, time.perf_counter()))
            if found == LATE:
                raise CollectiveTimeoutError(what() + late_text(core))
            if found != DONE:
                if self.quiet:
                    self.way = "watch"
                raise gave_up_error(core, what)
            if self.quiet:
                self.way = "steady" if core.plain(self._raising()) else "resume"
            agreed = _agree.resolve(core, self.dl, what)
            if agreed.mismatch:
                raise self._mismatch(core.comm)
            # The agreed next key (the one every rank sent: a registration on
            # another thread meanwhile is the next sync point's).
            core.agreed(core.reduced()[2])
            self.keys, self.flags, self.wanted = agreed.keys, agreed.flags, agreed.children
        del r
        if self.flags & FLAG_BAD_VOTE:
            # Seen alike by every rank, before anything is destroyed: the keys
            # stay pending, and the family stays usable; the failures taken
            # to report go back, for the next agreement (first: an interrupt
            # after left() is this rank's alone). (An interrupt held
            # meanwhile is raised in its place by the protected region's end.)
            core.keep(self.failures)
            self.failures.clear()
            core.left()
            refused = CollectiveGCError(
                f"rank {fam.rank}: a participant of the {fam.label} voted outside "
                f"0..255, or its vote raised, at sync point {self.seq} (here: "
                f"{'; '.join(self.bad) or 'none'}); nothing was destroyed"
            )
            if self.caught:
                # A vote raised an interrupt here (KeyboardInterrupt,
                # SystemExit): it, not the refusal, is this rank's to raise.
                self.caught[0].add_note(f"collective_gc: {refused}")
                del refused
                _raise_own(self.caught)
            raise refused
        if self.flags & FLAG_FAILED:
            # Failures kept by earlier sync points: reported now, on every
            # rank, instead of destroying (the participants still see the
            # flags: PETSc's refuses the family if one of them was its own).
            self.agreed = self.reporting = True

    # -- 3. destroy --------------------------------------------------------------

    def destroy(self) -> bool:
        """The agreed keys' destroys, newest first, on every rank alike."""
        if not self.keys.size or self.reporting:
            return False
        self.count, more, interrupt = _destroy.run(self.core, self.keys)
        seq = self.seq
        self.failures.extend((seq, f) for f in more)
        if interrupt is not None:
            self.caught.append(interrupt)
        # A frame on the failures' tracebacks (through f_back) must not hold them.
        del more, interrupt
        return True

    # -- 4. visit ------------------------------------------------------------------

    def visit(self) -> bool:
        """The unreached families every rank of each has offered become
        children (see collective_gc._tree.adopt); then the sync points of the
        derived families some rank wanted (each collective over that family:
        its ranks all saw the same bit)."""
        if self.offer.ripe:
            _tree.adopt(self.fam, self.offer, self.flags)
            self.offer = _tree.NO_OFFER
        if not self.wanted or self.reporting:
            return False
        _tree.visit(self.fam, self.wanted, self.dl.at, self.failures, self.seq)
        self.visited = True
        return True

    # -- 5. release ----------------------------------------------------------------

    def release(self) -> bool:
        """What waits to let go once nothing is registered on it tries again
        (the counts it reads are the same on every rank after agreed destroys)."""
        fam = self.fam
        if self.reporting or not (fam.leaving or self.flags & FLAG_LEAVING):
            return False
        if self.flags & FLAG_LEAVING:
            # Some rank recorded a freed member: the oldest n leave, n the
            # fewest any rank has recorded (one more word of the family's,
            # only then: rare). Bit i of the word says "n <= i" (up to 8).
            mine = min(len(fam.recorded), 8)
            fewer = (0xFF << mine) & 0xFF
            if fam.size > 1:
                fewer = _agree.any_flags(
                    self.core, fewer, self.dl, fam.what("its check of freed members")
                )
            fam.take_recorded(((fewer & -fewer) or 0x100).bit_length() - 1)
        fam.release()
        return True

    # -- 6. check ----------------------------------------------------------------

    def check(self) -> bool:
        """At a final sync point that destroyed or visited something: whether
        anything failed anywhere. Collective (decided from agreed values and
        the kind of sync point, alike on every rank)."""
        if not self.final or self.reporting or not (self.keys.size or self.visited):
            return False
        seen = len(self.bad)
        after = self._votes() & ~FLAG_BAD_VOTE
        if len(self.bad) > seen:
            # After the destroys, a bad vote is one more failure to report.
            refused = CollectiveGCError("; ".join(self.bad[seen:]))
            self.failures.append((self.seq, (-1, "a participant's vote", refused)))
            del refused
        after |= FLAG_FAILED if self.failures else 0
        if self.fam.size > 1:
            after = _agree.any_flags(self.core, after, self.dl, self.fam.what("its error check"))
        self.flags = after | (self.flags & FLAG_CYCLIC)
        self.agreed = True
        return True

    # -- 7. finish ---------------------------------------------------------------

    def finish(self) -> bool:
        """Every participant's finish, whatever raises; then, if any of them
        said it might raise (agreed, so on every rank alike) or the sync
        point is final, one more word says whether anything failed anywhere
        (FLAG_FAILED in the flags)."""
        if not self.parts:
            return False
        # Whether to check is asked of every participant before any finish
        # runs, from agreed values only, so it is decided alike on every rank.
        # No signal's handler runs in between (the sync point is a protected
        # region): what raises is the participants' own code.
        # (No local name for the failures: a frame in their tracebacks would
        # hold them; the record's end drops them, see the class docs.)
        flags, seq = self.flags, self.seq
        # A quiet participant with nothing to do is not called (agreed flags:
        # alike on every rank; what the steady state does too).
        own = flags & _SYNC_FLAGS
        running = [
            (p, o)
            for p, o in zip(self.parts, self.owners)
            if not p.quiet_finish or own or p.votes(flags)
        ]
        if not running:
            return False
        # A final sync point (a close's, the exit's) may have no agreement
        # after it to report what fails here: it always asks.
        check = self.final
        for p, _ in running:
            try:
                check = p.may_raise(flags) or check
            except BaseException as exc:  # a yes (alike on every rank: see may_raise)
                check = True
                self.failures.append((seq, (-1, f"the may_raise of {type(p).__name__}", exc)))
        for p, owner in running:
            try:
                p.finish(owner, flags)
            except BaseException as exc:  # every participant finishes; reported after
                self.failures.append((seq, (-1, f"the finish of {type(p).__name__}", exc)))
        if check:
            mine = FLAG_FAILED if self.failures else 0
            if self.fam.size > 1:
                mine = _agree.any_flags(self.core, mine, self.dl, self.fam.what("its finish check"))
            self.flags |= mine  # on a family of size 1, reported as on a larger one
            self.agreed = True
        return True

    # -- 8. report ---------------------------------------------------------------

    def report(self) -> bool:
        """Raise on every rank what failed on any, if a collective of this sync
        point agreed on it; else keep it for the family's next agreement. Then
        this rank's interrupt.

        (No exception is held in a local name of these frames: they are in
        the raised exception's traceback, and would close a cycle with it.)"""
        core = self.core
        if not (self.failures or self.caught or self.flags & FLAG_FAILED):
            core.left()
            return False
        if self.flags & FLAG_FAILED and self.agreed:
            self._raise_agreed()
        core.left()
        if self.caught:
            self.caught[0].add_note(
                "collective_gc: it was held until the sync point's collectives were "
                "done, so that every rank ran the same destroys"
            )
        if self.failures and self.way == "steady":
            self.way = "failed"
        if self.failures:
            # Known here only: the family's next agreement reports them on every
            # rank (or the parent's, for a visit); an interrupt among them is
            # raised here too, now.
            if self.sink is None:
                core.keep(self.failures)
            else:
                self.sink.extend(self.failures)
            self.caught.extend(_interrupts_among(self.failures, self.seq, self.fam.rank))
        if self.caught:
            _raise_own(self.caught)
        return True

    def _raise_agreed(self) -> None:
        """Every rank's failures, gathered and raised on every rank."""
        fam = self.fam
        failures = [f for _, f in self.failures]
        seqs = sorted({s for s, _ in self.failures})
        rows = _destroy.rows_of(failures, fam.rank, self.caught)
        del failures
        if fam.size > 1:
            everyone = _agree.gather(self.core, (rows, seqs), self.dl, fam.what("its error report"))
            rows = [row for per_rank, _ in everyone for row in per_rank]
            seqs = sorted({s for _, per_rank in everyone for s in per_rank})
        self.core.left()
        where = f"sync point {self.seq} on the {fam.label}"
        earlier = bool(seqs) and seqs != [self.seq]
        if earlier:
            where = (
                f"sync point{'s' if len(seqs) > 1 else ''} {', '.join(map(str, seqs))} "
                f"on the {fam.label} (reported at sync point {self.seq}, the family's "
                "next collective)"
            )
        # An interrupt among failures kept from an earlier sync point was
        # raised on its rank then: here every rank raises DestroyError, but
        # for an interrupt of this sync point's own (a finish's; a str() that
        # raised one while the rows were written, say), on its rank.
        local = self.caught + [e for _, (_, _, e) in self.failures]
        interrupt = self.caught[0] if self.caught else None
        if interrupt is None:
            interrupt = next(
                (
                    e
                    for s, (_, _, e) in self.failures
                    if s == self.seq and not isinstance(e, Exception)
                ),
                None,
            )
        self.caught = []
        try:
            _destroy.raise_failures(rows, local, where, fam.rank, self.core.reason, interrupt)
        finally:
            del local, interrupt

    # -- the votes and the mismatch ----------------------------------------------

    def _check_fields(self, extra: Sequence[Participant]) -> None:
        # The same participants on every rank (the call is collective), so
        # refusing here, before any collective, is the same everywhere.
        taken = {p.field for p in self.fam.participants if p.field is not None}
        for p in extra:
            if p.field is None:
                continue
            _agree.field_shift(p.field)
            if p.field in taken:
                raise CollectiveGCError(
                    f"two participants of a sync point on the {self.fam.label} vote in "
                    f"field {p.field}"
                )
            taken.add(p.field)

    def _raising(self) -> tuple[tuple[int, bool], ...]:
        """(first bit of its field or -1, whether its finish may raise) of each participant."""
        return tuple(
            (-1 if p.field is None else _agree.field_shift(p.field), may_raise_ever(p))
            for p in self.parts
        )

    def _votes(self) -> int:
        flags = 0
        for p, owner in zip(self.parts, self.owners):
            if p.field is not None:
                try:
                    vote = p.vote(owner)
                except BaseException as exc:  # on this rank only: a bad vote
                    # Raised here, it would leave the other ranks in the
                    # agreement; refused on every rank alike instead. An
                    # interrupt (a vote's sys.exit(), say) is held, and
                    # raised on this rank once the collectives are done.
                    if not isinstance(exc, Exception):
                        self.caught.append(exc)
                    (_, _, _, text), *_ = _destroy.rows_of([(-1, "", exc)], 0, self.caught)
                    self.bad.append(f"{type(p).__name__}'s vote raised {text}")
                    flags |= FLAG_BAD_VOTE
                    continue
                if type(vote) is not int or not 0 <= vote <= 0xFF:
                    self.bad.append(f"{type(p).__name__} voted {vote!r}")
                    flags |= FLAG_BAD_VOTE
                    continue
                flags |= vote << _agree.field_shift(p.field)
        return flags

    def _mismatch(self, comm: MPI.Intracomm | None) -> CollectiveMismatchError:
        # Every rank saw the disagreement: one more gather says who differs.
        fam = self.fam
        registry = fam.registry
        next_key = self.core.cut_key  # (what this rank sent)
        newest = [
            (r.key, r.name, where(r))
            for r in registry.alive()[-3:] + registry.pending(self.seq)[-3:]
        ]
        mine = (
            self.seq,
            next_key,
            self.at_exit,
            self.identities,
            self.core.cut_order,
            sorted(set(newest)),
        )
        assert comm is not None
        everyone = allgather(comm, mine, self.dl, fam.what("its mismatch report"))
        seqs = [e[0] for e in everyone]
        keys = [e[1] for e in everyone]
        kinds = [e[2] for e in everyone]
        ids = [e[3] for e in everyone]
        orders = [e[4] for e in everyone]
        parts = []
        if len(set(ids)) > 1:
            parts.append(_participants_differ(ids))
        if len(set(kinds)) > 1:
            parts.append(
                "some ranks were at a sync point of the program and others at the exit "
                f"agreement (this rank: {'exit' if self.at_exit else 'a sync point'}; at exit: "
                f"ranks {[r for r, e in enumerate(kinds) if e]}); a rank ran more sync points "
                "than the others, or exited early"
            )
        if len(set(seqs)) > 1:
            parts.append(
                f"sync-point numbers range from {min(seqs)} to {max(seqs)} across the ranks "
                f"(by rank: {seqs}; this rank: {self.seq}); a rank skipped a sync point"
            )
        if len(set(keys)) > 1:
            parts.append(
                f"registration counts range from {min(keys)} to {max(keys)} (by rank: {keys}; "
                f"this rank: {next_key}); the ranks did not register the same "
                "objects (register is collective)"
            )
        elif len(set(orders)) > 1:
            parts.append(
                "the ranks registered as many objects, but on the family's communicators "
                "(those congruent with this one: its duplicates, a library's) in different "
                "orders (ranks with the same order: "
                + "; ".join(
                    str([r for r, o in enumerate(orders) if o == mine_o])
                    for mine_o in dict.fromkeys(orders)
                )
                + "); registration is collective over the processes of these "
                "communicators, which share one key counter: register on them in the "
                "same order on every rank"
            )
        if len(set(keys)) > 1 or len(set(orders)) > 1:
            shown = "; ".join(
                f"rank {r}: "
                + (", ".join(f"key {k} ({n!r}) on the {w}" for k, n, w in e[5][-3:]) or "nothing")
                for r, e in enumerate(everyone)
            )
            parts.append(f"registered most recently, by rank: {shown}")
        return CollectiveMismatchError(
            f"rank {fam.rank}: the ranks of the {fam.label} disagree at sync "
            f"point {self.seq}: " + "; ".join(parts) + ". Nothing was destroyed."
        )


# The identity a scope's exit sync point gives its participant (see
# collective_gc._scope): a rank whose scope ended while the others are still
# inside it shows up as one with this participant where they have another.
SCOPE_EXIT = "scope-exit"


def _participants_differ(ids: list[str]) -> str:
    """What the mismatch says when the ranks' participants differ."""
    shown = {i: [r for r, j in enumerate(ids) if j == i] for i in dict.fromkeys(ids)}
    listing = "; ".join(f"ranks {r}: {i.replace(chr(0), ', ') or 'none'}" for i, r in shown.items())
    exiting = [r for i, ranks in shown.items() if SCOPE_EXIT in i for r in ranks]
    if exiting and len(exiting) < len(ids):
        inside = [r for r in range(len(ids)) if r not in exiting]
        return (
            f"the collective_scope ended on rank(s) {exiting} (its exit sync point) while "
            f"rank(s) {inside} were still inside it, at one of its sync points: the scope "
            "was left early on some ranks only (an exception or sys.exit that escaped the "
            f"block there, a return or break on some ranks) ({listing})"
        )
    return (
        f"the ranks' sync points have different participants ({listing}): a "
        "collective_scope's gc= or strict= differs between the ranks, or two threads ran "
        "sync points on this communicator at once and the ranks paired them differently"
    )


def keep_failures(core: FamilyState, failures: list[_destroy.Failure], seq: int, rank: int) -> None:
    """Keep ``failures`` of sync point ``seq`` (known on this rank only) in
    ``core`` for the family's next agreement to report on every rank; an
    interrupt among them is raised now, on this rank (with a note)."""
    kept = [(seq, f) for f in failures]
    failures.clear()  # the caller's frame must not hold what the traceback will
    core.keep(kept)
    caught = _interrupts_among(kept, seq, rank)
    del kept
    if caught:
        _raise_own(caught)


def _interrupts_among(
    failures: list[tuple[int, _destroy.Failure]], seq: int, rank: int
) -> list[BaseException]:
    """The interrupts (KeyboardInterrupt, SystemExit) among ``failures``, each
    with a note saying what the other ranks will see."""
    found = []
    for _, (key, name, exc) in failures:
        if not isinstance(exc, Exception):
            exc.add_note(
                f"collective_gc: raised by {'a destroy' if key >= 0 else name} at sync "
                f"point {seq} on rank {rank}; every agreed destroy ran, and every rank "
                "raises DestroyError naming it at the family's next collective"
            )
            found.append(exc)
    return found


def _held(
    caught: list[BaseException], failures: list[tuple[int, _destroy.Failure]], seq: int
) -> list[BaseException]:
    """This rank's interrupts of sync point ``seq``: those held (a vote's)
    and those among its failures (a destroy's, a child's)."""
    return caught + [e for s, (_, _, e) in failures if s == seq and not isinstance(e, Exception)]


def _name_held(exc: BaseException, caught: list[BaseException]) -> None:
    """Note on ``exc`` the interrupts this rank held meanwhile (by type only:
    a repr may raise, and replace ``exc``)."""
    for held in caught:
        if held is not exc:
            exc.add_note(
                f"collective_gc: {type(held).__name__} was raised on this rank "
                "meanwhile, and held for the end of the sync point's collectives"
            )


def _raise_own(caught: list[BaseException]) -> NoReturn:
    """Raise the first of this rank's interrupts (the others as its notes)."""
    first = caught[0]
    notes = [f"collective_gc: then {e!r}" for e in caught[1:]]
    caught.clear()  # the caller's frame must not hold what its traceback holds
    for note in notes:
        first.add_note(note)
    try:
        raise first
    finally:
        del first


_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False
_NONE: list[Any] = []  # what a finished record holds; never appended to
WATCHED_NOW = -1  # (a resumed exchange that a rank's notice ended)
_SYNC_FLAGS = 0xFF  # the sync point's own flags: the low byte (collective_gc._agree)

# The steps, once: what run() runs, in this order, and a tracer times.
STEPS: tuple[tuple[str, Callable[[SyncPoint], object]], ...] = (
    ("prepare", SyncPoint.prepare),
    ("agree", SyncPoint.agree),
    ("destroy", SyncPoint.destroy),
    ("visit", SyncPoint.visit),
    ("release", SyncPoint.release),
    ("check", SyncPoint.check),
    ("finish", SyncPoint.finish),
    ("report", SyncPoint.report),
)
AGREE = 1  # where a sync point the steady state began goes on (FamilyState.progress)
REPORT = 7  # where the steady state left one whose destroys or finishes raised
