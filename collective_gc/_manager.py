"""The per-communicator manager.

A :class:`Manager` owns the registry of its communicator's registrations,
and a private duplicate of the communicator for agreement traffic (so that
it never matches a user's message), made at first use. It keeps a state
(:class:`State`: usable, or why not), registers objects, runs sync points
(:mod:`collective_gc._syncpoint` has their steps), gathers over the private
communicator, and lets go at close, at exit, in a forked child, or once the
user freed the communicator.

What other modules of the library need beyond the public methods (the exit
agreement, fork, the communicator's free) are the functions at the end of
this module.
"""

from __future__ import annotations

import enum
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from mpi4py import MPI

from . import _agree, _destroy, _interrupts
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ExitLeakWarning,
)
from ._registration import DESTROYED, DETACHED, Registration, check_name
from ._registry import Registry, add_plain
from ._syncpoint import Books, CollectStats, Participant, SyncPoint, identities, what_raised
from ._transport import Deadline, dup

__all__ = [
    "Manager",
    "State",
    "Snapshot",
    "set_timeout_source",
    "exit_agreement",
    "end_exit",
    "drain_at_exit",
    "after_fork",
    "comm_was_freed",
    "release",
]


class State(enum.Enum):
    """What a manager can still do (:attr:`Manager.state`); :attr:`Manager.broken` says why."""

    OPEN = "open"  #: usable
    UNUSABLE = "unusable"  #: a timeout, a disagreement, an abandoned collective, mark_unusable
    RELEASED = "released"  #: its communicator was freed, and nothing was left registered
    EXITED = "exited"  #: the program is exiting: its exit agreement ran
    CLOSED = "closed"  #: :meth:`Manager.close` let go
    FORKED = "forked"  #: this is a forked child: everything belongs to the parent


# The usable state, as a module global: the hot paths (a registration, a sync
# point) compare with it, and an Enum member read through its class costs
# about 100 ns in Python 3.11, a tenth of a registration.
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


def _hook_name(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


class Manager:
    """The collective deferred-destroy manager of one communicator.

    Get it with :func:`collective_gc.manager`; do not construct it.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        on_first_collective: Callable[[Manager], None],
        on_close: Callable[[Manager], None],
    ) -> None:
        self._size = size = comm.Get_size()
        self._rank = rank = comm.Get_rank()
        # A wrapper of the handle, never the user's object: it may be a
        # managed one (cgc.dup) whose death we wait for.
        self._user_comm = MPI.Intracomm(comm)
        # The private duplicate: made by the first registration or sync point
        # (both collective, both with a deadline if they have one), so that no
        # local call (a lookup, a scope's constructor) waits for other ranks.
        self._comm: MPI.Intracomm | None = None
        self._on_first_collective = on_first_collective
        self._on_close = on_close
        self._books = Books(rank, size, self.describe(), Registry(self, size > 1))
        # Sync points and explicit destroys, one thread at a time.
        self._lock = threading.RLock()
        self._state = State.OPEN
        self._reason: str | None = None
        self._comm_freed = False
        self._view_hooks: list[Callable[[Manager], Iterable[tuple[str, str]]]] = []
        self._leak_hooks: list[Callable[[Manager], Iterable[str]]] = []

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
        """What this manager can still do (see :class:`State`)."""
        return self._state

    @property
    def broken(self) -> str | None:
        """Why this manager is unusable (a timeout, a disagreement, ...), or None."""
        return self._reason

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
        """How many sync points have completed on this communicator."""
        return self._books.seq

    @property
    def next_key(self) -> int:
        """The key the next registration will get (the registrations made so far)."""
        return self._books.registry.next_key

    @property
    def registered(self) -> int:
        """Registrations whose destroy has not run (objects alive or queued). Local."""
        return len(self._books.registry.live)

    @property
    def destroyed(self) -> int:
        """Destroys run on this communicator (by sync points and explicit calls)."""
        return self._books.destroyed

    @property
    def message(self) -> tuple[int, int, int] | None:
        """``(words, lo, bits)``: the length in int64 words of the last
        agreement's message on this rank, and the window of keys
        ``[lo, lo + bits)`` the next one carries as a bitmap (a key pending
        outside it goes through a second round). None on a communicator of
        size 1, or before the first collective. Local."""
        agreement = self._books.agreement
        if agreement is None:
            return None
        return agreement.words, agreement.window.lo, agreement.window.bits

    @property
    def cyclic(self) -> int:
        """Cyclic-GC deaths of managed objects seen by sync points so far."""
        return self._books.registry.cyclic_total

    @property
    def last_cyclic(self) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths the last sync point drained."""
        return list(self._books.registry.last_cyclic)

    def cyclic_deaths(
        self, since: int = 0
    ) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths sync points have seen,
        from the ``since``-th on (compare :attr:`cyclic`; the last 10,000 are
        kept). Local, changes nothing."""
        registry = self._books.registry
        log = registry.cyclic_log
        first = registry.cyclic_total - len(log)
        return list(log[max(0, since - first) :])

    def describe(self) -> str:
        """``"communicator of size N (rank r)"``, for messages."""
        return f"communicator of size {self._size} (rank {self._rank})"

    def __repr__(self) -> str:
        state = "" if self._state is State.OPEN else f" {self._state.value}"
        return (
            f"<collective_gc.Manager{state} of a {self.describe()}: "
            f"{self.registered} registered, {len(self.pending())} pending, "
            f"{self.destroyed} destroyed, {self.sync_count} sync points>"
        )

    # -- state -------------------------------------------------------------------

    def mark_unusable(self, reason: str) -> None:
        """Refuse every later registration and sync point, saying ``reason``. Local.

        Collective in effect: call it on every rank alike (a participant
        deciding on agreed flags, say). The first reason stays.
        """
        self._become(State.UNUSABLE, reason)

    def _become(self, state: State, reason: str, *, first: bool = True) -> None:
        # Usable -> not: the first reason stays, unless ``first`` is false
        # (letting go, which ends whatever state the manager was in).
        if first and self._reason is not None:
            return
        if self._state is not State.FORKED:
            self._state = state
        self._reason = reason

    def _abandon(self, reason: str) -> None:
        """This rank left collectives of the private communicator that the
        others may still be in: unusable, and the others are told through
        the watch (their waits there end at once, not at a deadline they may
        not have). A timeout has told them already (see _transport.wait)."""
        self._become(State.UNUSABLE, reason)
        agreement = self._books.agreement
        if agreement is not None:
            agreement.watch.announce(left=True)

    def refuse_if_unusable(self, what: str) -> None:
        """Raise :class:`CollectiveGCError` (saying it cannot ``what``) if a
        registration or a sync point would be refused now, on this thread: in
        a forked child, inside a destroy of this manager's sync point, once
        unusable, or after MPI_Finalize. Local. For work that must not begin
        unless its registration can follow (a derived communicator, say)."""
        if self._state is not _OPEN or self._books.destroying or MPI.Is_finalized():
            self._check_usable(what)

    def _check_usable(self, what: str) -> None:
        if self._state is State.FORKED:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {self.describe()} and its "
                "registrations belong to the parent process"
            )
        if self._books.destroying and self._books.destroying == threading.get_ident():
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{self.sync_count} on the {self.describe()}; do it after the sync point"
            )
        if self._reason is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {self.describe()} is unusable since {self._reason}"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {self.describe()}: MPI is finalized")

    # -- participants and hooks ------------------------------------------------

    def add_participant(self, participant: Participant) -> None:
        """Let ``participant`` take part in every sync point. Collective: add
        the same participants on every rank, in the same order. Adding it again
        does nothing; two participants may not vote in the same field."""
        books = self._books
        if participant in books.participants:
            return
        if participant.field is not None:
            _agree.field_shift(participant.field)  # a valid field
            if any(p.field == participant.field for p in books.participants):
                raise CollectiveGCError(
                    f"the {self.describe()} already has a participant voting in field "
                    f"{participant.field}"
                )
        books.participants.append(participant)
        books.identities = identities(books.participants)

    @property
    def participants(self) -> tuple[Participant, ...]:
        """The participants added to every sync point, in order."""
        return tuple(self._books.participants)

    def set_visitor(
        self, visit: Callable[[Manager, float | None], Sequence[_destroy.Failure]]
    ) -> None:
        """Call ``visit(mgr, deadline)`` first at each sync point, before
        anything is drained or agreed; what it returns are failures of the
        sync point, reported like a destroy's.
        Local. Unlike a participant it votes nothing and adds nothing to the
        agreement, so ranks may differ in having one; what it runs must be
        collective only over communicators whose ranks all run it at this
        sync point (:mod:`collective_gc._comms` visits the derived
        communicators there)."""
        self._books.visitor = visit

    def add_view_hook(self, hook: Callable[[Manager], Iterable[tuple[str, str]]]) -> None:
        """Let :func:`collective_gc.view` show pending entries we do not manage.

        ``hook(manager)`` returns ``(type name, description)`` pairs for this
        rank (PETSc's own garbage, say). Local; must not make MPI calls.
        """
        if hook not in self._view_hooks:
            self._view_hooks.append(hook)

    def view_rows(self) -> list[tuple[str, str]]:
        """What the view hooks report for this rank. Local. A hook that raises
        gives a row saying so: view gathers these rows from every rank, and a
        rank that raised instead would leave the others waiting."""
        rows: list[tuple[str, str]] = []
        for hook in self._view_hooks:
            try:
                rows.extend(hook(self))
            except Exception as exc:  # noqa: BLE001 (reported in the table)
                rows.append(("<view hook>", f"{_hook_name(hook)} raised {what_raised(exc)}"))
        return rows

    def add_leak_hook(self, hook: Callable[[Manager], Iterable[str]]) -> None:
        """Let leak reports explain why objects here are still alive (an owner
        kept alive by its own resource, say). Local; must not make MPI calls."""
        if hook not in self._leak_hooks:
            self._leak_hooks.append(hook)

    def leak_reasons(self) -> list[str]:
        """What the leak hooks say for this rank. Local. A hook that raises gives
        a line saying so (leak reports are gathered from every rank)."""
        lines: list[str] = []
        for hook in self._leak_hooks:
            try:
                lines.extend(hook(self))
            except Exception as exc:  # noqa: BLE001 (reported in the leak report)
                lines.append(f"the leak hook {_hook_name(hook)} raised {what_raised(exc)}")
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
        if self._state is not _OPEN or self._books.destroying or MPI.Is_finalized():
            self._check_usable("register an object")
        if name is not None and type(name) is not str:
            check_name(name)
        registry = self._books.registry
        if self._comm is None and self._size > 1:
            # The first registration makes the private duplicate (see _first_use).
            return registry.add(obj, destroy, args, kwargs, name, self._first_use)
        if not kwargs:
            reg = add_plain(registry, obj, destroy, args, name)
            if reg is not None:
                return reg
        return registry.add(obj, destroy, args, kwargs, name)

    def _first_use(self) -> None:
        # The first registration makes the private duplicate while the
        # communicator is surely alive (the user may free it before any sync
        # point), against the innermost scope's timeout.
        # A protected region: a signal's handler runs once the duplicate is
        # made, as every rank's registration then completes.
        timeout = _TIMEOUT_SOURCE[0]()
        dl = Deadline(None if timeout is None else time.monotonic() + timeout)
        entered = _interrupts.enter()
        try:
            self._private(dl)
        finally:
            _interrupts.leave(entered)

    def destroy_registration(self, reg: Registration) -> None:
        """``reg.destroy()``: run it now, once. Collective like the destroy itself."""
        with self._lock:
            if not reg.alive:
                return
            self._check_usable(f"destroy key {reg.key} ({reg.name!r})")
            call = self._books.registry.retire(reg, DESTROYED)
            if call is not None:
                self._books.destroyed += 1
                fn, args = call
                del call
                fn(*args)

    def detach_registration(self, reg: Registration) -> bool:
        """``reg.detach()``: forget it without running it. Local."""
        with self._lock:
            return self._books.registry.retire(reg, DETACHED) is not None

    # -- reads that change nothing -------------------------------------------

    def pending(self) -> list[Registration]:
        """What this rank has queued, oldest key first. Local; safe at any time,
        from any thread, inside a destroy too."""
        return self._books.registry.pending(self._books.seq)

    def alive(self) -> list[Registration]:
        """Registrations whose objects are still alive on this rank. Local."""
        return self._books.registry.alive()

    def cyclic_pending(self) -> list[Registration]:
        """Cyclic-GC deaths not yet seen by a sync point. Local."""
        return self._books.registry.cyclic_pending()

    def snapshot(self) -> Snapshot:
        """Everything above at once. Local, changes nothing."""
        return Snapshot(
            self.pending(),
            self.alive(),
            self.cyclic_pending(),
            self._reason,
            self.sync_count,
            self.next_key,
        )

    # -- collectives -------------------------------------------------------------

    def _private(self, deadline: Deadline) -> MPI.Intracomm:
        """The private duplicate, made at first use against ``deadline``. Collective."""
        if self._comm is not None:
            return self._comm
        # Under the lock: a first registration on one thread and a first sync
        # point on another must not make two duplicates.
        with self._lock:
            if self._comm is not None:
                return self._comm
            if self._comm_freed:
                raise CollectiveGCError(
                    f"the {self.describe()} was freed before its first sync point: "
                    "its pending destroys cannot be agreed"
                )
            # Never left pending: a duplicate still in progress when the user
            # frees the communicator would be completed on freed memory.
            try:
                comm = dup(
                    self._user_comm, deadline, self._books.what("duplicating its communicator")
                )
            except BaseException as exc:
                self._become(
                    State.UNUSABLE,
                    f"duplicating its communicator was abandoned ({type(exc).__name__})",
                    first=False,
                )
                raise
            self._comm = comm
            if self._size > 1:
                # Local: it only posts the receive of its watch (see _transport.Watch).
                self._books.agreement = _agree.Agreement(comm)
            self._on_first_collective(self)
            return comm

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the private duplicate.

        ``timeout`` bounds the wait (then :class:`CollectiveTimeoutError`, and
        the manager is unusable: the abandoned gather could match a later one).
        Allowed inside a destroy: every rank runs the same destroys in order.
        """
        if self._size == 1:
            return [value]
        with self._lock:
            if self._state is not _OPEN or MPI.Is_finalized():
                self._check_usable("gather from every rank")
            # A protected region: a signal's handler runs once the gather is
            # done, so that this rank does not leave a collective the others
            # complete (see _interrupts).
            deadline = Deadline(None if timeout is None else time.monotonic() + timeout)
            entered = _interrupts.enter()
            try:
                self._private(deadline)  # makes the agreement
                agreement = self._books.agreement
                assert agreement is not None
                return agreement.allgather(value, deadline, self._books.what("a gather"))
            except BaseException as exc:
                self._abandon(f"a gather was left by {type(exc).__name__} ({exc})")
                raise
            finally:
                _interrupts.leave(entered)

    def sync(
        self,
        *,
        deadline: float | None = None,
        participants: Sequence[Participant] = (),
        collected: int | None = None,
        t0: float | None = None,
        at_exit: bool = False,
    ) -> CollectStats:
        """Collective. Agree on the keys pending on every rank and destroy them.

        ``deadline`` is a ``time.monotonic()`` value. ``participants`` take
        part in this sync point only, after the manager's own. ``collected``
        and ``t0`` only feed the returned stats. ``at_exit`` marks the exit
        agreement, which never matches a sync point of the program.
        """
        if t0 is None:
            t0 = time.perf_counter()
        books = self._books
        with self._lock:
            if self._state is not _OPEN or books.destroying or MPI.Is_finalized():
                self._check_usable("run a sync point")
            if self._size == 1 and books.idle(participants):
                # Nothing to drain, agree on or destroy, and no collective: what
                # the steps would do, without a protected region (an object
                # dying from now on is the next sync point's).
                seq = books.seq
                books.seq = seq + 1
                return CollectStats(0, 0, 0, time.perf_counter() - t0, seq, collected)
            # A protected region: a signal's handler runs once the sync point's
            # collectives are done on this rank (see _interrupts).
            entered = _interrupts.enter()
            try:
                point = SyncPoint(
                    self, books, self._private, Deadline(deadline), participants, at_exit
                )
                return point.run(collected, t0)
            except CollectiveTimeoutError:
                # An abandoned collective could match a later one: never again.
                self._become(State.UNUSABLE, f"sync point {books.seq} timed out on this rank")
                raise
            except CollectiveMismatchError:
                # Every rank saw the same agreement, so every rank gets here.
                # Raised before this sync point's own collectives (by a
                # derived communicator's, visited in prepare, alike on every
                # rank: collective_gc._comms), it leaves this one usable.
                if books.collective:
                    self._become(State.UNUSABLE, f"the ranks disagreed at sync point {books.seq}")
                raise
            except BaseException as exc:
                if books.collective:
                    # Left half-way through its collectives on this rank only
                    # (a second Ctrl-C, out of memory): the other ranks' next
                    # collective would match the wrong one.
                    self._abandon(
                        f"sync point {books.seq} was left on this rank by "
                        f"{type(exc).__name__} before its collectives were done"
                    )
                raise
            finally:
                books.collective = False
                _interrupts.leave(entered)

    # -- the end -----------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Collective: last sync points (repeated while one destroys something:
        a destroy may drop more managed objects), then this manager lets go.

        If they raise (a DestroyError, on every rank), it stays open. An
        interrupt that arrived while they waited is raised once it let go.
        Its private duplicate is freed and later registrations and sync points
        raise :class:`CollectiveGCError`. Registrations left (objects still
        alive, or queued on some ranks only) are detached, never destroyed,
        and named in an :class:`ExitLeakWarning` on their rank. Call it before
        freeing a communicator you are done with; a second call does nothing.
        """
        if self._state is State.CLOSED:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        # One protected region: a signal's handler runs once every rank has
        # let go (see _interrupts).
        entered = _interrupts.enter()
        try:
            if self._reason is None and self._agreed_before():
                self._last_syncs(deadline, at_exit=False)
            # The sync points completed on every rank (an error raised above is
            # raised on every rank, and the manager stays open on every rank).
            self._let_go(State.CLOSED, "it was closed")
            self._on_close(self)
        finally:
            _interrupts.leave(entered)

    # A destroy may drop more managed objects; each later sync point agrees on
    # those, up to this many rounds (a destroy that always makes more would
    # never end).
    _LAST_ROUNDS = 100

    def _agreed_before(self) -> bool:
        # Whether the ranks ever made a collective here: if not, no rank has
        # anything agreed to destroy, and a last sync point would be the first
        # collective, perhaps on some ranks only (an exit, a close after an error).
        return self._size == 1 or self._comm is not None

    def _last_syncs(self, deadline: float | None, at_exit: bool) -> None:
        """Sync points until one destroys nothing (or _LAST_ROUNDS). Collective:
        how many each destroyed is agreed, so every rank runs as many. The
        caller makes it one protected region."""
        for _ in range(self._LAST_ROUNDS):
            if self.sync(deadline=deadline, at_exit=at_exit).destroyed == 0:
                break

    def _let_go(self, state: State, reason: str) -> None:
        registry = self._books.registry
        left = registry.pending(self._books.seq) + registry.alive()
        if left:
            names = ", ".join(f"key {r.key} ({r.name!r})" for r in left[:10])
            warnings.warn(
                f"collective_gc: rank {self._rank}: {len(left)} registration(s) left on the "
                f"{self.describe()} when {reason}, detached without their destroys: {names}",
                ExitLeakWarning,
                stacklevel=3,
            )
        with self._lock:
            registry.forget_all()
            self._free_private()
            self._become(state, reason, first=False)

    def _free_private(self) -> None:
        # Local: the agreement's standing receive is withdrawn first.
        agreement, self._books.agreement = self._books.agreement, None
        if agreement is not None and not MPI.Is_finalized():
            agreement.close()
        if self._comm is not None and self._size > 1 and not MPI.Is_finalized():
            self._comm.Free()
        self._comm = None

    def _leak_text(self) -> str:
        regs = self.pending()
        names = ", ".join(f"key {r.key} ({r.name!r})" for r in regs[:10])
        more = f" and {len(regs) - 10} more" if len(regs) > 10 else ""
        return f"{len(regs)} pending destroy(s) on the {self.describe()}: {names}{more}"


# What other modules of the library do to a manager beyond its public methods.


def leak_text(mgr: Manager) -> str:
    """The pending destroys of this rank, for leak messages. Local."""
    return mgr._leak_text()


def exit_agreement(mgr: Manager, deadline: float) -> None:
    """At exit: the exit agreement (if any collective was ever made here),
    then a warning naming what is left. Collective. The caller, at exit, makes
    all the managers' exit agreements one protected region."""
    if mgr._state is State.FORKED:
        return
    entered = _interrupts.enter()
    try:
        if mgr._reason is None and mgr._agreed_before():
            try:
                mgr._last_syncs(deadline, at_exit=True)
            except CollectiveTimeoutError:
                warnings.warn(
                    f"collective_gc: rank {mgr.rank}: the final agreement on the "
                    f"{mgr.describe()} timed out at exit (did another rank exit early "
                    "or hang?)",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            except Exception as exc:  # reported: exit goes on with the other managers
                warnings.warn(f"collective_gc: at exit: {exc}", ExitLeakWarning, stacklevel=1)
        if mgr.pending():
            why = (
                f"the manager is unusable since {mgr._reason}"
                if mgr._reason is not None
                else "they were not queued on every rank"
            )
            warnings.warn(
                f"collective_gc: rank {mgr.rank}: leaked at exit ({why}): {mgr._leak_text()}",
                ExitLeakWarning,
                stacklevel=1,
            )
    finally:
        _interrupts.leave(entered)


def end_exit(mgr: Manager) -> None:
    """At exit, once every manager's exit agreement ran: withdraw the standing
    receive of the agreement's watch, since MPI is finalized next (mpi4py's
    ``Py_AtExit``) and a receive still posted then is erroneous. No sync point
    runs on this manager afterwards. Local."""
    with mgr._lock:
        if mgr._books.agreement is not None and not MPI.Is_finalized():
            mgr._books.agreement.close()
            mgr._books.agreement = None
            mgr._become(State.EXITED, "the program is exiting (its exit agreement ran)")


def drain_at_exit(mgr: Manager) -> None:
    """After MPI was finalized by hand: take the inbox in, so that
    :meth:`Manager.pending` names everything left. Local, no MPI."""
    with mgr._lock:
        mgr._books.registry.drain(mgr._books.seq)


def after_fork(mgr: Manager) -> None:
    """In a forked child: nothing here belongs to this process. Fresh locks:
    one that another thread held at the fork is never released there."""
    mgr._lock = threading.RLock()
    mgr._state = State.FORKED
    mgr._books.registry.after_fork()


def comm_was_freed(mgr: Manager) -> None:
    """Called from an MPI attribute delete callback: record only, no MPI."""
    mgr._comm_freed = True


def release(mgr: Manager) -> bool:
    """After the user freed the communicator: free the private duplicate once
    nothing is registered. Local. True if released."""
    with mgr._lock:
        if mgr._books.collective or not mgr._books.registry.is_empty():
            return False
        mgr._free_private()
        mgr._become(State.RELEASED, "its communicator was freed")
    return True
