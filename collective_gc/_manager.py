"""The per-communicator manager.

A :class:`Manager` is what a communicator's users see of collective_gc: it
registers objects, runs sync points, gathers, and lets go at close, at exit,
in a forked child, or once the user freed the communicator. What is
collective lives in its *family* (:class:`~collective_gc._collective.Collective`),
which every communicator congruent with this one shares (a ``cgc.dup``, a
library's ``Dup``, PETSc's inner duplicates): one key counter, one private
duplicate, one agreement. The manager joins its family at its first
collective (its first registration or sync point, or when ``cgc.dup`` makes
it): then an existing family of congruent communicators is found, or a new
one made, with its private duplicate (``MPI_Comm_idup``, against the
deadline if there is one), so that a lookup, :func:`~collective_gc.pending`
or a scope's constructor never waits for another rank.

What other modules of the library need beyond the public methods (the
family, joining one, the communicator's free) are the functions at the end
of this module.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mpi4py import MPI

from . import _interrupts, _lineage
from ._collective import Collective, State, family_of, leak_text
from ._errors import CollectiveGCError, ExitLeakWarning
from ._registration import DETACHED, Registration, check_name, owned_by
from ._syncpoint import CollectStats, Participant, what_raised
from ._transport import Deadline

__all__ = [
    "Manager",
    "State",
    "Snapshot",
    "set_timeout_source",
    "set_first_collective",
    "family",
    "open_family",
    "quick_sync",
    "set_label",
    "join",
    "comm_was_freed",
    "release",
    "let_go",
    "pending_text",
    "after_fork",
]

_OPEN = State.OPEN


class Snapshot(NamedTuple):
    """A manager's state on this rank, read without changing anything.

    Attributes:
        pending: registrations queued here (dead, destroy not yet agreed), oldest first.
        alive: registrations whose objects are alive here, oldest first.
        cyclic: registrations finalized by the cyclic collector since the last sync point.
        broken: why the manager is unusable, or None.
        sync_count: sync points completed.
        next_key: the key the next registration will get.
    """

    pending: list[Registration]
    alive: list[Registration]
    cyclic: list[Registration]
    broken: str | None
    sync_count: int
    next_key: int


# Where the first registration on a communicator finds its timeout (the
# innermost scope's); set by _scope.
_TIMEOUT_SOURCE: list[Callable[[], float | None]] = [lambda: None]


def set_timeout_source(source: Callable[[], float | None]) -> None:
    """Where the first registration on a communicator finds its timeout (seconds or None)."""
    _TIMEOUT_SOURCE[0] = source


# Called with each manager and whether its family is new, when it joins one
# at its first collective (collective_gc._comms: a new family that is a
# strict subset of a scope's or COMM_WORLD's is reached by their sync points).
_ON_FIRST: list[Callable[[Manager, bool], None]] = []


def set_first_collective(hook: Callable[[Manager, bool], None]) -> None:
    """Call ``hook(mgr, new_family)`` at each manager's first collective
    (every rank of its communicator at the same point of the program). Local."""
    _ON_FIRST[:] = [hook]


# One thread at a time makes a manager's first collective (a first
# registration on one thread, a first sync point on another).
_FIRST = threading.RLock()


class Manager:
    """The collective deferred-destroy manager of one communicator.

    Get it with :func:`collective_gc.manager`; do not construct it.
    """

    def __init__(self, comm: MPI.Intracomm, on_close: Callable[[Manager], None]) -> None:
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        # A wrapper of the handle, never the user's object: it may be a
        # managed one (cgc.dup) whose death we wait for.
        self._user_comm = MPI.Intracomm(comm)
        self._fam: Collective | None = None  # joined at the first collective
        self._tag = -1  # in the family: the order it joined in (0: its first member)
        # What its registrations add to the order fingerprint with: its tag,
        # or where it was made if it joined at its first use (see _lineage).
        self._mark = -1
        # What registrations point to: a proxy, since the family's registry
        # holds the registrations and the manager holds the family.
        self._proxy = weakref.proxy(self)
        self._on_close = on_close
        # Its own state, beside its family's (see state).
        self._state = _OPEN
        self._reason: str | None = None
        self._comm_freed = False
        # Freed by collective_gc itself at an agreed point (a dropped
        # cgc.dup or cgc.split, nothing registered on it): the same point on
        # every rank, so it may leave without waiting for every rank's record.
        self._free_agreed = False
        self._label: str | None = None  # what messages call it (see set_label)

    # -- description -----------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The user's communicator (not the private duplicate).

        Raises :class:`CollectiveGCError` once it was freed, or MPI finalized.
        """
        if self._comm_freed:
            raise CollectiveGCError(
                f"the {self.describe()} was freed (comm.Free()); its manager can no "
                "longer give it out"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"MPI is finalized: the {self.describe()} is gone")
        return self._user_comm

    @property
    def comm_freed(self) -> bool:
        """True once the user's communicator was freed."""
        return self._comm_freed

    @property
    def state(self) -> State:
        """What this manager can still do (see :class:`State`): its own state
        (closed, released, forked), else its family's (the communicators
        congruent with this one share sync points: a timeout or a
        disagreement on one makes them all unusable)."""
        if self._state is not _OPEN or self._fam is None:
            return self._state
        return self._fam.state

    @property
    def broken(self) -> str | None:
        """Why this manager is unusable (a timeout, a disagreement, ...), or None."""
        if self._reason is not None or self._fam is None:
            return self._reason
        return self._fam.reason

    @property
    def size(self) -> int:
        """Size of the communicator."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def sync_count(self) -> int:
        """How many sync points have completed on this communicator's family
        (the communicators congruent with it share them)."""
        return 0 if self._fam is None else self._fam.seq

    @property
    def next_key(self) -> int:
        """The key the next registration will get (the registrations made so
        far on this communicator's family, which share one counter)."""
        return 0 if self._fam is None else self._fam.core.next_key

    @property
    def registered(self) -> int:
        """Registrations on this communicator whose destroy has not run
        (objects alive or queued). Local."""
        return 0 if self._fam is None else self._fam.registry.count(self._proxy)

    @property
    def destroyed(self) -> int:
        """Destroys run on this communicator's family (by sync points and explicit calls)."""
        return 0 if self._fam is None else self._fam.core.destroyed

    @property
    def message(self) -> tuple[int, int, int] | None:
        """``(words, lo, bits)``: the length in int64 words of the last
        agreement's message on this rank, and the window of keys
        ``[lo, lo + bits)`` the next one carries as a bitmap (a key pending
        outside it goes through a second round). None on a communicator of
        size 1, or before the first collective. Local."""
        core = None if self._fam is None else self._fam.core
        if core is None or core.comm is None:
            return None
        lo, bits = core.window
        return core.words, lo, bits

    @property
    def cyclic(self) -> int:
        """Cyclic-GC deaths of managed objects seen by sync points so far (of the family)."""
        return 0 if self._fam is None else self._fam.registry.cyclic_total

    @property
    def last_cyclic(self) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths the last sync point drained."""
        return [] if self._fam is None else self._fam.registry.cyclic_of_last()

    def cyclic_deaths(
        self, since: int = 0
    ) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths sync points have seen,
        from the ``since``-th on (compare :attr:`cyclic`; the last 10,000 are
        kept). Local, changes nothing."""
        if self._fam is None:
            return []
        registry = self._fam.registry
        log = registry.cyclic_log
        first = registry.cyclic_total - len(log)
        return list(log[max(0, since - first) :])

    def describe(self) -> str:
        """``"communicator of size N (rank r)"`` (or what made it: ``"dup #0 of
        a communicator of size N (rank r)"``), for messages."""
        return self._label or f"communicator of size {self._size} (rank {self._rank})"

    def __repr__(self) -> str:
        state = self.state
        shown = "" if state is _OPEN else f" {state.value}"
        return (
            f"<collective_gc.Manager{shown} of a {self.describe()}: "
            f"{self.registered} registered, {len(self.pending())} pending, "
            f"{self.destroyed} destroyed, {self.sync_count} sync points>"
        )

    # -- state -------------------------------------------------------------------

    def mark_unusable(self, reason: str) -> None:
        """Refuse every later registration and sync point, saying ``reason``. Local.

        Collective in effect: call it on every rank alike (a participant
        deciding on agreed flags, say). The first reason stays. The
        communicators congruent with this one share its sync points, and
        become unusable with it.
        """
        if self._fam is not None:
            self._fam.become(State.UNUSABLE, reason)
        else:
            self._become(State.UNUSABLE, reason)

    def _become(self, state: State, reason: str, *, first: bool = True) -> None:
        if first and self._reason is not None:
            return
        if self._state is not State.FORKED:
            self._state = state
        self._reason = reason

    def refuse_if_unusable(self, what: str) -> None:
        """Raise :class:`CollectiveGCError` (saying it cannot ``what``) if a
        registration or a sync point would be refused now, on this thread: in
        a forked child, inside a destroy of this family's sync point, once
        unusable, or after MPI_Finalize. Local. For work that must not begin
        unless its registration can follow (a derived communicator, say)."""
        fam = self._fam
        if self._state is not _OPEN:
            self._check_own(what)
        if fam is not None and not fam.usable():
            fam.check_usable(what, self.describe())
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {self.describe()}: MPI is finalized")

    def _check_own(self, what: str) -> None:
        if self._state is State.FORKED:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {self.describe()} and its "
                "registrations belong to the parent process"
            )
        raise CollectiveGCError(
            f"cannot {what}: the {self.describe()} is unusable since {self._reason}"
        )

    # -- participants ------------------------------------------------------------

    def add_participant(self, participant: Participant) -> None:
        """Let ``participant`` take part in every sync point of this
        communicator's family (called with this manager). Collective: add the
        same participants on every rank, in the same order (it may make the
        family's first collective). Adding it again does nothing; two
        participants of a family may not vote in the same field."""
        self._family(None).add_participant(participant, self)

    def remove_participant(self, participant: Participant) -> None:
        """``participant`` takes part in no more sync points of the family.
        Collective in effect, as adding it is: remove it on every rank, at the
        same point. Removing one that is not there does nothing."""
        if self._fam is not None:
            self._fam.remove_participant(participant)

    @property
    def participants(self) -> tuple[Participant, ...]:
        """The participants added on this communicator, in order."""
        fam = self._fam
        if fam is None:
            return ()
        return tuple(p for p, o in zip(fam.participants, fam.owners) if o is self)

    def participant(self, kind: type[Participant]) -> Participant | None:
        """The participant of exactly class ``kind`` this communicator's family
        has (added on any of its communicators), or None. Local: how an
        adapter finds its own state (``collective_gc.petsc`` its cleanup)."""
        return None if self._fam is None else self._fam.participant(kind)

    def view_rows(self) -> list[tuple[str, str]]:
        """What the family's participants show in :func:`collective_gc.view`
        for this rank (their :meth:`Participant.view_rows`). Local. One that
        raises gives a row saying so: view gathers these rows from every
        rank, and a rank that raised instead would leave the others waiting."""
        rows: list[tuple[str, str]] = []
        for p in () if self._fam is None else list(self._fam.participants):
            try:
                rows.extend(p.view_rows(self))
            except Exception as exc:  # noqa: BLE001 (reported in the table)
                rows.append(("<view>", f"{type(p).__name__}.view_rows raised {what_raised(exc)}"))
        return rows

    def leak_reasons(self) -> list[str]:
        """What the family's participants say of the objects still alive
        here (their :meth:`Participant.leak_reasons`). Local. One that
        raises gives a line saying so (leak reports are gathered from every rank)."""
        lines: list[str] = []
        for p in () if self._fam is None else list(self._fam.participants):
            try:
                lines.extend(p.leak_reasons(self))
            except Exception as exc:  # noqa: BLE001 (reported in the leak report)
                lines.append(f"{type(p).__name__}.leak_reasons raised {what_raised(exc)}")
        return lines

    # -- registration ------------------------------------------------------------

    def register(
        self,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
    ) -> Registration:
        """Collective. See :func:`collective_gc.register`."""
        if name is not None and type(name) is not str:
            check_name(name)
        fam = self._fam
        if fam is None:
            # The first registration joins the family (making it if needed,
            # with its private duplicate) while the communicator is surely
            # alive (the user may free it before any sync point), against the
            # innermost scope's timeout; one protected region: a signal's
            # handler runs once the object is registered, as every rank's
            # registration then completes.
            timeout = _TIMEOUT_SOURCE[0]()
            entered = _interrupts.enter()
            try:
                fam = self._family(None if timeout is None else time.monotonic() + timeout)
                return self._add(fam, obj, destroy, args, kwargs, name)
            finally:
                _interrupts.leave(entered)
        return self._add(fam, obj, destroy, args, kwargs, name)

    def _add(
        self,
        fam: Collective,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
    ) -> Registration:
        core = fam.core
        if self._state is not _OPEN or core.code or core.destroying or MPI.Is_finalized():
            self.refuse_if_unusable("register an object")
        if not kwargs:
            reg = core.add_plain(self._proxy, self._mark, obj, destroy, args, name)
            if reg is not None:
                return reg  # type: ignore[no-any-return]
        return fam.registry.add(self._proxy, self._mark, obj, destroy, args, kwargs, name)

    def destroy_registration(self, reg: Registration) -> None:
        """``reg.destroy()``: run it now, once. Collective like the destroy itself."""
        fam = self._fam
        if fam is None:
            return
        with fam.lock:
            if not reg.alive:
                return
            self.refuse_if_unusable(f"destroy key {reg.key} ({reg.name!r})")
            fam.core.destroy_now(reg)

    def detach_registration(self, reg: Registration) -> bool:
        """``reg.detach()``: forget it without running it. Local."""
        fam = self._fam
        if fam is None:
            return False
        with fam.lock:
            return fam.registry.retire(reg, DETACHED) is not None

    # -- reads that change nothing -------------------------------------------

    def pending(self) -> list[Registration]:
        """What this rank has queued on this communicator, oldest key first.
        Local; safe at any time, from any thread, inside a destroy too."""
        fam = self._fam
        return [] if fam is None else fam.registry.pending(fam.seq, self._proxy)

    def alive(self) -> list[Registration]:
        """Registrations on this communicator whose objects are still alive on this rank. Local."""
        fam = self._fam
        return [] if fam is None else fam.registry.alive(self._proxy)

    def cyclic_pending(self) -> list[Registration]:
        """Cyclic-GC deaths on this communicator not yet seen by a sync point. Local."""
        fam = self._fam
        if fam is None:
            return []
        return owned_by(fam.registry.cyclic_pending(), self._proxy)

    def snapshot(self) -> Snapshot:
        """Everything above at once. Local, changes nothing."""
        return Snapshot(
            self.pending(),
            self.alive(),
            self.cyclic_pending(),
            self.broken,
            self.sync_count,
            self.next_key,
        )

    # -- collectives -------------------------------------------------------------

    def _family(self, deadline: float | None) -> Collective:
        """The family, joined (or made) at this manager's first collective,
        against ``deadline``. Collective over the communicator then."""
        fam = self._fam
        if fam is not None:
            return fam
        # Under the lock: a first registration on one thread and a first sync
        # point on another must not join twice. On this thread, a collection
        # that runs in here (at an allocation; CPython 3.12 runs a due one
        # when a Python function starts) may run a finalizer that registers
        # on this communicator: it comes back (the lock is re-entrant) and
        # joins first. Then its family is this manager's, and the one joined
        # or made here is let go: two would number keys from 0 each.
        with _FIRST:
            if self._fam is not None:
                return self._fam
            if self._state is not _OPEN:
                self._check_own("make its first collective")
            if self._comm_freed:
                raise CollectiveGCError(
                    f"the {self.describe()} was freed before its first collective: "
                    "nothing can be agreed on it"
                )
            if MPI.Is_finalized():
                raise CollectiveGCError(f"MPI is finalized: the {self.describe()} is gone")
            # A protected region: a signal's handler runs once every rank has
            # made the duplicate (or found the family), as every rank's first
            # collective then completes.
            entered = _interrupts.enter()
            try:
                try:
                    fam, new = family_of(
                        self._user_comm,
                        Deadline(deadline),
                        _what(self, "duplicating its communicator"),
                    )
                except BaseException as exc:
                    # Its duplicate is abandoned half-made (a timeout, an
                    # interrupt that left it): making another would not match
                    # the other ranks' collectives. Refused from now on, as a
                    # family that timed out is, on every rank that got here.
                    self._become(
                        State.UNUSABLE,
                        "its first collective did not complete on this rank "
                        f"({type(exc).__name__}: {exc})",
                    )
                    raise
                if self._fam is None:
                    # Joined where it was first used, not where it was made:
                    # where it was made, if it says (a call, so before the join).
                    made = 0 if new or fam.size == 1 else _lineage.mark(self._user_comm)
                    tag = fam.join(self)  # (a call: a collection may run as it starts)
                    if self._fam is None:
                        # No call from here to the stores: nothing comes back.
                        self._tag = tag
                        self._mark = made or tag
                        self._fam = fam
                        if new and fam.size > 1:
                            _lineage.root(self._user_comm, tag)
                        for hook in _ON_FIRST:
                            hook(self, new)
                        return fam
                    fam.leave(tag)
                elif fam is not self._fam:
                    fam.maybe_free()
                return self._fam
            finally:
                _interrupts.leave(entered)

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the family's
        private duplicate.

        ``timeout`` bounds the wait (then :class:`CollectiveTimeoutError`, and
        the manager is unusable: the abandoned gather could match a later one).
        Allowed inside a destroy: every rank runs the same destroys in order.
        """
        if self._size == 1:
            return [value]
        if self._state is not _OPEN:
            self._check_own("gather from every rank")
        fam = self._family(None if timeout is None else time.monotonic() + timeout)
        return fam.allgather(value, timeout, self.describe())

    def reduce_or(self, values: Sequence[int], timeout: float | None = None) -> list[int]:
        """Collective: each of ``values`` (64-bit ints) ORed over the ranks, in
        one allreduce over the family's private duplicate: what a
        participant's :meth:`~Participant.finish` asks the other ranks
        (which of several communicators to clean, say). Every rank passes as
        many values. ``timeout`` as for :meth:`allgather`."""
        if self._size == 1:
            return list(values)
        if self._state is not _OPEN:
            self._check_own("reduce over the ranks")
        fam = self._family(None if timeout is None else time.monotonic() + timeout)
        return fam.reduce_or(values, timeout, self.describe())

    def sync(
        self,
        *,
        deadline: float | None = None,
        participants: Sequence[Participant] = (),
        collected: int | None = None,
        t0: float | None = None,
        at_exit: bool = False,
        final: bool = False,
    ) -> CollectStats:
        """Collective. Agree on the keys pending on every rank and destroy them:
        a sync point of this communicator's family.

        ``deadline`` is a ``time.monotonic()`` value. ``participants`` take
        part in this sync point only, after the family's own. ``collected``
        and ``t0`` only feed the returned stats. ``at_exit`` marks the exit
        agreement, which never matches a sync point of the program.
        ``final``: the sync point reports its own failures on every rank
        (one more word after its destroys) instead of leaving them to the
        family's next agreement.
        """
        fam = self._fam
        if (
            fam is not None
            and self._state is _OPEN
            and not participants
            and not at_exit
            and not final
        ):
            return fam.quick(
                self, time.perf_counter() if t0 is None else t0, collected, None, deadline
            )
        if self._state is not _OPEN:
            self._check_own("run a sync point")
        if fam is None:
            fam = self._family(deadline)
        return fam.sync(
            self,
            deadline=deadline,
            participants=participants,
            collected=collected,
            t0=t0,
            at_exit=at_exit,
            final=final,
        )

    # -- the end -----------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Collective: last sync points of the family (repeated while one
        destroys something: a destroy may drop more managed objects; each
        reports its own failures), then this manager lets go.

        If they raise (a DestroyError, on every rank), it stays open. An
        interrupt that arrived while they waited is raised once it let go.
        Later registrations and sync points on this communicator raise
        :class:`CollectiveGCError`. Registrations left on it (objects still
        alive, or queued on some ranks only) are detached, never destroyed,
        and named in an :class:`ExitLeakWarning` on their rank; the family
        lets go of its private duplicate once no communicator of it is left
        (kept a while, then freed: docs/design.rst, "Letting go"). Call
        it before freeing a communicator you are done with; a second call
        does nothing.
        """
        if self._state is State.CLOSED:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        fam = self._fam
        # One protected region: a signal's handler runs once every rank has
        # let go (see _interrupts).
        entered = _interrupts.enter()
        try:
            if fam is not None and fam.reason is None and self._state is _OPEN:
                if fam.agreed_before():
                    fam.last_syncs(self, deadline, at_exit=False)
            # The sync points completed on every rank (an error raised above is
            # raised on every rank, and the manager stays open on every rank).
            let_go(self, State.CLOSED, "it was closed")
            self._on_close(self)
        finally:
            _interrupts.leave(entered)


def _what(mgr: Manager, stage: str) -> Callable[[], str]:
    def describe() -> str:
        return (
            f"rank {mgr.rank}: {stage} (the {mgr.describe()}) did not complete before its deadline"
        )

    return describe


# What other modules of the library do to a manager beyond its public methods.


def family(mgr: Manager) -> Collective | None:
    """The family ``mgr`` joined, or None before its first collective. Local."""
    return mgr._fam


def quick_sync(
    mgr: Manager,
    t0: float,
    collected: int | None,
    extra: Participant | None = None,
    deadline: float | None = None,
) -> CollectStats:
    """``mgr.sync(deadline=deadline, t0=t0, collected=collected,
    participants=(extra,))`` (``extra`` None: no participant of its own),
    with as few calls as can be: what ``cgc.collect`` and a scope's sync run."""
    fam = mgr._fam
    if fam is not None and mgr._state is _OPEN:
        return fam.quick(mgr, t0, collected, extra, deadline)
    return mgr.sync(
        deadline=deadline,
        t0=t0,
        collected=collected,
        participants=() if extra is None else (extra,),
    )


def set_label(mgr: Manager, label: str) -> None:
    """What messages call ``mgr``'s communicator (``cgc.dup``'s, say). Local."""
    mgr._label = label


def open_family(mgr: Manager) -> Collective:
    """``mgr``'s family, joined (or made) now if it was not yet, against the
    innermost scope's timeout. Collective over ``mgr``'s communicator then."""
    fam = mgr._fam
    if fam is not None:
        return fam
    timeout = _TIMEOUT_SOURCE[0]()
    return mgr._family(None if timeout is None else time.monotonic() + timeout)


def join(mgr: Manager, fam: Collective) -> None:
    """Make ``mgr`` a member of ``fam`` without a collective of its own: its
    communicator was just made congruent with the family's (``cgc.dup``),
    collectively. Local."""
    with _FIRST:
        if mgr._fam is None:
            mgr._tag = mgr._mark = fam.join(mgr)
            mgr._fam = fam
            if fam.size > 1:
                _lineage.root(mgr._user_comm, mgr._tag)


def comm_was_freed(mgr: Manager) -> None:
    """Called from an MPI attribute delete callback: record only, no MPI. The
    manager leaves its family at the family's next sync point once nothing
    is registered on it (its destroys are agreed over the family's private
    duplicate meanwhile), or at the next lookup if it was the family's last."""
    mgr._comm_freed = True
    fam = mgr._fam
    if fam is not None:
        fam.leave_later(functools.partial(release, mgr), agreed=mgr._free_agreed)


def freeing_agreed(mgr: Manager) -> None:
    """``mgr``'s communicator is about to be freed by collective_gc at an
    agreed point (the same on every rank): its delete callback records the
    free as agreed. Local."""
    mgr._free_agreed = True


def release(mgr: Manager) -> bool:
    """Once the user freed ``mgr``'s communicator: let go if nothing is
    registered on it. True if done (or nothing to do)."""
    fam = mgr._fam
    if mgr._state is not _OPEN or fam is None:
        return True
    if fam.registry.count(mgr._proxy):
        return False
    let_go(mgr, State.RELEASED, "its communicator was freed")
    return True


def let_go(mgr: Manager, state: State, reason: str) -> bool:
    """``mgr`` leaves its family: what is still registered on it is detached
    (named in an :class:`ExitLeakWarning`), its participants leave the
    family's sync points, and the family lets go of its private duplicate
    if no communicator of it is left. Collective in effect (participants
    change): at the same point on every rank (close, a sync point's step).
    True if the family let go too."""
    fam = mgr._fam
    left: list[Registration] = []
    gone = False
    if fam is not None:
        with fam.lock:
            registry = fam.registry
            left = registry.pending(fam.seq, mgr._proxy) + registry.alive(mgr._proxy)
            registry.forget_owned(mgr._proxy)
            fam.drop_participants(mgr)
            gone = fam.leave(mgr._tag)
    if left:
        names = ", ".join(f"key {r.key} ({r.name!r})" for r in left[:10])
        warnings.warn(
            f"collective_gc: rank {mgr.rank}: {len(left)} registration(s) left on the "
            f"{mgr.describe()} when {reason}, detached without their destroys: {names}",
            ExitLeakWarning,
            stacklevel=3,
        )
    mgr._become(state, reason, first=False)
    return gone


def pending_text(mgr: Manager) -> str:
    """The pending destroys of this rank on ``mgr``, for leak messages. Local."""
    return leak_text(mgr.pending(), mgr.describe())


def after_fork(mgrs: Sequence[Manager]) -> None:
    """In a forked child: nothing here belongs to this process. A fresh lock:
    one that another thread held at the fork is never released there."""
    global _FIRST
    _FIRST = threading.RLock()
    for mgr in mgrs:
        mgr._state = State.FORKED
