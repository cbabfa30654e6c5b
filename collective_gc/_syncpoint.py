"""A sync point, as the sequence of its steps.

A family's sync point on this rank (see :mod:`collective_gc._collective`:
the communicators congruent with one another share one), from a dead
object's point of view: its finalizer appended its registration to the
family's inbox. Then:

1. prepare: the participants' votes, which derived families (strict
   subsets: ``cgc.split``) this rank has something for, and the drain of
   the inbox into the pending keys;
2. agree: one collective over the private communicator says which keys are
   pending on every rank, ORs the flags, votes and derived families' bits,
   and checks that every rank is at the same sync point
   (:meth:`._agree.Agreement.agree`); if some rank holds failures that no
   sync point has reported yet, they are reported now, on every rank, and
   nothing else is done;
3. destroy: those keys' destroys, newest first (:func:`._destroy.run`);
4. visit: the sync points of the derived families some rank wanted;
5. check (a scope's exit, a close, the exit agreement, or a participant
   that asks for its votes again): one more word says whether anything
   failed anywhere, and takes the votes again;
6. finish: the participants act on the agreed flags (one more word if any
   of them might raise);
7. report: what failed is raised on every rank if a collective of this sync
   point said so; else it is kept, and the family's next agreement reports
   it (step 2).

So a sync point whose destroys succeed makes one collective, and one whose
destroys fail costs nothing more: its failures are agreed by the next
collective of the family, which the program makes anyway (the next sync
point, the scope's exit, a close, exit). Each step decides from agreed
values only, so every rank takes the same branches and makes the same
collectives. One :class:`SyncPoint` holds what a sync point carries from
step to step; the :class:`~collective_gc._collective.Collective` what the
family's sync points share.

Participants (:class:`Participant`) are what takes part in a sync point
beside the destroys: a scope's GC policy, PETSc's own garbage cleanup. Each
may vote in a byte (its field) of the agreed flags and act on the result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np
from mpi4py import MPI

from . import _agree, _destroy
from ._agree import FLAG_BAD_VOTE, FLAG_CYCLIC, FLAG_FAILED
from ._errors import CollectiveGCError, CollectiveMismatchError
from ._registration import where
from ._tracing import TRACER, Phases, Tracer
from ._transport import Deadline, allgather

if TYPE_CHECKING:
    from ._collective import Collective
    from ._manager import Manager

__all__ = [
    "CollectStats",
    "Participant",
    "SyncPoint",
    "identities",
    "what_raised",
    "add_reacher",
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


class Participant:
    """Something that takes part in a family's sync points (subclass it).

    ``field`` (0..5, or None) is the byte of the agreed flags it votes in,
    fixed by its kind so that every rank reads the same byte. Every method
    runs on every rank of the communicator at every sync point, in the order
    participants were added (sync points' own participants last), with the
    manager it was added on (its communicator, rank and size).

    ``quiet_finish``: True if :meth:`finish` does nothing when the agreed
    flags are all 0 and nothing was destroyed (the steady state), which may
    then skip it; False (the default) calls it at every sync point.
    """

    field: int | None = None
    quiet_finish: bool = False

    def vote(self, mgr: Manager) -> int:
        """This rank's byte (0..255), ORed over the ranks. Local, no MPI."""
        return 0

    def revote(self, flags: int) -> bool:
        """Whether, given the agreed ``flags``, the votes must be taken again
        after the destroys (they may change them: PETSc garbage), with one
        more word; answer from ``flags`` alone, so that every rank answers
        alike. The default: False."""
        return False

    def finish(self, mgr: Manager, flags: int) -> None:
        """After the destroys, with the agreed flags (the votes taken again
        after the destroys, if :meth:`revote` asked). May make collective
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


def what_raised(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, whatever its ``str()`` does (it may raise too)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (whose str() raised)"


# Called at the start of each sync point of a family of size > 1 with that
# family (collective_gc._comms: a communicator a library made, first used
# before any family containing it existed, is adopted there).
_REACHERS: list[Callable[[Collective], None]] = []
# What they look for (collective_gc._comms keeps it): while it is empty a
# sync point has nothing to reach, and the steady state may run.
UNREACHED: list[Any] = []
# Made anew whenever a family joins UNREACHED (add_unreached). A family
# whose sync point looked through the list at this epoch
# (Collective.reached) found all it could reach there: what is left belongs
# to other families' groups, and it needs not look again (nor leave the
# steady state for it) until the list grows.
REACH_EPOCH: list[object] = [object()]


def add_unreached(entry: Any) -> None:
    """Put ``entry`` (a ``(family ref, manager ref)`` pair) on UNREACHED. Local."""
    UNREACHED.append(entry)
    REACH_EPOCH[0] = object()


def add_reacher(reach: Callable[[Collective], None]) -> None:
    """Call ``reach(family)`` at each sync point of a family of size > 1,
    before its agreement (at the same point on every rank). Local."""
    if reach not in _REACHERS:
        _REACHERS.append(reach)


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
        "keys",
        "cyclic",
        "count",
        "visited",
        "agreed",
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
        # Where failures known on this rank only go (see report): the
        # family's, or a parent's visit (it reports them to all its ranks).
        self.sink = fam.unreported if sink is None else sink
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
        self.seq = fam.seq
        self.flags = 0
        self.wanted = 0  # the derived families' bits: this rank's, then agreed
        self.keys: np.ndarray[Any, Any] = _NO_KEYS
        self.cyclic = 0
        self.count = 0
        self.visited = False
        self.agreed = False  # whether a collective of this sync point agreed on its failures
        self.bad: list[str] = []  # participants' votes outside 0..255, on this rank
        # (sync point, failure): what failed here, and what the family kept
        # for this sync point's agreement to report.
        self.failures: list[tuple[int, _destroy.Failure]] = []
        # Interrupts of the sync point's own steps (not from a signal: those
        # wait for the end of the protected region: a second Ctrl-C between two
        # runs of destroys, an exception's str()), raised on this rank once the
        # collectives are done.
        self.caught: list[BaseException] = []

    def run(
        self, collected: int | None, t0: float, exchanged: tuple[int, int] | None = None
    ) -> CollectStats:
        """The steps, in order. Collective: from the agreement on, whether a
        step runs depends on agreed values only (the keys, the flags, the
        participants), so every rank runs the same steps. ``exchanged``: the
        C steady state prepared this sync point (its votes were all 0, the
        inbox drained with nothing cyclic) and made its allreduce, which
        found something unusual: the steps go on from there."""
        tracer = TRACER[0]
        if tracer is not None:
            return self._traced(tracer, collected, t0, exchanged)
        try:
            if exchanged is None:
                self.prepare()
            else:
                self.fam.inside = True
            self.agree(exchanged)
            if not self.flags & FLAG_FAILED:
                if self.keys.size:
                    self.destroy()
                if self.wanted:
                    self.visit()
                if self.fam.leaving:
                    self.fam.release()
                if (self.keys.size or self.visited) and self._checked():
                    self.check()
            # else failures kept by earlier sync points: reported now, on every
            # rank, instead of destroying (the participants still see the flags:
            # PETSc's refuses the family if one of them was its own)
            if self.parts:
                self.finish()
            if self.failures or self.caught or self.flags & FLAG_FAILED:
                self.report()
        finally:
            self.failures = self.caught = _NONE  # see the class docs
        return self._stats(collected, t0)

    def _stats(self, collected: int | None, t0: float) -> CollectStats:
        r = self.fam.registry
        return CollectStats(
            self.count,
            r.pend.size + len(r.inbox),
            self.cyclic,
            time.perf_counter() - t0,
            self.seq,
            collected,
            self.wanted.bit_count(),
        )

    def _traced(
        self,
        tracer: Tracer,
        collected: int | None,
        t0: float,
        exchanged: tuple[int, int] | None,
    ) -> CollectStats:
        """:meth:`run`, with each step's time handed to ``tracer`` (see
        collective_gc._tracing): the same steps, in the same order."""
        clock = time.perf_counter
        phases: Phases = []
        fam = self.fam
        if fam.agreement is not None:
            fam.agreement.waits = phases  # the exchange marks its wait there
        outcome = "ok"

        def step(name: str, fn: Callable[[], None]) -> None:
            start = clock()
            try:
                fn()
            finally:
                phases.append((name, start, clock()))

        try:
            if exchanged is None:
                step("prepare", self.prepare)
            else:
                fam.inside = True
            step("agree", lambda: self.agree(exchanged))
            if not self.flags & FLAG_FAILED:
                if self.keys.size:
                    step("destroy", self.destroy)
                if self.wanted:
                    step("visit", self.visit)
                if fam.leaving:
                    step("release", fam.release)
                if (self.keys.size or self.visited) and self._checked():
                    step("check", self.check)
            if self.parts:
                step("finish", self.finish)
            if self.failures or self.caught or self.flags & FLAG_FAILED:
                step("report", self.report)
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            self.failures = self.caught = _NONE  # see the class docs
            if fam.agreement is not None:
                fam.agreement.waits = None
            tracer.sync_point(
                fam.label, fam.rank, self.seq, t0, clock(), phases, self.count, outcome
            )
        return self._stats(collected, t0)

    # -- 1. prepare ------------------------------------------------------------

    def prepare(self) -> None:
        """The votes, the derived families this rank has something for, the drain."""
        fam = self.fam
        if fam.size > 1:
            epoch = REACH_EPOCH[0]
            for reach in _REACHERS:
                reach(fam)
            fam.reached = epoch
        if self.parts:
            self.flags = self._votes()
        children = fam.children
        for child in children:
            if child.member() and child.wants():
                self.wanted |= child.bit
        if any(child.done() for child in children):
            # Gone on this rank (closed, freed): no visit would drop it (a
            # closed family wants none), and while it is listed the family's
            # sync points are not steady (Child.idle). Gone on all its ranks
            # alike, since members leave at collectives.
            fam.children = [child for child in children if not child.done()]
        if fam.unreported:
            # Failures of earlier sync points, which this one reports: on
            # every rank, since the agreement tells every rank of them.
            self.failures.extend(fam.unreported)
            fam.unreported.clear()
            self.flags |= FLAG_FAILED
        r = fam.registry
        if r.inbox or r.stale or r.last_cyclic:
            self.cyclic = r.drain(self.seq)
            if self.cyclic:
                self.flags |= FLAG_CYCLIC

    # -- 2. agree ----------------------------------------------------------------

    def agree(self, exchanged: tuple[int, int] | None = None) -> None:
        """The keys pending on every rank, and the agreed flags. Collective.
        ``exchanged``: the allreduce was made already (the C steady state's:
        ``_speedups.steady``), this is what it found of the pending keys."""
        fam = self.fam
        r = fam.registry
        if fam.size == 1:
            self.keys = r.pend
        else:
            # From here until the last collective, leaving by an exception on
            # this rank only makes the family unusable (see Collective.sync).
            fam.inside = True
            agreement = fam.agreement
            assert agreement is not None, "a family of size > 1 is opened when made"
            what = fam.what("its agreement")
            if exchanged is None:
                head = _agree.Header(
                    self.seq,
                    r.next_key,
                    self.at_exit,
                    self.flags,
                    self.fingerprint ^ _agree.as_int64(r.order),
                    self.wanted,
                )
                exchanged = agreement.exchange(head, r.pend, self.dl, what)
            agreed = agreement.resolve(r.pend, *exchanged, self.dl, what)
            if agreed.mismatch:
                raise self._mismatch(agreement.comm)
            # The agreed next key (the one every rank sent: a registration on
            # another thread meanwhile is the next sync point's).
            agreement.window.advance(int(agreement.buffer()[2]))
            r.new_interval()
            self.keys, self.flags, self.wanted = agreed.keys, agreed.flags, agreed.children
        if self.flags & FLAG_BAD_VOTE:
            # Seen alike by every rank, before anything is destroyed: the keys
            # stay pending, and the family stays usable. (An interrupt held
            # meanwhile is raised in its place by the protected region's end.)
            fam.inside = False
            raise CollectiveGCError(
                f"rank {fam.rank}: a participant of the {fam.label} voted outside "
                f"0..255 at sync point {self.seq} (here: {'; '.join(self.bad) or 'none'}); "
                "nothing was destroyed"
            )
        fam.seq = self.seq + 1
        if self.flags & FLAG_FAILED:
            self.agreed = True  # every rank reports what any rank kept (step 7)

    # -- 3. destroy --------------------------------------------------------------

    def destroy(self) -> None:
        """The agreed keys' destroys, newest first, on every rank alike."""
        fam = self.fam
        fam.destroying = threading.get_ident()
        try:
            self.count, more, interrupt = _destroy.run(fam.registry, self.keys)
        finally:
            fam.destroying = 0
            fam.destroyed += self.count
        seq = self.seq
        self.failures.extend((seq, f) for f in more)
        if interrupt is not None:
            self.caught.append(interrupt)
        # A frame on the failures' tracebacks (through f_back) must not hold them.
        del more, interrupt

    # -- 4. visit ------------------------------------------------------------------

    def visit(self) -> None:
        """The sync points of the derived families some rank wanted (each
        collective over that family: its ranks all saw the same bit), in the
        order they were made; then those gone leave the list."""
        fam, wanted, seq = self.fam, self.wanted, self.seq
        children = fam.children
        for child in list(children):
            if child.bit & wanted and child.member():
                self.visited = True
                self.failures.extend((seq, f) for f in child.visit(self.dl.at))
        if any(child.done() for child in children):
            fam.children = [child for child in children if not child.done()]

    # -- 5. check ----------------------------------------------------------------

    def _checked(self) -> bool:
        # Agreed values only: every rank decides alike.
        if self.final:
            return True
        flags = self.flags
        for p in self.parts:
            if p.revote(flags):
                return True
        return False

    def check(self) -> None:
        """Whether anything failed anywhere, and the votes again. Collective."""
        after = self._votes() | (FLAG_FAILED if self.failures else 0)
        agreement = self.fam.agreement
        if agreement is not None:
            after = agreement.any_flags(after, self.dl, self.fam.what("its error check"))
        self.flags = after | (self.flags & FLAG_CYCLIC)
        self.agreed = True

    # -- 6. finish ---------------------------------------------------------------

    def finish(self) -> None:
        """Every participant's finish, whatever raises; then, if any of them
        said it might raise (agreed, so on every rank alike), one more word
        says whether anything failed anywhere (FLAG_FAILED in the flags)."""
        # Whether to check is asked of every participant before any finish
        # runs, from agreed values only, so it is decided alike on every rank.
        # No signal's handler runs in between (the sync point is a protected
        # region): what raises is the participants' own code.
        # (No local name for the failures: a frame in their tracebacks would
        # hold them; the record's end drops them, see the class docs.)
        flags, seq = self.flags, self.seq
        check = False
        for p in self.parts:
            try:
                check = p.may_raise(flags) or check
            except BaseException as exc:  # a yes (alike on every rank: see may_raise)
                check = True
                self.failures.append((seq, (-1, f"the may_raise of {type(p).__name__}", exc)))
        for p, owner in zip(self.parts, self.owners):
            try:
                p.finish(owner, flags)
            except BaseException as exc:  # every participant finishes; reported after
                self.failures.append((seq, (-1, f"the finish of {type(p).__name__}", exc)))
        if not check:
            return
        mine = FLAG_FAILED if self.failures else 0
        agreement = self.fam.agreement
        if agreement is not None:
            mine = agreement.any_flags(mine, self.dl, self.fam.what("its finish check"))
        self.flags |= mine  # on a family of size 1, reported as on a larger one
        self.agreed = True

    # -- 7. report ---------------------------------------------------------------

    def report(self) -> None:
        """Raise on every rank what failed on any, if a collective of this sync
        point agreed on it; else keep it for the family's next agreement. Then
        this rank's interrupt.

        (No exception is held in a local name of these frames: they are in
        the raised exception's traceback, and would close a cycle with it.)"""
        fam = self.fam
        if self.flags & FLAG_FAILED and self.agreed:
            self._raise_agreed()
        fam.inside = False
        if self.caught:
            self.caught[0].add_note(
                "collective_gc: it was held until the sync point's collectives were "
                "done, so that every rank ran the same destroys"
            )
        if self.failures:
            # Known here only: the family's next agreement reports them on every
            # rank (or the parent's, for a visit); an interrupt among them is
            # raised here too, now.
            self.sink.extend(self.failures)
            self.caught.extend(_interrupts_among(self.failures, self.seq, fam.rank))
        if self.caught:
            _raise_own(self.caught)

    def _raise_agreed(self) -> None:
        """Every rank's failures, gathered and raised on every rank."""
        fam = self.fam
        failures = [f for _, f in self.failures]
        seqs = sorted({s for s, _ in self.failures})
        rows = _destroy.rows_of(failures, fam.rank, self.caught)
        del failures
        if fam.size > 1:
            assert fam.comm is not None
            everyone = allgather(fam.comm, (rows, seqs), self.dl, fam.what("its error report"))
            rows = [row for per_rank, _ in everyone for row in per_rank]
            seqs = sorted({s for _, per_rank in everyone for s in per_rank})
        fam.inside = False
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
        # for an interrupt of this sync point's own (a str() that raised one
        # while the rows were written, say).
        local = self.caught + [e for _, (_, _, e) in self.failures]
        interrupt = self.caught[0] if self.caught else None
        if interrupt is None and not earlier:
            interrupt = next((e for e in local if not isinstance(e, Exception)), None)
        self.caught = []
        try:
            _destroy.raise_failures(rows, local, where, fam.rank, fam.reason, interrupt)
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

    def _votes(self) -> int:
        flags = 0
        for p, owner in zip(self.parts, self.owners):
            if p.field is not None:
                vote = p.vote(owner)
                if type(vote) is not int or not 0 <= vote <= 0xFF:
                    self.bad.append(f"{type(p).__name__} voted {vote!r}")
                    flags |= FLAG_BAD_VOTE
                    continue
                flags |= vote << _agree.field_shift(p.field)
        return flags

    def _mismatch(self, comm: MPI.Intracomm) -> CollectiveMismatchError:
        # Every rank saw the disagreement: one more gather says who differs.
        fam = self.fam
        registry = fam.registry
        next_key = registry.next_key
        newest = [
            (r.key, r.name, where(r))
            for r in registry.alive()[-3:] + registry.pending(self.seq)[-3:]
        ]
        mine = (
            self.seq,
            next_key,
            self.at_exit,
            self.identities,
            registry.order,
            sorted(set(newest)),
        )
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


def keep_failures(
    sink: list[tuple[int, _destroy.Failure]],
    failures: list[_destroy.Failure],
    seq: int,
    rank: int,
) -> None:
    """Keep ``failures`` of sync point ``seq`` (known on this rank only) in
    ``sink`` for the family's next agreement to report on every rank; an
    interrupt among them is raised now, on this rank (with a note)."""
    kept = [(seq, f) for f in failures]
    failures.clear()  # the caller's frame must not hold what the traceback will
    sink.extend(kept)
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
