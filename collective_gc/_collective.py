"""A family of congruent communicators: its members, its participants, its sync points.

Communicators with the same processes in the same order (MPI_Comm_compare:
IDENT or CONGRUENT) are one *family*: a user's communicator, its
``cgc.dup``\\s, a library's ``comm.Dup()`` of it (DOLFINx's per-mesh ones),
PETSc's inner duplicates. A registration on any of them is collective over
the same processes as one on any other, so the family needs one key counter,
one private duplicate, one agreement and one sequence of sync points,
whatever the number of its communicators: a sync point of any member is a
sync point of the family, and costs one collective in the steady state, not
one per communicator.

Its collective state is one typed object, its
:class:`~collective_gc._state.FamilyState` (``core``: in C where the
extension is built), the one writer of those fields. :class:`Collective`
holds it and what is the family's beyond it: its members (the
:class:`~collective_gc.Manager`\\s of its communicators, each with its tag,
the order it joined in), the participants its members added, what waits to
let go, its place in the derived-family tree (collective_gc._tree writes
it); and it is the only way to make a collective of the family: a sync
point, a gather, the exit agreement. Each of them that is left by an
exception on this rank only, half-way through its collectives, leaves the
family unusable (the others would match the wrong collective next) and tells
the other ranks so through the watch.
"""

from __future__ import annotations

import array
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mpi4py import MPI

from . import _agree, _destroy, _interrupts, _tracing, _tree
from ._destroy import Failure
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ExitLeakWarning,
    in_place_of,
)
from ._registration import GC, Registration
from ._registry import Registry
from ._state import (
    HOLD_GONE,
    HOLD_LEAVING,
    HOLD_PARTS,
    OPEN,
    STATES,
    FamilyState,
    State,
)
from ._syncpoint import (
    AGREE,
    CollectStats,
    Participant,
    SyncPoint,
    identities,
    keep_failures,
    may_raise_ever,
)
from ._transport import LEFT, Deadline, allreduce, dup, retire

# A protected region's entry and exit, bound once (the hot path's calls).
_enter = _interrupts.enter
_leave = _interrupts.leave


if TYPE_CHECKING:
    from ._manager import Manager
    from ._tree import Child

__all__ = ["State", "Collective", "families", "family_of", "leak_text", "PERSISTENT"]

_T = TypeVar("_T")
_CODE = {state: code for code, state in enumerate(STATES)}
_FORKED = _CODE[State.FORKED]
_RELEASED = _CODE[State.RELEASED]

PERSISTENT = _agree.PERSISTENT  # (COLLECTIVE_GC_PERSISTENT=0: a new Iallreduce each time)

# The participant of a sync point, as the state's steady state reads it:
# (the first bit of its field, or -1), its voter (given the family's count of
# sync points), its finish(flags), and whether a finish may raise when its
# field is not 0.
_Described = tuple[int, Callable[[int], int], Callable[[int], None], bool, str]


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]


def _describe(p: Participant, owner: Manager) -> _Described:
    shift = -1 if p.field is None else _agree.field_shift(p.field)
    voted = p.voter(owner)
    finish = p.finish

    def finished(flags: int) -> None:
        finish(owner, flags)

    return shift, voted, finished, may_raise_ever(p), f"the finish of {type(p).__name__}"


class Collective:
    """One family of congruent communicators (see the module docs). Made at
    the family's first collective; never by users."""

    __slots__ = (
        "rank",
        "size",
        "label",
        "name",
        "number",
        "core",
        "registry",
        "lock",
        "members",
        "next_tag",
        "participants",
        "owners",
        "also",
        "identities",
        "fingerprint",
        "extra",
        "children",
        "parent",
        "reach_mark",
        "leaving",
        "recorded",
        "__weakref__",
    )

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.label = f"communicator of size {size} (rank {rank})"
        # What a trace calls it: the label with the family's number, the same
        # on every rank (see open); the label alone for a family of size 1.
        self.name = self.label
        # Its number (see _number): the same on every rank of it, and two
        # families that share a process never have the same one; 0 for a
        # family of size 1 (no collective, so never an order to keep).
        self.number = 0
        self.core: FamilyState = FamilyState(rank, size, GC, Registration, CollectStats)
        self.registry = Registry(self.core, self.label)
        # Sync points and explicit destroys, one thread at a time.
        self.lock = threading.RLock()
        # The managers of its communicators, by tag (the order they joined in,
        # the same on every rank: they join at collectives).
        self.members: weakref.WeakValueDictionary[int, Manager] = weakref.WeakValueDictionary()
        self.next_tag = 0
        self.participants: list[Participant] = []
        self.owners: list[Manager] = []  # the member each participant was added on (a proxy)
        # The other members each participant was added on too (by its id): it
        # stays while one of them does (see drop_participants).
        self.also: dict[int, list[Manager]] = {}
        self.identities = ""  # of participants (see Participant.identity)
        self.fingerprint = 0  # _agree.fingerprint of identities (0: none)
        # A sync point's own participant (a scope's), as the steady state
        # takes it, and the fingerprint with it: the last one only (a scope
        # syncs with the same one each time). What it is taken as holds it
        # and its owner, so a cache keyed by it, even weakly, would keep every
        # scope's for the life of the family; emptied when the family's own
        # participants change, and when it lets go.
        self.extra: tuple[Participant, int, _Described | None] | None = None
        # The derived-family tree's (collective_gc._tree writes these): the
        # strict subsets its sync points reach, and whose sync points reach it.
        self.children: list[Child] = []
        self.parent: Collective | None = None
        # When this rank last began a collective of the family after looking
        # at the unreached families (monotonic ns; _tree writes it): what it
        # found listed everywhere before then it may adopt (see _tree._Listed).
        self.reach_mark = 0
        # What may let go once nothing is registered on it (a member whose
        # communicator was freed, a dropped cgc.dup): tried by each sync
        # point after its destroys, at the same point on every rank; True
        # once done. Appended to from MPI attribute delete callbacks (a list
        # append: no MPI there).
        self.leaving: list[Callable[[], bool]] = []
        # What this rank alone has recorded may let go (a member whose
        # communicator the user freed: the delete callback ran here, perhaps
        # on another thread than the sync points', so between different sync
        # points on each rank). Each goes to ``leaving`` at the first sync
        # point whose agreement says every rank has recorded one (see
        # SyncPoint.release): members leave at the same point everywhere.
        self.recorded: list[Callable[[], bool]] = []

    # -- reads of the core ---------------------------------------------------------

    @property
    def state(self) -> State:
        """Usable or not (see :class:`State`)."""
        return STATES[self.core.code]

    @property
    def reason(self) -> str | None:
        """Why it is not usable, or None."""
        return self.core.reason

    @property
    def seq(self) -> int:
        """Sync points completed."""
        return self.core.seq

    @property
    def comm(self) -> MPI.Intracomm | None:
        """The private duplicate (None before the first collective, or for size 1)."""
        return self.core.comm

    # -- making it -----------------------------------------------------------------

    def open(self, base: MPI.Intracomm, deadline: Deadline, what: Callable[[], str]) -> None:
        """Collective over ``base`` (a member's communicator): make the private
        duplicate, over which every collective of the family goes (never
        matching a user's message). A protected region's caller."""
        if self.size == 1 or self.core.comm is not None:
            return
        # Neither step is left pending: a duplicate still in progress when the
        # user frees the communicator would be completed on freed memory.
        doing = "duplicating its communicator"
        _tree.opening(self)
        try:
            comm = dup(base, deadline, what)
            doing = "numbering the family"
            number = _number(comm, deadline, what)
        except BaseException as exc:
            self.become(
                State.UNUSABLE, f"{doing} was abandoned ({type(exc).__name__})", first=False
            )
            raise
        self.number = number
        self.name = f"communicator of size {self.size} #{number} (rank {self.rank})"
        # Local: it only posts the receive of the watch.
        self.core.open(comm, PERSISTENT)

    def live_members(self) -> list[tuple[int, Manager]]:
        """(tag, manager) of the members still alive, by tag. Local, and safe
        from any thread: the WeakValueDictionary's own iteration is a Python
        generator, in which another thread that joins or leaves meanwhile
        made it raise "dictionary changed size during iteration" (the stress
        harness's threads episode); ``valuerefs()`` copies its weak
        references (keyed by tag) in one call instead."""
        out = []
        for ref in self.members.valuerefs():
            mgr = ref()
            if mgr is not None:
                out.append((ref.key, mgr))
        out.sort(key=_first)
        return out

    def join(self, member: Manager) -> int:
        """A manager of one of the family's communicators joins it. Its tag:
        the same on every rank, since members join at collectives."""
        tag = self.next_tag
        self.next_tag = tag + 1
        self.members[tag] = member
        self.core.set_hold(HOLD_GONE, False)
        return tag

    def leave(self, tag: int) -> bool:
        """The member ``tag`` has let go. True if the family let go too (see
        :meth:`maybe_free`). Collective in effect: members leave at the same
        point on every rank (a close, a sync point's step) or once the user
        freed their communicator (collectively)."""
        self.members.pop(tag, None)
        if not self.members:
            self.core.set_hold(HOLD_GONE, True)
        return self.maybe_free()

    def maybe_free(self) -> bool:
        """If no member is left and nothing is registered: let go of the
        private duplicate (local; kept a while, not freed: a late rank's
        notice may still come, see _transport.retire), unless a sync point is
        under way (its end does it). True if done.

        One protected region: its steps (the duplicate retired, the family
        forgotten, its children listed for another family to adopt) are
        done whole or not begun, whatever signal arrives meanwhile."""
        core = self.core
        if self.members or not self.registry.is_empty() or core.inside:
            return False
        if core.comm is None and core.code != OPEN:
            return True
        entered = _enter()
        try:
            # (A forked child makes no MPI call: its parent's requests and
            # communicators are not its own.)
            private = None if core.code == _FORKED else core.close(True)
            if core.code == OPEN:
                core.become(_RELEASED, "every communicator of it was freed or closed", False)
            # Nothing is left to let go: what still waits (a freed member's
            # release, which holds its manager, which holds this family) would
            # otherwise keep a cycle that only the collector frees.
            self.leaving = []
            self.recorded = []
            self.extra = None
            core.set_hold(HOLD_LEAVING, False)
            forget(self)
            if self.children:
                _tree.orphan(self, families())  # its children: reached by another family now
            retire(private)  # last: it may free an older one, which runs MPI's delete callbacks
        finally:
            _leave(entered)
        return True

    # -- state ---------------------------------------------------------------------

    def become(self, state: State, reason: str, *, first: bool = True) -> None:
        """Usable -> not: the first reason stays, unless ``first`` is false
        (letting go, which ends whatever state it was in). A forked child's
        stays forked."""
        core = self.core
        code = _FORKED if core.code == _FORKED else _CODE[state]
        core.become(code, reason, first)

    def abandon(self, reason: str) -> None:
        """This rank left collectives of the private communicator that the
        others may still be in: unusable, and the others are told through
        the watch (their waits there end at once, not at a deadline they may
        not have). A timeout has told them already (see _transport.poll)."""
        self.become(State.UNUSABLE, reason)
        self.core.announce(LEFT)

    def check_usable(self, what: str, describe: str) -> None:
        """Raise :class:`CollectiveGCError` saying why ``what`` cannot be done
        on this rank now (``describe``: the communicator, for the message)."""
        core = self.core
        if core.code == _FORKED:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {describe} and its "
                "registrations belong to the parent process"
            )
        if core.destroying and core.destroying == threading.get_ident():
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{core.seq} on the {describe}; do it after the sync point"
            )
        if core.reason is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {describe} is unusable since {core.reason}"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {describe}: MPI is finalized")

    def usable(self) -> bool:
        """Whether a sync point could run now on this thread. Local."""
        core = self.core
        return (
            core.code == OPEN
            and not (core.destroying and core.destroying == threading.get_ident())
            and not MPI.Is_finalized()
        )

    # -- participants ----------------------------------------------------------------

    def add_participant(self, participant: Participant, owner: Manager) -> None:
        """See :meth:`Manager.add_participant`: two participants of one family
        may not vote in the same field."""
        if participant in self.participants:
            # Added on another member too (cp.install on two communicators of
            # the family): it outlives the first one's leaving.
            i = self.participants.index(participant)
            more = self.also.setdefault(id(participant), [])
            if self.owners[i] is not owner and all(m is not owner for m in more):
                more.append(owner)
            return
        if self.leaving:
            # Members whose communicators were freed leave first, with their
            # participants: this is collective too (every rank adds the same
            # participants at the same point).
            self.release()
        if participant.field is not None:
            _agree.field_shift(participant.field)  # a valid field
            if any(p.field == participant.field for p in self.participants):
                raise CollectiveGCError(
                    f"the {self.label} already has a participant voting in field "
                    f"{participant.field}"
                )
        self.participants.append(participant)
        self.owners.append(owner)
        self._participants_changed()

    def remove_participant(self, participant: Participant) -> None:
        """See :meth:`Manager.remove_participant`."""
        kept = [(p, o) for p, o in zip(self.participants, self.owners) if p is not participant]
        if len(kept) == len(self.participants):
            return
        self.also.pop(id(participant), None)
        self.participants = [p for p, _ in kept]
        self.owners = [o for _, o in kept]
        self._participants_changed()

    def drop_participants(self, owner: Manager) -> None:
        """The participants added on ``owner``, a member that leaves, leave
        too, unless they were added on another member still here: that one
        is theirs from now on. Collective in effect: members leave at the
        same point on every rank."""
        kept = []
        changed = False
        for p, o in zip(self.participants, self.owners):
            more = self.also.get(id(p))
            if more is not None:
                more[:] = [m for m in more if m is not owner]
            if o is owner:
                changed = True
                if not more:
                    self.also.pop(id(p), None)
                    continue
                o = more.pop(0)
            kept.append((p, o))
        if not changed:
            return
        self.participants = [p for p, _ in kept]
        self.owners = [o for _, o in kept]
        self._participants_changed()

    def _participants_changed(self) -> None:
        self.identities = identities(self.participants)
        self.fingerprint = _agree.fingerprint(self.identities) if self.identities else 0
        self.extra = None
        self.core.set_participants(
            tuple(_describe(p, o) for p, o in zip(self.participants, self.owners))
        )
        self.core.set_hold(HOLD_PARTS, not all(p.quiet_finish for p in self.participants))

    def participant(self, kind: type[Participant]) -> Participant | None:
        """The participant of exactly that class the family has, if any. Local."""
        for p in self.participants:
            if type(p) is kind:
                return p
        return None

    def leave_later(self, attempt: Callable[[], bool], agreed: bool) -> None:
        """``attempt()`` lets something go once nothing is registered on it
        (True if done): tried by each sync point after its destroys.
        ``agreed``: asked at the same point on every rank (an agreed
        destroy); else recorded by this rank alone, from an MPI attribute
        delete callback (an append, no MPI), and tried once every rank has
        recorded it (see ``recorded``)."""
        (self.leaving if agreed else self.recorded).append(attempt)
        self.core.set_hold(HOLD_LEAVING, True)

    def take_recorded(self, n: int) -> None:
        """Every rank has recorded ``n`` things that may let go (a sync
        point's agreement said so): the oldest ``n`` join ``leaving``. Local."""
        self.leaving.extend(self.recorded[:n])
        del self.recorded[:n]

    def release(self) -> None:
        """A sync point's step, after its destroys: what was waiting to let go
        once nothing is registered on it tries again (the counts it reads are
        the same on every rank after agreed destroys, so every rank does the
        same)."""
        todo, self.leaving = self.leaving, []
        kept = []
        while todo:
            item = todo.pop(0)
            if not item():
                kept.append(item)
            # What letting go of one queued (a cgc.dup it freed, agreed) goes now too.
            todo.extend(self.leaving)
            self.leaving.clear()
        self.leaving = kept
        self.core.set_hold(HOLD_LEAVING, bool(kept or self.recorded))

    # -- collectives ---------------------------------------------------------------

    def sync(
        self,
        owner: Manager,
        *,
        deadline: float | None = None,
        participants: Sequence[Participant] = (),
        collected: int | None = None,
        t0: float | None = None,
        at_exit: bool = False,
        final: bool = False,
        sink: list[tuple[int, Failure]] | None = None,
    ) -> CollectStats:
        """Collective. A sync point of the family (see :class:`SyncPoint`):
        ``participants`` take part in this one only, with ``owner``;
        ``final``: its own failures are reported by it (one more word after
        its destroys), not by the family's next agreement: a scope's exit,
        a close, the exit agreement; ``sink``: where its failures go
        otherwise (a parent family's visit), instead of this family's next
        agreement."""
        if t0 is None:
            t0 = time.perf_counter()
        with self.lock:
            core = self.core
            if core.code != OPEN or core.destroying or MPI.Is_finalized():
                self.check_usable("run a sync point", owner.describe())
            if self.size == 1 and self._idle(participants):
                # Nothing to drain, agree on or destroy, and no collective: what
                # the steps would do, without a protected region (an object
                # dying from now on is the next sync point's).
                seq = core.seq
                core.agreed(-1)
                return CollectStats(0, 0, 0, time.perf_counter() - t0, seq, collected)
            point = SyncPoint(self, Deadline(deadline), participants, owner, at_exit, final, sink)
            # A protected region: a signal's handler runs once the sync point's
            # collectives are done on this rank (see _interrupts).
            entered = _enter()
            try:
                return point.run(collected, t0)
            except BaseException as exc:
                self._left(exc)
                raise
            finally:
                self._done()
                _leave(entered)

    def quick(
        self,
        owner: Manager,
        t0: float,
        collected: int | None,
        extra: Participant | None,
        deadline: float | None = None,
    ) -> CollectStats:
        """:meth:`sync` without a final report, with ``extra`` (or no
        participant) of its own: the steady state in one call where the
        extension runs it, else (or where it found something unusual) the
        steps. Collective. (Every ``cgc.collect`` and scope sync point comes
        here, with its deadline or none: what is not the steady state's is
        in :meth:`_unsteady`.)"""
        core = self.core
        with self.lock:
            if core.code or core.destroying or self.size == 1 or _tracing.TRACER is not None:
                # (Traced, a sync point takes the steps, which mark their phases.)
                parts: tuple[Participant, ...] = () if extra is None else (extra,)
                return self.sync(
                    owner, deadline=deadline, collected=collected, t0=t0, participants=parts
                )
            if extra is None:
                fp, described = self.fingerprint, None
            else:
                fp, described = self._extra(extra, owner)
            # The sync point is one protected region, entered before the try
            # (an entry that raises, a handler run while it wraps the
            # handlers, has entered nothing: nothing to leave).
            entered = _enter()
            try:
                stats = (
                    core.steady(t0, collected, described, fp, _destroy.BATCHES, deadline)
                    if extra is None or described is not None
                    else None
                )
                if stats is None or core.progress:
                    return self._unsteady(stats, owner, t0, collected, extra, deadline)
                if _tracing.OBSERVER is not None:
                    _tracing.OBSERVER(self.label, "steady")
                return stats  # type: ignore[no-any-return]  # (CollectStats, from C)
            except BaseException as exc:
                self._left(exc)
                raise
            finally:
                # (What _done does, inlined: this is every sync point's path.)
                if core.inside:
                    core.left()
                if core.hold & HOLD_GONE:
                    self.maybe_free()
                _leave(entered)

    def _unsteady(
        self,
        stats: CollectStats | None,
        owner: Manager,
        t0: float,
        collected: int | None,
        extra: Participant | None,
        deadline: float | None,
    ) -> CollectStats:
        """What the steady state did not finish (see :meth:`quick`): the
        steps, from the start or from its agreement, or the failures of its
        destroys and finishes, kept for the next agreement (an interrupt
        among them raised here)."""
        core = self.core
        progress = core.progress
        way = "failed"
        try:
            if stats is not None:
                keep_failures(core, core.take_failed(), stats.sync, self.rank)
                return stats
            way = "steps"
            if MPI.Is_finalized():  # (the steady state looked: the steps refuse)
                self.check_usable("run a sync point", owner.describe())
            point = SyncPoint(
                self, Deadline(deadline), () if extra is None else (extra,), owner, False, False
            )
            try:
                return point.run(collected, t0, progress if progress == AGREE else 0)
            finally:
                way = point.way
        finally:
            if _tracing.OBSERVER is not None:
                _tracing.OBSERVER(self.label, way)

    def _extra(self, extra: Participant, owner: Manager) -> tuple[int, _Described | None]:
        """A sync point's own participant (a scope's): the fingerprint of the
        family's participants with it, and it as the steady state takes it
        (None: one whose finish must always run, so no steady state). Cached:
        a scope's participant is the same at each of its sync points."""
        last = self.extra
        if last is not None and last[0] is extra:
            return last[1], last[2]
        fp = _agree.fingerprint(identities([*self.participants, extra]))
        described = _describe(extra, owner) if extra.quiet_finish else None
        self.extra = (extra, fp, described)
        return fp, described

    def _done(self) -> None:
        """A sync point's end on this rank, however it ended."""
        self.core.left()
        if self.core.hold & HOLD_GONE:
            self.maybe_free()

    def _left(self, exc: BaseException) -> None:
        """A sync point left by ``exc``: what that makes of the family."""
        core = self.core
        exc = in_place_of(exc) or exc  # an interrupt held, raised in the error's place
        if isinstance(exc, CollectiveTimeoutError):
            # An abandoned collective could match a later one: never again. A
            # timeout of the family's own collectives told its other ranks (its
            # watch); one of a child's, visited from here, told only the
            # child's ranks: abandon tells this family's (announce sends once).
            reason = f"sync point {core.seq} timed out on this rank"
            if core.inside:
                self.abandon(reason)
            else:
                self.become(State.UNUSABLE, reason)
        elif isinstance(exc, CollectiveMismatchError):
            # Every rank saw the same agreement, so every rank gets here.
            if core.inside:
                self.become(State.UNUSABLE, f"the ranks disagreed at sync point {core.seq}")
        elif core.inside:
            # Left half-way through its collectives on this rank only (a
            # second Ctrl-C, out of memory): the other ranks' next collective
            # would match the wrong one.
            self.abandon(
                f"sync point {core.seq} was left on this rank by "
                f"{type(exc).__name__} before its collectives were done"
            )

    def _idle(self, extra: Sequence[Participant]) -> bool:
        """Whether a sync point of a family of size 1 would have nothing to do."""
        core = self.core
        return not (
            core.inbox
            or core.pending_keys()[0]
            or core.stale
            or extra
            or self.participants
            or self.children
            or core.unreported
            or self.leaving
            or self.recorded
        )

    def allgather(self, value: Any, timeout: float | None, describe: str) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the private
        duplicate. See :meth:`Manager.allgather`."""
        if self.size == 1:
            return [value]
        return self._collective(
            "gather from every rank",
            describe,
            timeout,
            lambda dl: _agree.gather(self.core, value, dl, self.what("a gather")),
        )

    def reduce_or(self, values: Sequence[int], timeout: float | None, describe: str) -> list[int]:
        """Collective: ``values`` ORed over the ranks (see :meth:`Manager.reduce_or`)."""
        if self.size == 1:
            return list(values)
        return self._collective(
            "reduce over the ranks",
            describe,
            timeout,
            lambda dl: _agree.any_words(self.core, values, dl, self.what("a reduction")),
        )

    def _collective(
        self, what: str, describe: str, timeout: float | None, run: Callable[[Deadline], _T]
    ) -> _T:
        with self.lock:
            if self.core.code != OPEN or MPI.Is_finalized():
                self.check_usable(what, describe)
            # A protected region: a signal's handler runs once the collective
            # is done, so that this rank does not leave one the others
            # complete (see _interrupts).
            deadline = Deadline(None if timeout is None else time.monotonic() + timeout)
            entered = _enter()
            try:
                return run(deadline)
            except BaseException as exc:
                self.abandon(f"a collective ({what}) was left by {type(exc).__name__} ({exc})")
                raise
            finally:
                _leave(entered)

    def what(self, stage: str) -> Callable[[], str]:
        """The message of a timeout at ``stage``: formatted only then, while the
        caller's frames are on the stack."""

        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self.rank}: sync point {self.core.seq} on the {self.label} did "
                f"not complete {stage} before its deadline; called from:\n{where}"
            )

        return describe

    # -- the end -------------------------------------------------------------------

    # A destroy may drop more managed objects; each later sync point agrees on
    # those, up to this many rounds (a destroy that always makes more would
    # never end).
    LAST_ROUNDS = 100

    def agreed_before(self) -> bool:
        """Whether the ranks ever made a collective here: if not, no rank has
        anything agreed to destroy, and a last sync point would be the first
        collective, perhaps on some ranks only (an exit, a close after an error)."""
        return self.size == 1 or self.core.comm is not None

    def last_syncs(self, owner: Manager, deadline: float | None, at_exit: bool) -> None:
        """Sync points until one destroys nothing (or LAST_ROUNDS), each
        reporting its own failures. Collective: how many each destroyed is
        agreed, so every rank runs as many. The caller makes it one
        protected region.

        A sync point's report does not end them: it may be that of failures
        an earlier sync point kept (such a one destroys nothing: its keys
        stay pending), and what is queued must still be destroyed. A report
        is agreed, so the family is still usable on every rank alike after
        one (a DestroyError there, or on a destroy's own rank its
        KeyboardInterrupt): the rounds go on, and the first exception is
        raised once they are done, the later ones noted on it. Anything that
        leaves the family unusable (a timeout, a mismatch, a collective left
        half-way) ends them, and so do two reports running, the second
        destroying nothing (a participant whose finish raises at every sync
        point)."""
        errors: list[BaseException] = []
        try:
            raised = False
            for _ in range(self.LAST_ROUNDS):
                before = self.core.destroyed  # (agreed destroys, explicit ones collective: alike)
                try:
                    stats = self.sync(owner, deadline=deadline, at_exit=at_exit, final=True)
                except BaseException as exc:  # noqa: BLE001 (raised below, once done)
                    errors.append(exc)
                    if self.core.code != OPEN:
                        break
                    if raised and self.core.destroyed == before:
                        break  # (two reports running: a finish that always raises)
                    raised = True
                    continue
                raised = False
                if (stats.destroyed == 0 and stats.visits == 0) or self.core.code != OPEN:
                    break  # (its last communicator may have let go in that one)
            if errors:
                first = errors[0]
                for later in errors[1:]:
                    first.add_note(f"and then: {type(later).__name__}: {later}")
                raise first
        finally:
            del errors  # see _destroy.Failure: no frame may hold what was raised

    def exit_agreement(self, owner: Manager, deadline: float) -> None:
        """At exit: the exit agreement (if any collective was ever made here),
        then a warning naming what is left. Collective. The caller, at exit,
        makes all the families' exit agreements one protected region."""
        if self.core.code == _FORKED:
            return
        entered = _enter()
        try:
            if self.core.reason is None and self.agreed_before():
                try:
                    self.last_syncs(owner, deadline, at_exit=True)
                except CollectiveTimeoutError:
                    warnings.warn(
                        f"collective_gc: rank {self.rank}: the final agreement on the "
                        f"{self.label} timed out at exit (did another rank exit early "
                        "or hang?)",
                        ExitLeakWarning,
                        stacklevel=1,
                    )
                except Exception as exc:  # reported: exit goes on with the other families
                    warnings.warn(f"collective_gc: at exit: {exc}", ExitLeakWarning, stacklevel=1)
        finally:
            # (Also when an interrupt held by the agreement is raised: what
            # it leaves is named all the same.)
            try:
                self._warn_left()
            finally:
                _leave(entered)

    def _warn_left(self) -> None:
        left = self.registry.pending(self.core.seq)
        if left:
            why = (
                f"the manager is unusable since {self.core.reason}"
                if self.core.reason is not None
                else "they were not queued on every rank"
            )
            warnings.warn(
                f"collective_gc: rank {self.rank}: leaked at exit ({why}): "
                f"{leak_text(left, self.label)}",
                ExitLeakWarning,
                stacklevel=1,
            )

    def end_exit(self) -> None:
        """At exit, once every family's exit agreement ran: withdraw the
        watch's standing receive, since MPI is finalized next (mpi4py's
        ``Py_AtExit``) and a receive still posted then is erroneous. No sync
        point runs here afterwards. Local.

        Not waiting for ever for the family's lock: a sync point on a daemon
        thread may hold it, waiting in a collective for a rank that will not
        come (this one, dying of an uncaught exception, say); then the
        receive is left posted, as before this existed."""
        if not self.lock.acquire(timeout=1.0):
            return
        try:
            if self.core.comm is not None and not MPI.Is_finalized():
                self.core.close(False)
                self.become(State.EXITED, "the program is exiting (its exit agreement ran)")
        finally:
            self.lock.release()

    def after_fork(self) -> list[Any]:
        """In a forked child: nothing here belongs to this process. Fresh
        locks: one that another thread held at the fork is never released
        there. Returns its registrations' calls, which the child keeps."""
        self.lock = threading.RLock()
        self.core.become(_FORKED, "this is a forked child", False)
        return self.registry.after_fork()


def leak_text(regs: Sequence[Any], label: str) -> str:
    """``regs`` (registrations), named for a leak message."""
    names = ", ".join(f"key {r.key} ({r.name!r})" for r in regs[:10])
    more = f" and {len(regs) - 10} more" if len(regs) > 10 else ""
    return f"{len(regs)} pending destroy(s) on the {label}: {names}{more}"


# -- the families of this process -------------------------------------------------

_LOCK = threading.RLock()
# Families in the order of their first collective (the same on every rank
# that shares them).
_FAMILIES: list[Collective] = []


def families() -> list[Collective]:
    """Every family of this process, in the order they were made (the same on
    every rank that shares them: they are made at collectives). Local."""
    with _LOCK:
        return list(_FAMILIES)


def family_of(
    comm: MPI.Intracomm, deadline: Deadline, what: Callable[[], str]
) -> tuple[Collective, bool]:
    """The family ``comm`` belongs to: an existing one whose communicators
    are congruent with it (the oldest such; never for a communicator of size
    1, which has nothing to share), else a new one, opened over
    ``comm`` (its private duplicate made: collective over ``comm``, against
    ``deadline``). Returns it, and whether it is new. Collective over
    ``comm``, at its first collective: every rank decides alike, since the
    families it compares with were themselves made at collectives."""
    size, rank = comm.Get_size(), comm.Get_rank()
    # A family of one process has no agreement to share: each communicator of
    # size 1 keeps its own (and its own sync points, as a program expects of
    # COMM_SELF and its duplicates).
    if size > 1:
        with _LOCK:
            for fam in _FAMILIES:
                core = fam.core
                if fam.size != size or core.code != OPEN or core.comm is None:
                    continue
                if MPI.Comm.Compare(core.comm, comm) in _SAME:
                    return fam, False
    fam = Collective(rank, size)
    fam.open(comm, deadline, what)
    with _LOCK:
        _FAMILIES.append(fam)
    return fam, True


_SAME = (MPI.IDENT, MPI.CONGRUENT)

# The next family number this process may give: every family of size > 1
# takes the largest any of its ranks offers, and each of them goes past it.
_next_number = 1


def _number(comm: MPI.Intracomm, deadline: Deadline, what: Callable[[], str]) -> int:
    """Collective over a new family's private duplicate: its number, the same
    on every rank (what a trace names it by, so that two families of one
    size over the same processes are told apart when the ranks' records are
    paired), and no rank's earlier family's. One allreduce, once per family."""
    global _next_number
    got = allreduce(comm, array.array("q", (_next_number,)), MPI.MAX, deadline, what)
    number = int(got[0])
    _next_number = number + 1
    return number


def forget(fam: Collective) -> None:
    """A family that let go of everything leaves the list. Local."""
    with _LOCK:
        if fam in _FAMILIES:
            _FAMILIES.remove(fam)


def after_fork() -> list[Any]:
    """In a forked child: every family belongs to the parent. Returns their
    registrations' calls, which the child keeps."""
    global _LOCK
    _LOCK = threading.RLock()
    calls = [call for fam in _FAMILIES for call in fam.after_fork()]
    _tree.after_fork()  # (its listed barriers are the parent's requests)
    return calls
