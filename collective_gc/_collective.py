"""The collective state of a family of congruent communicators.

Communicators with the same processes in the same order (MPI_Comm_compare:
IDENT or CONGRUENT) are one *family*: a user's communicator, its
``cgc.dup``\\s, a library's ``comm.Dup()`` of it (DOLFINx's per-mesh ones),
PETSc's inner duplicates. A registration on any of them is collective over
the same processes as one on any other, so the family needs one key counter
(:class:`~collective_gc._registry.Registry`), one private duplicate, one
agreement and one sequence of sync points, whatever the number of its
communicators: a sync point of any member is a sync point of the family, and
costs one collective in the steady state, not one per communicator.

:class:`Collective` owns that state: the private duplicate (made by the
family's first collective), the agreement (its buffer, window and watch:
:class:`~collective_gc._agree.Agreement`), the sync-point count, whether the
family is usable and why not, the participants its members added, the
derived families that are strict subsets of it (its *children*, visited by
its sync points only when one of their ranks has something for them), and
the failures not yet reported. It is the only way to make a collective of
the family: a sync point, a gather, the exit agreement; each of them that
is left by an exception on this rank only, half-way through its
collectives, leaves the family unusable (the others would match the wrong
collective next) and tells the other ranks so through the watch.

Its members are the :class:`~collective_gc.Manager`\\s of the family's
communicators: each registers on this registry with its own tag (the order
of registrations over members is agreed, see ``Registry.order``) and keeps
what is its own (its communicator, freed or not; closed or not; its view).
"""

from __future__ import annotations

import enum
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from mpi4py import MPI

from . import _agree, _interrupts
from ._destroy import Failure
from ._destroy import run as destroy_run
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ExitLeakWarning,
)
from ._registry import NO_KEYS, Registry, keys_of
from ._switch import STEADY
from ._syncpoint import (
    REACH_EPOCH,
    UNREACHED,
    CollectStats,
    Participant,
    SyncPoint,
    identities,
    keep_failures,
)
from ._tracing import TRACER
from ._transport import Deadline, Watch, dup

# A protected region's entry and exit, bound once (the hot path's calls).
_enter = _interrupts.enter
_leave = _interrupts.leave


if TYPE_CHECKING:
    from ._manager import Manager

__all__ = ["State", "Collective", "Child", "families", "family_of", "add_reacher"]


class State(enum.Enum):
    """What a manager can still do (:attr:`Manager.state`); :attr:`Manager.broken` says why."""

    OPEN = "open"  #: usable
    UNUSABLE = "unusable"  #: a timeout, a disagreement, an abandoned collective, mark_unusable
    RELEASED = "released"  #: its communicator was freed, and nothing was left registered
    EXITED = "exited"  #: the program is exiting: its exit agreement ran
    CLOSED = "closed"  #: :meth:`Manager.close` let go
    FORKED = "forked"  #: this is a forked child: everything belongs to the parent


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]


# The usable state, as a module global: the hot paths (a registration, a sync
# point) compare with it, and an Enum member read through its class costs
# about 100 ns in Python 3.11, a tenth of a registration.
_OPEN = State.OPEN


class Child(Protocol):
    """A derived family that is a strict subset of its parent's processes (a
    ``cgc.split``, a library's ``Split`` reached by a parent's sync point):
    visited by the parent's sync points when one of its ranks wants it.
    Implemented by :mod:`collective_gc._comms`."""

    #: the bit of the parent's children word that stands for it (the same on
    #: every rank of it: see _agree.child_bit)
    bit: int

    def member(self) -> bool:
        """Whether this rank is one of its processes. Local."""
        ...

    def wants(self) -> bool:
        """Whether this rank has something for its sync point. Local."""
        ...

    def visit(self, deadline: float | None) -> list[Failure]:
        """Collective over it: its sync point (and its free, once dropped and
        empty); what failed, for the parent to report."""
        ...

    def done(self) -> bool:
        """Whether it is gone (freed, or let go of) on this rank."""
        ...

    def idle(self) -> bool:
        """Whether this rank has nothing for the parent's sync point to do
        with it: not done, and not a member that wants its sync point (the
        steady state asks; a rank that finds a child not idle takes the
        sync point's steps). Local."""
        ...


class Collective:
    """The collective state of one family of congruent communicators (see
    the module docs). Made at the family's first collective; never by users."""

    __slots__ = (
        "rank",
        "size",
        "label",
        "registry",
        "comm",
        "agreement",
        "seq",
        "destroyed",
        "state",
        "reason",
        "lock",
        "destroying",
        "inside",
        "members",
        "next_tag",
        "participants",
        "owners",
        "identities",
        "fingerprint",
        "children",
        "parent",
        "reached",
        "ident",
        "unreported",
        "leaving",
        "gone",
        "extra_prints",
        "__weakref__",
    )

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.label = f"communicator of size {size} (rank {rank})"
        self.registry = Registry(self.label, size > 1)
        # The private duplicate, over which every collective of the family
        # goes (never matching a user's message); None for a family of size 1.
        self.comm: MPI.Intracomm | None = None
        self.agreement: _agree.Agreement | None = None
        self.seq = 0  # sync points completed
        self.destroyed = 0
        self.state = State.OPEN
        self.reason: str | None = None
        # Sync points and explicit destroys, one thread at a time.
        self.lock = threading.RLock()
        self.destroying = 0  # ident of the thread running this family's destroys
        # True while a sync point (or a gather) is inside its collectives on
        # this rank: leaving it by an exception then makes the family
        # unusable, and the private communicator is not released under it.
        self.inside = False
        # The managers of its communicators, by tag (the order they joined in,
        # the same on every rank: they join at collectives).
        self.members: weakref.WeakValueDictionary[int, Manager] = weakref.WeakValueDictionary()
        self.next_tag = 0
        self.participants: list[Participant] = []
        self.owners: list[Manager] = []  # the member each participant was added on (a proxy)
        self.identities = ""  # of participants (see Participant.identity)
        self.fingerprint = 0  # _agree.fingerprint of identities (0: none)
        self.children: list[Child] = []
        self.parent: Collective | None = None  # whose sync points reach this one, if any
        self.reached: object = None  # the REACH_EPOCH its last sync point looked at
        self.ident = 0  # as a child: its bit's source (see _agree.child_bit)
        # This rank's failures no sync point has reported yet, with the sync
        # point of each (see collective_gc._syncpoint: the next agreement
        # reports them).
        self.unreported: list[tuple[int, Failure]] = []
        # What may let go once nothing is registered on it (a member whose
        # communicator was freed, a dropped cgc.dup): tried by each sync
        # point after its destroys, at the same point on every rank; True
        # once done. Appended to from MPI attribute delete callbacks (a list
        # append: no MPI there).
        self.leaving: list[Callable[[], bool]] = []
        self.gone = False  # its last member left inside a sync point: free it at its end
        # fingerprint_with's answers (weak: a scope's participant goes with it);
        # emptied when the family's own participants change.
        self.extra_prints: weakref.WeakKeyDictionary[Participant, int] = weakref.WeakKeyDictionary()

    # -- making it -----------------------------------------------------------------

    def open(self, base: MPI.Intracomm, deadline: Deadline, what: Callable[[], str]) -> None:
        """Collective over ``base`` (a member's communicator): make the private
        duplicate and the agreement over it. A protected region's caller."""
        if self.size == 1 or self.comm is not None:
            return
        try:
            comm = dup(base, deadline, what)
        except BaseException as exc:
            # Never left pending: a duplicate still in progress when the user
            # frees the communicator would be completed on freed memory.
            self.become(
                State.UNUSABLE,
                f"duplicating its communicator was abandoned ({type(exc).__name__})",
                first=False,
            )
            raise
        self.comm = comm
        # Local: it only posts the receive of its watch (see _transport.Watch).
        self.agreement = _agree.Agreement(comm)

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
        return tag

    def leave(self, tag: int) -> bool:
        """The member ``tag`` has let go. True if the family let go too (see
        :meth:`maybe_free`). Collective in effect: members leave at the same
        point on every rank (a close, a sync point's step) or once the user
        freed their communicator (collectively)."""
        self.members.pop(tag, None)
        if not self.members:
            self.gone = True
        return self.maybe_free()

    def maybe_free(self) -> bool:
        """If no member is left and nothing is registered: let go of the
        private duplicate (local), unless a sync point is under way (its end
        does it). True if done."""
        if self.members or not self.registry.is_empty() or self.inside:
            return False
        self.gone = False
        if self.comm is None and self.state is not _OPEN:
            return True
        self.free_private()
        if self.state is _OPEN:
            self.state = State.RELEASED
            self.reason = "every communicator of it was freed or closed"
        forget(self)
        return True

    # -- state ---------------------------------------------------------------------

    def become(self, state: State, reason: str, *, first: bool = True) -> None:
        """Usable -> not: the first reason stays, unless ``first`` is false
        (letting go, which ends whatever state it was in)."""
        if first and self.reason is not None:
            return
        if self.state is not State.FORKED:
            self.state = state
        self.reason = reason

    def abandon(self, reason: str) -> None:
        """This rank left collectives of the private communicator that the
        others may still be in: unusable, and the others are told through
        the watch (their waits there end at once, not at a deadline they may
        not have). A timeout has told them already (see _transport.wait)."""
        self.become(State.UNUSABLE, reason)
        if self.agreement is not None:
            self.agreement.watch.announce(left=True)

    def check_usable(self, what: str, describe: str) -> None:
        """Raise :class:`CollectiveGCError` saying why ``what`` cannot be done
        on this rank now (``describe``: the communicator, for the message)."""
        if self.state is State.FORKED:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {describe} and its "
                "registrations belong to the parent process"
            )
        if self.destroying and self.destroying == threading.get_ident():
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{self.seq} on the {describe}; do it after the sync point"
            )
        if self.reason is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {describe} is unusable since {self.reason}"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {describe}: MPI is finalized")

    def usable(self) -> bool:
        """Whether a sync point could run now on this thread. Local."""
        return (
            self.state is _OPEN
            and not (self.destroying and self.destroying == threading.get_ident())
            and not MPI.Is_finalized()
        )

    # -- participants ----------------------------------------------------------------

    def add_participant(self, participant: Participant, owner: Manager) -> None:
        """See :meth:`Manager.add_participant`: two participants of one family
        may not vote in the same field."""
        if participant in self.participants:
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
        self.identities = identities(self.participants)
        self.fingerprint = _agree.fingerprint(self.identities)
        self.extra_prints.clear()

    def drop_participants(self, owner: Manager) -> None:
        """The participants added on ``owner``, a member that leaves, leave
        too. Collective in effect: members leave at the same point on every rank."""
        kept = [(p, o) for p, o in zip(self.participants, self.owners) if o is not owner]
        if len(kept) == len(self.participants):
            return
        self.participants = [p for p, _ in kept]
        self.owners = [o for _, o in kept]
        self.identities = identities(self.participants)
        self.fingerprint = _agree.fingerprint(self.identities) if self.identities else 0
        self.extra_prints.clear()

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
            # What letting go of one queued (a freed cgc.dup's manager) goes now too.
            todo.extend(self.leaving)
            self.leaving.clear()
        self.leaving = kept

    def participant(self, kind: type[Participant]) -> Participant | None:
        """The participant of exactly that class the family has, if any. Local."""
        for p in self.participants:
            if type(p) is kind:
                return p
        return None

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
            if self.state is not _OPEN or self.destroying or MPI.Is_finalized():
                self.check_usable("run a sync point", owner.describe())
            if self.size == 1 and self._idle(participants):
                # Nothing to drain, agree on or destroy, and no collective: what
                # the steps would do, without a protected region (an object
                # dying from now on is the next sync point's).
                seq = self.seq
                self.seq = seq + 1
                return CollectStats(0, 0, 0, time.perf_counter() - t0, seq, collected)
            # A protected region: a signal's handler runs once the sync point's
            # collectives are done on this rank (see _interrupts).
            entered = _interrupts.enter()
            try:
                return self._rest(
                    None, owner, deadline, participants, collected, t0, at_exit, final, sink
                )
            except BaseException as exc:
                self._left(exc)
                raise
            finally:
                self.inside = False
                if self.gone:
                    self.maybe_free()
                _interrupts.leave(entered)

    def quick(
        self, owner: Manager, t0: float, collected: int | None, extra: Participant | None
    ) -> CollectStats:
        """:meth:`sync` without a deadline or a final report, with ``extra``
        (or no participant) of its own: the steady state first. Collective."""
        parts: tuple[Participant, ...] = () if extra is None else (extra,)
        with self.lock:
            if self.state is not _OPEN or self.destroying or self.size == 1 or TRACER[0]:
                # (Traced, a sync point takes the steps, which mark their phases.)
                return self.sync(owner, collected=collected, t0=t0, participants=parts)
            # The sync point is one protected region, entered before the
            # try (an entry that raises, a handler run while it wraps the
            # handlers, has entered nothing: nothing to leave); the steady
            # state leaves it itself when it returns the sync point's stats
            # (see steady_py).
            fp = self.fingerprint if extra is None else self.fingerprint_with(extra)
            entered = _enter()
            left = False
            try:
                got = _STEADY(self, t0, collected, extra, owner, fp, entered)
                if type(got) is CollectStats:
                    left = True
                    return got
                if got is not None and got[0] == "leave":
                    done: CollectStats = got[1]
                    return done  # leaving the region below runs the deferred handlers
                return self._rest(got, owner, None, parts, collected, t0, False, False, None)
            except BaseException as exc:
                self._left(exc)
                raise
            finally:
                self.inside = False
                if self.gone:
                    self.maybe_free()
                if not left:
                    _leave(entered)

    def fingerprint_with(self, extra: Participant) -> int:
        """The fingerprint of the family's participants and ``extra`` (a
        sync point's own: a scope's), as the agreement carries it. Cached:
        a scope's participant is the same at each of its sync points."""
        cache = self.extra_prints
        found = cache.get(extra)
        if found is None:
            found = cache[extra] = _agree.fingerprint(identities([*self.participants, extra]))
        return found

    def _rest(
        self,
        got: Any,
        owner: Manager,
        deadline: float | None,
        participants: Sequence[Participant],
        collected: int | None,
        t0: float,
        at_exit: bool,
        final: bool,
        sink: list[tuple[int, Failure]] | None,
    ) -> CollectStats:
        """What the steady state handed back (None: nothing done), then the
        sync point's steps (see :class:`SyncPoint`) if it is not done."""
        exchanged = None
        if got is None:
            if MPI.Is_finalized():
                self.check_usable("run a sync point", owner.describe())
        elif got[0] == "failed":
            # Its destroys ran and some raised: kept for the next agreement
            # (an interrupt among them is raised here).
            stats: CollectStats = got[1]
            keep_failures(self.unreported, got[2], stats.sync, self.rank)
            return stats
        else:
            exchanged = self._after_steady(got)
        point = SyncPoint(self, Deadline(deadline), participants, owner, at_exit, final, sink)
        return point.run(collected, t0, exchanged)

    def _left(self, exc: BaseException) -> None:
        """A sync point left by ``exc``: what that makes of the family."""
        if isinstance(exc, CollectiveTimeoutError):
            # An abandoned collective could match a later one: never again.
            self.become(State.UNUSABLE, f"sync point {self.seq} timed out on this rank")
        elif isinstance(exc, CollectiveMismatchError):
            # Every rank saw the same agreement, so every rank gets here.
            if self.inside:
                self.become(State.UNUSABLE, f"the ranks disagreed at sync point {self.seq}")
        elif self.inside:
            # Left half-way through its collectives on this rank only (a
            # second Ctrl-C, out of memory): the other ranks' next collective
            # would match the wrong one.
            self.abandon(
                f"sync point {self.seq} was left on this rank by "
                f"{type(exc).__name__} before its collectives were done"
            )

    def _after_steady(self, got: tuple[Any, ...]) -> tuple[int, int]:
        """What the steady state handed back that is not a finished sync
        point (see steady_py): where the rest of the sync point's steps go
        on from its agreement, or a notice that a rank gave up."""
        if got[0] == "resume":
            return got[1], got[2]
        # "watch": a rank gave up while this one waited in the allreduce (its
        # notice completed the watch's receive, which fired() reads).
        agreement = self.agreement
        assert agreement is not None
        agreement.abandoned(got[1])
        agreement.watch.fired()
        raise agreement.watch.error(self.what("its agreement"))

    def _idle(self, extra: Sequence[Participant]) -> bool:
        """Whether a sync point of a family of size 1 would have nothing to do."""
        r = self.registry
        return not (
            r.inbox
            or r.pend.size
            or r.stale
            or r.last_cyclic
            or extra
            or self.participants
            or self.children
            or self.unreported
            or self.leaving
        )

    def allgather(self, value: Any, timeout: float | None, describe: str) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the private
        duplicate. See :meth:`Manager.allgather`."""
        if self.size == 1:
            return [value]
        with self.lock:
            if self.state is not _OPEN or MPI.Is_finalized():
                self.check_usable("gather from every rank", describe)
            # A protected region: a signal's handler runs once the gather is
            # done, so that this rank does not leave a collective the others
            # complete (see _interrupts).
            deadline = Deadline(None if timeout is None else time.monotonic() + timeout)
            entered = _interrupts.enter()
            try:
                agreement = self.agreement
                assert agreement is not None, "a family of size > 1 is opened when made"
                return agreement.allgather(value, deadline, self.what("a gather"))
            except BaseException as exc:
                self.abandon(f"a gather was left by {type(exc).__name__} ({exc})")
                raise
            finally:
                _interrupts.leave(entered)

    def reduce_or(self, values: Sequence[int], timeout: float | None, describe: str) -> list[int]:
        """Collective: ``values`` ORed over the ranks (see :meth:`Manager.reduce_or`)."""
        if self.size == 1:
            return list(values)
        with self.lock:
            if self.state is not _OPEN or MPI.Is_finalized():
                self.check_usable("reduce over the ranks", describe)
            deadline = Deadline(None if timeout is None else time.monotonic() + timeout)
            entered = _interrupts.enter()
            try:
                agreement = self.agreement
                assert agreement is not None, "a family of size > 1 is opened when made"
                return agreement.any_words(values, deadline, self.what("a reduction"))
            except BaseException as exc:
                self.abandon(f"a reduction was left by {type(exc).__name__} ({exc})")
                raise
            finally:
                _interrupts.leave(entered)

    def what(self, stage: str) -> Callable[[], str]:
        """The message of a timeout at ``stage``: formatted only then, while the
        caller's frames are on the stack."""

        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self.rank}: sync point {self.seq} on the {self.label} did "
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
        return self.size == 1 or self.comm is not None

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
        half-way) ends them, and so do two reports running (a participant
        whose finish raises at every sync point)."""
        errors: list[BaseException] = []
        try:
            raised = False
            for _ in range(self.LAST_ROUNDS):
                try:
                    stats = self.sync(owner, deadline=deadline, at_exit=at_exit, final=True)
                except BaseException as exc:  # noqa: BLE001 (raised below, once done)
                    errors.append(exc)
                    if self.state is not _OPEN or raised:
                        break  # (two reports running: a finish that always raises)
                    raised = True
                    continue
                raised = False
                if (stats.destroyed == 0 and stats.visits == 0) or self.state is not _OPEN:
                    break  # (its last communicator may have let go in that one)
            if errors:
                first = errors[0]
                for later in errors[1:]:
                    first.add_note(f"and then: {type(later).__name__}: {later}")
                raise first
        finally:
            del errors  # see _destroy.Failure: no frame may hold what was raised

    def free_private(self) -> None:
        """Let go of the private duplicate. Local: the agreement's standing
        receive is withdrawn first."""
        agreement, self.agreement = self.agreement, None
        if agreement is not None and not MPI.Is_finalized():
            agreement.close()
        if self.comm is not None and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = None

    def exit_agreement(self, owner: Manager, deadline: float) -> None:
        """At exit: the exit agreement (if any collective was ever made here),
        then a warning naming what is left. Collective. The caller, at exit,
        makes all the families' exit agreements one protected region."""
        if self.state is State.FORKED:
            return
        entered = _interrupts.enter()
        try:
            if self.reason is None and self.agreed_before():
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
            left = self.registry.pending(self.seq)
            if left:
                why = (
                    f"the manager is unusable since {self.reason}"
                    if self.reason is not None
                    else "they were not queued on every rank"
                )
                warnings.warn(
                    f"collective_gc: rank {self.rank}: leaked at exit ({why}): "
                    f"{leak_text(left, self.label)}",
                    ExitLeakWarning,
                    stacklevel=1,
                )
        finally:
            _interrupts.leave(entered)

    def end_exit(self) -> None:
        """At exit, once every family's exit agreement ran: withdraw the
        standing receive of the agreement's watch, since MPI is finalized
        next (mpi4py's ``Py_AtExit``) and a receive still posted then is
        erroneous. No sync point runs here afterwards. Local."""
        with self.lock:
            if self.agreement is not None and not MPI.Is_finalized():
                self.agreement.close()
                self.agreement = None
                self.become(State.EXITED, "the program is exiting (its exit agreement ran)")

    def after_fork(self) -> None:
        """In a forked child: nothing here belongs to this process. Fresh
        locks: one that another thread held at the fork is never released there."""
        self.lock = threading.RLock()
        self.state = State.FORKED
        self.registry.after_fork()


# -- the steady state ------------------------------------------------------------


def steady_py(
    fam: Collective,
    t0: float,
    collected: int | None,
    extra: Participant | None,
    owner: Manager | None,
    fp: int,
    entered: bool,
) -> Any:
    """A sync point of ``fam`` in its steady state, in one call: what
    ``_speedups.steady`` does in C (where the extension was built with MPI,
    through mpi4py's C API), step for step; this is its twin.

    Called by :meth:`Collective.quick` with the family's lock held, for a
    sync point without a deadline, on a family of size > 1 that is usable;
    ``extra`` is its own participant (a scope's) or None, with ``owner``,
    and ``fp`` the participants' fingerprint (the family's, with ``extra``'s).
    It returns:

    - None, having changed nothing: the sync point is not steady (a failure
      to report, a derived family to visit, a member to let go, keys pending
      from before, a cyclic death, a participant that votes or must finish,
      the agreement's buffer to reshape): :class:`SyncPoint` runs it all;
    - the :class:`CollectStats` of the sync point it ran: votes all 0, the
      inbox drained, one allreduce that agreed on every drained key and on
      nothing else, and their destroys, which all succeeded;
    - ``("failed", stats, failures)``: the same, but some destroys raised;
    - ``("resume", first, last)``: its allreduce found something else (a
      flag, a mismatch, keys not pending everywhere, a derived family to
      visit): the drained keys are now the pending ones, and the sync point's
      steps go on from its agreement (``SyncPoint.run(exchanged=...)``);
    - ``("watch", request)``: a rank gave up while this one waited: the
      allreduce's request (None: the persistent one) is abandoned;
    - ``("leave", stats)``: done, but signals arrived meanwhile: the
      caller's leaving the protected region runs their handlers.

    The caller has entered the protected region (``entered``: what
    :func:`_interrupts.enter` returned): returning stats, this has left it;
    anything else (an exception too), and the caller leaves it once the sync
    point's steps are done.
    """
    r = fam.registry
    agreement = fam.agreement
    if (
        fam.destroying
        or fam.unreported
        or fam.leaving
        or (fam.children and not all(c.idle() for c in fam.children))
        or (UNREACHED and fam.reached is not REACH_EPOCH[0])
        or agreement is None
        or r.stale
        or r.last_cyclic
        or r.pend.size
        or not agreement.ready()
        or MPI.Is_finalized()  # (the Python steps refuse after MPI_Finalize)
    ):
        return None
    # Votes: only participants that a quiet sync point needs nothing of, all 0.
    for p, o in zip(fam.participants, fam.owners):
        if not p.quiet_finish or (p.field is not None and p.vote(o) != 0):
            return None
    if extra is not None:
        assert owner is not None
        if not extra.quiet_finish or (extra.field is not None and extra.vote(owner) != 0):
            return None
    inbox = r.inbox
    n = len(inbox)
    keys = NO_KEYS
    if n:
        batch = inbox[:n]
        keys, cyclic = keys_of(batch)
        if cyclic:
            return None
        del inbox[:n]  # one C call: appends racing with it land after the slice
        del batch
    seq = fam.seq
    parts = fam.fingerprint if fp is None else fp
    head = _agree.Header(seq, r.next_key, False, 0, parts ^ _agree.as_int64(r.order))
    dl = Deadline(None)
    fam.inside = True
    try:
        first, last = agreement.exchange(head, keys, dl, fam.what("its agreement"))
    except CollectiveTimeoutError:
        # Without a deadline, only the watch ends a wait: a rank gave up (the
        # exchange kept what it abandoned).
        if keys.size:
            r.pend, r.pend_seq = keys, np.full(keys.size, seq)
        return ("watch", None)
    red = agreement.buffer()
    if (
        red[6] != -1  # ~flags: some flag set somewhere
        or red[7] != 0  # keys outside the window may be pending everywhere
        or red[8] != -1  # ~children: a derived family to visit
        or red[0] != ~red[1]
        or red[2] != ~red[3]
        or red[4] != ~red[5]
    ):
        agreed = None
    else:
        agreed = agreement.window_keys() if last > first else NO_KEYS
    if agreed is None or agreed.size != keys.size:
        # Unusual: the drained keys become the pending ones, as a drain makes
        # them, and the sync point goes on from its agreement.
        if keys.size:
            r.pend, r.pend_seq = keys, np.full(keys.size, seq)
        return ("resume", first, last)
    agreement.window.advance(head.next_key)
    r.new_interval()
    fam.seq = seq + 1
    fam.inside = False
    count = 0
    failures: list[Failure] = []
    if keys.size:
        fam.destroying = threading.get_ident()
        try:
            count, failures, interrupt = destroy_run(r, keys)
        finally:
            fam.destroying = 0
            fam.destroyed += count
        if interrupt is not None:  # (only from Python's own steps between runs)
            failures.append((-1, "the sync point's own steps between its destroys", interrupt))
        del interrupt
    stats = CollectStats(count, len(inbox), 0, time.perf_counter() - t0, seq, collected, 0)
    if failures:
        return ("failed", stats, failures)
    if _interrupts.deferred():
        return ("leave", stats)  # the caller's leave runs their handlers
    _leave(entered)
    return stats


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
                if fam.size != size or fam.state is not _OPEN or fam.comm is None:
                    continue
                if MPI.Comm.Compare(fam.comm, comm) in _SAME:
                    return fam, False
    fam = Collective(rank, size)
    fam.open(comm, deadline, what)
    with _LOCK:
        _FAMILIES.append(fam)
    return fam, True


_SAME = (MPI.IDENT, MPI.CONGRUENT)


def forget(fam: Collective) -> None:
    """A family that let go of everything leaves the list. Local."""
    with _LOCK:
        if fam in _FAMILIES:
            _FAMILIES.remove(fam)


def after_fork() -> None:
    """In a forked child: every family belongs to the parent."""
    global _LOCK
    _LOCK = threading.RLock()
    for fam in _FAMILIES:
        fam.after_fork()


# Called at the start of each sync point of a family of size > 1 with that
# family (collective_gc._comms: a communicator a library made, first used
# before any family containing it existed, is adopted there).
_REACHERS: list[Callable[[Collective], None]] = []


def add_reacher(reach: Callable[[Collective], None]) -> None:
    """Call ``reach(family)`` at each sync point of a family of size > 1,
    before its agreement (at the same point on every rank). Local."""
    if reach not in _REACHERS:
        _REACHERS.append(reach)


def reachers() -> Iterable[Callable[[Collective], None]]:
    return _REACHERS


def _as_keys(raw: bytearray) -> np.ndarray[Any, Any]:
    return np.frombuffer(raw, np.int64)


def _ages(n: int, seq: int) -> np.ndarray[Any, Any]:
    return np.full(n, seq, dtype=np.int64)


# The steady state: C where the extension was built with MPI (the one
# decision, collective_gc._switch), else its Python twin.
_STEADY: Callable[..., Any] = steady_py
if STEADY is not None:
    STEADY.steady_setup(
        Collective,
        Registry,
        _agree.Agreement,
        _agree.Window,
        Watch,
        CollectStats,
        State.OPEN,
        UNREACHED,
        REACH_EPOCH,
        destroy_run,
        _as_keys,
        _ages,
    )
    _STEADY = STEADY.steady
