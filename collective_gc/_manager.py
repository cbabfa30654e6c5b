"""The per-communicator manager: it sequences a sync point.

A :class:`Manager` owns the :class:`~._registry.Registry` of its communicator
and a private duplicate of it for agreement traffic (so it never matches a
user's message). A sync point, from a dead object's point of view: its
finalizer appended its registration to the registry's inbox; the sync point
drains the inbox into the pending keys, asks the participants for their
votes, agrees with the other ranks on the keys pending everywhere in one
collective (:meth:`._agree.Agreement.agree`), runs those destroys newest first
(:func:`._destroy.run`), checks with one more small collective whether a
destroy raised anywhere (only if some ran), lets the participants finish, and
raises the same error on every rank if one did.

Participants (:class:`Participant`) are what takes part in a sync point
beside the destroys: a scope's GC policy, PETSc's own garbage cleanup, the
communicators derived with ``cgc.dup``/``cgc.split``. Each may vote in a byte
of the agreed flags and act on the result.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, NoReturn

from mpi4py import MPI

from . import _agree, _destroy, _interrupts
from ._agree import FLAG_BAD_VOTE, FLAG_CYCLIC, FLAG_FAILED
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ExitLeakWarning,
)
from ._registration import DESTROYED, DETACHED, Registration, check_name
from ._registry import Registry, add_plain

__all__ = ["Manager", "Participant", "CollectStats", "Snapshot", "set_timeout_source"]


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
        sync: the sync-point number on this communicator (0 for the first).
        collected: what the local ``gc.collect`` returned, or None if skipped.
    """

    destroyed: int
    pending: int
    cyclic: int
    seconds: float
    sync: int
    collected: int | None = None


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


class Participant:
    """Something that takes part in a manager's sync points (subclass it).

    ``field`` (0..5, or None) is the byte of the agreed flags it votes in,
    fixed by its kind so that every rank reads the same byte. Every method
    runs on every rank of the communicator at every sync point, in the order
    participants were added (sync points' own participants last).
    """

    field: int | None = None

    def prepare(self, mgr: Manager, deadline: float | None) -> list[_destroy.Failure]:
        """Before the agreement: collective work of its own (on other
        communicators); failures returned join the sync point's."""
        return []

    def vote(self, mgr: Manager) -> int:
        """This rank's byte (0..255), ORed over the ranks. Local, no MPI."""
        return 0

    def finish(self, mgr: Manager, flags: int) -> None:
        """After the destroys, with the agreed flags (the votes taken again
        after the destroys, if any ran). May make collective calls on ``mgr.comm``.

        If it raises on any rank (when :meth:`may_raise` said it could), every
        rank raises :class:`DestroyError` naming it, after the other
        participants' finishes ran (an interrupt is re-raised on its rank)."""

    def may_raise(self, flags: int) -> bool:
        """Whether :meth:`finish`, given the agreed ``flags``, might raise on
        some ranks only. Then the sync point runs one more small collective
        after the finishes, so that a failure anywhere is raised on every
        rank. Answer from ``flags`` alone, so that every rank answers alike.

        It must not raise (if it does, alike on every rank, that counts as a
        yes and is reported). The default: True if the class overrides
        :meth:`finish`. A finish that raises where this said False raises on
        its own rank only, unless the sync point reports another failure
        anyway (then it is in that DestroyError)."""
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


# Where the first registration on a communicator finds its timeout (the
# innermost scope's); set by _scope.
_TIMEOUT_SOURCE: list[Callable[[], float | None]] = [lambda: None]


def set_timeout_source(source: Callable[[], float | None]) -> None:
    """Where the first registration on a communicator finds its timeout (seconds or None)."""
    _TIMEOUT_SOURCE[0] = source


def _identities(parts: Sequence[Participant]) -> str:
    return "\0".join(p.identity() for p in parts)


def _hook_name(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _what_raised(exc: BaseException) -> str:
    # Whatever the exception's str() does (it may raise too).
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (whose str() raised)"


def _raise_own(failures: list[_destroy.Failure]) -> NoReturn:
    """Raise the first of this rank's ``failures`` (the others as its notes)."""
    _, what, first = failures[0]
    notes = [f"collective_gc: {w} raised too: {exc!r}" for _, w, exc in failures[1:]]
    failures.clear()  # the caller's frame must not hold what its traceback holds
    for note in notes:
        first.add_note(note)
    try:
        raise first
    finally:
        del first


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
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        # A wrapper of the handle, never the user's object: it may be a
        # managed one (cgc.dup) whose death we wait for.
        self._user_comm = MPI.Intracomm(comm)
        # The private duplicate: made by the first registration or sync point
        # (both collective, both with a deadline if they have one), so that no
        # local call (a lookup, a scope's constructor) waits for other ranks.
        self._comm: MPI.Intracomm | None = None
        self._on_first_collective = on_first_collective
        self._on_close = on_close
        self._registry = Registry(self, self._size > 1)
        self._agreement: _agree.Agreement | None = None
        self._seq = 0
        # Sync points and explicit destroys, one thread at a time.
        self._lock = threading.RLock()
        self._destroying = 0  # ident of the thread running this manager's destroys
        # True while a sync point is inside its collectives on this rank
        # (from its agreement to its error report, participants' finishes
        # included): leaving it by an exception then makes the manager
        # unusable, and the private communicator is not released under it.
        self._collective = False
        self._broken: str | None = None
        self._comm_freed = False
        self._forked = False
        self.destroyed = 0
        self._participants: list[Participant] = []
        self._identities = ""  # of _participants, joined (see Participant.identity)
        self._visitor: Callable[[Manager, float | None], Sequence[_destroy.Failure]] | None = None
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
    def broken(self) -> str | None:
        """Why this manager is unusable (a timeout, a disagreement, ...), or None."""
        return self._broken

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
        return self._seq

    @property
    def next_key(self) -> int:
        """The key the next registration will get."""
        return self._registry.next_key

    @property
    def registered(self) -> int:
        """Registrations whose destroy has not run (objects alive or queued). Local."""
        return len(self._registry.live)

    @property
    def created(self) -> int:
        """Registrations made on this communicator (the keys handed out)."""
        return self._registry.next_key

    @property
    def cyclic(self) -> int:
        """Cyclic-GC deaths of managed objects seen by sync points so far."""
        return self._registry.cyclic_total

    @property
    def last_cyclic(self) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths the last sync point drained."""
        return list(self._registry.last_cyclic)

    def cyclic_deaths(
        self, since: int = 0
    ) -> list[tuple[str, str, int, traceback.StackSummary | None]]:
        """(type, name, key, origin) of the cyclic deaths sync points have seen,
        from the ``since``-th on (compare :attr:`cyclic`; the last 10,000 are
        kept). Local, changes nothing."""
        log = self._registry.cyclic_log
        first = self._registry.cyclic_total - len(log)
        return list(log[max(0, since - first) :])

    def describe(self) -> str:
        """``"communicator of size N (rank r)"``, for messages."""
        return f"communicator of size {self._size} (rank {self._rank})"

    def __repr__(self) -> str:
        state = " broken" if self._broken else ""
        return (
            f"<collective_gc.Manager{state} of a {self.describe()}: "
            f"{self.registered} registered, {len(self.pending())} pending, "
            f"{self.destroyed} destroyed, {self._seq} sync points>"
        )

    def mark_unusable(self, reason: str) -> None:
        """Refuse every later registration and sync point, saying ``reason``. Local.

        Collective in effect: call it on every rank alike (a participant
        deciding on agreed flags, say). The first reason stays.
        """
        if self._broken is None:
            self._broken = reason

    def _abandon(self, reason: str) -> None:
        """This rank left collectives of the private communicator that the
        others may still be in: unusable, and the others are told through
        the watch (their waits there end at once, not at a deadline they may
        not have). A timeout has told them already (see _agree.wait)."""
        self.mark_unusable(reason)
        if self._agreement is not None:
            self._agreement.watch.announce(left=True)

    # -- participants and hooks ------------------------------------------------

    def add_participant(self, participant: Participant) -> None:
        """Let ``participant`` take part in every sync point. Collective: add
        the same participants on every rank, in the same order. Adding it again
        does nothing; two participants may not vote in the same field."""
        if participant in self._participants:
            return
        if participant.field is not None:
            _agree.field_shift(participant.field)  # a valid field
            if any(p.field == participant.field for p in self._participants):
                raise CollectiveGCError(
                    f"the {self.describe()} already has a participant voting in field "
                    f"{participant.field}"
                )
        self._participants.append(participant)
        self._identities = _identities(self._participants)

    @property
    def participants(self) -> tuple[Participant, ...]:
        """The participants added to every sync point, in order."""
        return tuple(self._participants)

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
        self._visitor = visit

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
                rows.append(("<view hook>", f"{_hook_name(hook)} raised {_what_raised(exc)}"))
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
                lines.append(f"the leak hook {_hook_name(hook)} raised {_what_raised(exc)}")
        return lines

    # -- registration ------------------------------------------------------------

    def refuse_if_unusable(self, what: str) -> None:
        """Raise :class:`CollectiveGCError` (saying it cannot ``what``) if a
        registration or a sync point would be refused now, on this thread: in
        a forked child, inside a destroy of this manager's sync point, once
        unusable, or after MPI_Finalize. Local. For work that must not begin
        unless its registration can follow (a derived communicator, say)."""
        if self._forked or self._destroying or self._broken is not None or MPI.Is_finalized():
            self._check_usable(what)

    def _check_usable(self, what: str) -> None:
        if self._forked:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {self.describe()} and its "
                "registrations belong to the parent process"
            )
        if self._destroying and self._destroying == threading.get_ident():
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{self._seq} on the {self.describe()}; do it after the sync point"
            )
        if self._broken is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {self.describe()} is unusable since {self._broken}"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {self.describe()}: MPI is finalized")

    def register(
        self,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
    ) -> Registration:
        """Collective. See :func:`collective_gc.register`."""
        if self._forked or self._destroying or self._broken is not None or MPI.Is_finalized():
            self._check_usable("register an object")
        if name is not None and type(name) is not str:
            check_name(name)
        if self._comm is None and self._size > 1:
            # The first registration makes the private duplicate (see _first_use).
            return self._registry.add(obj, destroy, args, kwargs, name, self._first_use)
        if not kwargs:
            reg = add_plain(self._registry, obj, destroy, args, name)
            if reg is not None:
                return reg
        return self._registry.add(obj, destroy, args, kwargs, name)

    def _first_use(self) -> None:
        # The first registration makes the private duplicate while the
        # communicator is surely alive (the user may free it before any sync
        # point), against the innermost scope's timeout.
        # A protected region: a signal's handler runs once the duplicate is
        # made, as every rank's registration then completes.
        timeout = _TIMEOUT_SOURCE[0]()
        dl = _agree.Deadline(None if timeout is None else time.monotonic() + timeout)
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
            call = self._registry.retire(reg, DESTROYED)
            if call is not None:
                self.destroyed += 1
                fn, args = call
                del call
                fn(*args)

    def detach_registration(self, reg: Registration) -> bool:
        """``reg.detach()``: forget it without running it. Local."""
        with self._lock:
            return self._registry.retire(reg, DETACHED) is not None

    # -- reads that change nothing -------------------------------------------

    def pending(self) -> list[Registration]:
        """What this rank has queued, oldest key first. Local; safe at any time,
        from any thread, inside a destroy too."""
        return self._registry.pending(self._seq)

    def alive(self) -> list[Registration]:
        """Registrations whose objects are still alive on this rank. Local."""
        return self._registry.alive()

    def cyclic_pending(self) -> list[Registration]:
        """Cyclic-GC deaths not yet seen by a sync point. Local."""
        return self._registry.cyclic_pending()

    def snapshot(self) -> Snapshot:
        """Everything above at once. Local, changes nothing."""
        return Snapshot(
            self.pending(),
            self.alive(),
            self.cyclic_pending(),
            self._broken,
            self._seq,
            self.next_key,
        )

    # -- collectives -------------------------------------------------------------

    def _private(self, deadline: _agree.Deadline) -> MPI.Intracomm:
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
                comm = _agree.dup(
                    self._user_comm, deadline, self._what("duplicating its communicator")
                )
            except BaseException as exc:
                self._broken = f"duplicating its communicator was abandoned ({type(exc).__name__})"
                raise
            self._comm = comm
            if self._size > 1:
                # Local: it only posts the receive of its watch (see _agree.Watch).
                self._agreement = _agree.Agreement(comm)
            self._on_first_collective(self)
            return comm

    def _what(self, stage: str) -> Callable[[], str]:
        # Formatted only on timeout, while the caller's frames are on the stack.
        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self._rank}: sync point {self._seq} on the {self.describe()} did "
                f"not complete {stage} before its deadline; called from:\n{where}"
            )

        return describe

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the private duplicate.

        ``timeout`` bounds the wait (then :class:`CollectiveTimeoutError`, and
        the manager is unusable: the abandoned gather could match a later one).
        Allowed inside a destroy: every rank runs the same destroys in order.
        """
        if self._size == 1:
            return [value]
        with self._lock:
            if self._forked or self._broken is not None or MPI.Is_finalized():
                self._check_usable("gather from every rank")
            # A protected region: a signal's handler runs once the gather is
            # done, so that this rank does not leave a collective the others
            # complete (see _interrupts).
            deadline = _agree.Deadline(None if timeout is None else time.monotonic() + timeout)
            entered = _interrupts.enter()
            try:
                if self._agreement is None:
                    self._private(deadline)  # makes the agreement
                assert self._agreement is not None
                return self._agreement.allgather(value, deadline, self._what("a gather"))
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
        with self._lock:
            if self._forked or self._destroying or self._broken is not None or MPI.Is_finalized():
                self._check_usable("run a sync point")
            registry = self._registry
            if self._size == 1 and not (
                registry.inbox
                or registry.pend.size
                or registry.stale
                or registry.last_cyclic
                or participants
                or self._participants
                or self._visitor is not None
            ):
                # Nothing to drain, agree on or destroy, and no collective: what
                # the steps below would do, without a protected region (an
                # object dying from now on is the next sync point's).
                seq = self._seq
                self._seq = seq + 1
                return CollectStats(0, 0, 0, time.perf_counter() - t0, seq, collected)
            # A protected region: a signal's handler runs once the sync point's
            # collectives are done on this rank (see _interrupts).
            entered = _interrupts.enter()
            try:
                return self._sync(_agree.Deadline(deadline), participants, collected, t0, at_exit)
            except CollectiveTimeoutError:
                # An abandoned collective could match a later one: never again.
                self._broken = f"sync point {self._seq} timed out on this rank"
                raise
            except CollectiveMismatchError:
                # Every rank saw the same agreement, so every rank gets here.
                # Raised before this sync point's own collectives (by a
                # derived communicator's, visited in prepare, alike on every
                # rank: collective_gc._comms), it leaves this one usable.
                if self._collective:
                    self._broken = f"the ranks disagreed at sync point {self._seq}"
                raise
            except BaseException as exc:
                if self._collective:
                    # Left half-way through its collectives on this rank only
                    # (a second Ctrl-C, out of memory): the other ranks' next
                    # collective would match the wrong one.
                    self._abandon(
                        f"sync point {self._seq} was left on this rank by "
                        f"{type(exc).__name__} before its collectives were done"
                    )
                raise
            finally:
                self._collective = False
                _interrupts.leave(entered)

    def _sync(
        self,
        dl: _agree.Deadline,
        extra: Sequence[Participant],
        collected: int | None,
        t0: float,
        at_exit: bool,
    ) -> CollectStats:
        failures: list[_destroy.Failure] = []
        more: list[_destroy.Failure] = []
        local: list[BaseException] = []
        caught: list[BaseException] = []
        interrupt: BaseException | None = None
        try:
            parts = self._participants
            identities = self._identities
            if extra:
                self._check_fields(extra)
                parts = parts + list(extra)
                identities = _identities(parts)
            registry = self._registry
            flags = 0
            bad: list[str] = []
            if self._visitor is not None:
                failures.extend(self._visitor(self, dl.at))
            if parts:
                for p in parts:
                    failures.extend(p.prepare(self, dl.at))
                flags = self._votes(parts, bad)
            if failures:
                flags |= FLAG_FAILED
            cyclic = (
                registry.drain(self._seq)
                if registry.inbox or registry.stale or registry.last_cyclic
                else 0
            )
            if cyclic:
                flags |= FLAG_CYCLIC
            if self._size == 1:
                keys = registry.pend
            else:
                # From here until the last collective, leaving by an exception on
                # this rank only makes the manager unusable (see sync).
                self._collective = True
                if self._agreement is None:
                    self._private(dl)  # makes the agreement
                agreement = self._agreement
                assert agreement is not None
                head = _agree.Header(
                    self._seq,
                    registry.next_key,
                    at_exit,
                    flags,
                    _agree.fingerprint(identities) if identities else 0,
                )
                agreed = agreement.agree(head, registry.pend, dl, self._what("its agreement"))
                if agreed.mismatch:
                    raise self._mismatch(agreement.comm, dl, at_exit, identities)
                agreement.window.advance(registry.next_key)
                registry.new_interval()
                keys, flags = agreed.keys, agreed.flags
            if flags & FLAG_BAD_VOTE:
                # Seen alike by every rank, before anything is destroyed: the
                # keys stay pending, and the manager stays usable. (An
                # interrupt held meanwhile is raised in its place by sync.)
                self._collective = False
                raise CollectiveGCError(
                    f"rank {self._rank}: a participant of the {self.describe()} voted outside "
                    f"0..255 at sync point {self._seq} (here: {'; '.join(bad) or 'none'}); "
                    "nothing was destroyed"
                )
            seq = self._seq
            self._seq += 1
            count = 0
            if keys.size:
                self._destroying = threading.get_ident()
                try:
                    count, more, interrupt = _destroy.run(registry, keys)
                finally:
                    self._destroying = 0
                    self.destroyed += count
                failures.extend(more)
            # Whether anything ran depends only on agreed values, so every rank
            # takes the same branch: then one more small collective says whether a
            # destroy failed anywhere (interrupts included: they are re-raised
            # only after it) and takes the votes again (destroys may change them).
            if keys.size or flags & FLAG_FAILED:
                after = self._votes(parts, bad) | (FLAG_FAILED if failures else 0)
                if self._agreement is not None:
                    after = self._agreement.any_flags(after, dl, self._what("its error check"))
                flags = after | (flags & FLAG_CYCLIC)
            if parts:
                flags = self._finish(parts, flags, failures, dl)
            if failures and not flags & FLAG_FAILED:
                # A finish that said it could not raise did, on this rank: the
                # others know nothing of it, so it is raised here only, as is.
                self._collective = False
                _raise_own(failures)
            # Interrupts that did not come from a signal (those wait for the end
            # of the protected region) but from the sync point's own steps: a
            # second Ctrl-C between two runs of destroys, an exception's str().
            # Raised on this rank once the collectives are done.
            caught = [interrupt] if interrupt is not None else []
            if flags & FLAG_FAILED:
                rows = _destroy.rows_of(failures, self._rank, caught)
                if self._size > 1:
                    everyone = _agree.allgather(
                        self._private(dl), rows, dl, self._what("its error report")
                    )
                    rows = [row for per_rank in everyone for row in per_rank]
                self._collective = False
                local = caught + [e for _, _, e in failures]
                _destroy.raise_failures(
                    rows,
                    local,
                    f"sync point {seq} on the {self.describe()}",
                    self._rank,
                    self._broken,
                )
            self._collective = False
            if caught:
                caught[0].add_note(
                    "collective_gc: it was held until the sync point's collectives were "
                    "done, so that every rank ran the same destroys"
                )
                _raise_own([(-1, "the sync point's own steps", e) for e in caught])
            return CollectStats(
                count,
                registry.pend.size + len(registry.inbox),
                cyclic,
                time.perf_counter() - t0,
                seq,
                collected,
            )
        finally:
            del failures, more, local, interrupt, caught  # see _destroy.Failure

    def _finish(
        self,
        parts: Sequence[Participant],
        flags: int,
        failures: list[_destroy.Failure],
        dl: _agree.Deadline,
    ) -> int:
        """Every participant's finish, whatever raises; then, if any of them
        said it might raise (agreed, so on every rank alike), one more word
        says whether anything failed anywhere. Returns the flags, with
        FLAG_FAILED if a destroy or a finish failed on any rank."""
        # Whether to check is asked of every participant before any finish
        # runs, from agreed values only, so it is decided alike on every rank.
        # No signal's handler runs in between (the sync point is a protected
        # region): what raises is the participants' own code.
        try:
            check = False
            for p in parts:
                try:
                    check = p.may_raise(flags) or check
                except BaseException as exc:  # a yes (alike on every rank: see may_raise)
                    check = True
                    failures.append((-1, f"the may_raise of {type(p).__name__}", exc))
            for p in parts:
                try:
                    p.finish(self, flags)
                except BaseException as exc:  # every participant finishes; reported after
                    failures.append((-1, f"the finish of {type(p).__name__}", exc))
            if not check:
                return flags
            mine = FLAG_FAILED if failures else 0
            if self._size == 1 or self._agreement is None:
                return flags | mine  # reported as on a larger communicator
            return flags | self._agreement.any_flags(mine, dl, self._what("its finish check"))
        finally:
            del failures  # the caller's list, which it keeps: see _destroy.Failure

    def _check_fields(self, extra: Sequence[Participant]) -> None:
        # The same participants on every rank (the call is collective), so
        # refusing here, before any collective, is the same everywhere.
        taken = {p.field for p in self._participants if p.field is not None}
        for p in extra:
            if p.field is None:
                continue
            _agree.field_shift(p.field)
            if p.field in taken:
                raise CollectiveGCError(
                    f"two participants of a sync point on the {self.describe()} vote in "
                    f"field {p.field}"
                )
            taken.add(p.field)

    def _votes(self, parts: Sequence[Participant], bad: list[str]) -> int:
        flags = 0
        for p in parts:
            if p.field is not None:
                vote = p.vote(self)
                if type(vote) is not int or not 0 <= vote <= 0xFF:
                    bad.append(f"{type(p).__name__} voted {vote!r}")
                    flags |= FLAG_BAD_VOTE
                    continue
                flags |= vote << _agree.field_shift(p.field)
        return flags

    def _mismatch(
        self, comm: MPI.Intracomm, dl: _agree.Deadline, at_exit: bool, identities: str
    ) -> CollectiveMismatchError:
        # Every rank saw the disagreement: one more gather says who differs.
        mine = (self._seq, self._registry.next_key, at_exit, identities)
        everyone = _agree.allgather(comm, mine, dl, self._what("its mismatch report"))
        seqs = [s for s, _, _, _ in everyone]
        keys = [k for _, k, _, _ in everyone]
        kinds = [e for _, _, e, _ in everyone]
        ids = [i for _, _, _, i in everyone]
        parts = []
        if len(set(ids)) > 1:
            shown = {i: [r for r, j in enumerate(ids) if j == i] for i in dict.fromkeys(ids)}
            parts.append(
                "the ranks' sync points have different participants ("
                + "; ".join(
                    f"ranks {r}: {i.replace(chr(0), ', ') or 'none'}" for i, r in shown.items()
                )
                + "): a collective_scope's gc= or strict= differs between the ranks, or "
                "two threads ran sync points on this communicator at once and the ranks "
                "paired them differently"
            )
        if len(set(kinds)) > 1:
            parts.append(
                "some ranks were at a sync point of the program and others at the exit "
                f"agreement (this rank: {'exit' if at_exit else 'a sync point'}; at exit: ranks "
                f"{[r for r, e in enumerate(kinds) if e]}); a rank ran more sync points than "
                "the others, or exited early"
            )
        if len(set(seqs)) > 1:
            parts.append(
                f"sync-point numbers range from {min(seqs)} to {max(seqs)} across the ranks "
                f"(by rank: {seqs}; this rank: {self._seq}); a rank skipped a sync point"
            )
        if len(set(keys)) > 1:
            parts.append(
                f"registration counts range from {min(keys)} to {max(keys)} (by rank: {keys}; "
                f"this rank: {self._registry.next_key}); the ranks did not register the same "
                "objects (register is collective)"
            )
        return CollectiveMismatchError(
            f"rank {self._rank}: the ranks of the {self.describe()} disagree at sync "
            f"point {self._seq}: " + "; ".join(parts) + ". Nothing was destroyed."
        )

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
        if self._broken == "it was closed":
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        # One protected region: a signal's handler runs once every rank has
        # let go (see _interrupts).
        entered = _interrupts.enter()
        try:
            if self._broken is None and not (self._size > 1 and self._comm is None):
                self._last_syncs(deadline, at_exit=False)
            # The sync points completed on every rank (an error raised above is
            # raised on every rank, and the manager stays open on every rank).
            self._let_go("it was closed")
            self._on_close(self)
        finally:
            _interrupts.leave(entered)

    # A destroy may drop more managed objects; each later sync point agrees on
    # those, up to this many rounds (a destroy that always makes more would
    # never end).
    LAST_ROUNDS = 100

    def _last_syncs(self, deadline: float | None, at_exit: bool) -> None:
        """Sync points until one destroys nothing (or LAST_ROUNDS). Collective:
        how many each destroyed is agreed, so every rank runs as many. The
        caller makes it one protected region."""
        for _ in range(self.LAST_ROUNDS):
            if self.sync(deadline=deadline, at_exit=at_exit).destroyed == 0:
                break

    def _let_go(self, reason: str) -> None:
        left = self._registry.pending(self._seq) + self._registry.alive()
        if left:
            names = ", ".join(f"key {r.key} ({r.name!r})" for r in left[:10])
            warnings.warn(
                f"collective_gc: rank {self._rank}: {len(left)} registration(s) left on the "
                f"{self.describe()} when {reason}, detached without their destroys: {names}",
                ExitLeakWarning,
                stacklevel=3,
            )
        with self._lock:
            self._registry.forget_all()
            if self._comm is not None and self._size > 1 and not MPI.Is_finalized():
                self._close_agreement()
                self._comm.Free()
            self._comm = None
            self._broken = reason

    def _close_agreement(self) -> None:
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            agreement.close()

    def leak_text(self) -> str:
        """The pending destroys of this rank, for leak messages. Local."""
        regs = self.pending()
        names = ", ".join(f"key {r.key} ({r.name!r})" for r in regs[:10])
        more = f" and {len(regs) - 10} more" if len(regs) > 10 else ""
        return f"{len(regs)} pending destroy(s) on the {self.describe()}: {names}{more}"

    def exit_agreement(self, deadline: float) -> None:
        """At exit: the exit agreement (if any collective was ever made here),
        then a warning naming what is left. Collective."""
        if self._forked:
            return
        # One protected region (see close); the caller, at exit, makes all the
        # managers' exit agreements one.
        entered = _interrupts.enter()
        try:
            self._exit_agreement(deadline)
        finally:
            _interrupts.leave(entered)

    def _exit_agreement(self, deadline: float) -> None:
        if self._broken is None and not (self._size > 1 and self._comm is None):
            try:
                self._last_syncs(deadline, at_exit=True)
            except CollectiveTimeoutError:
                warnings.warn(
                    f"collective_gc: rank {self._rank}: the final agreement on the "
                    f"{self.describe()} timed out at exit (did another rank exit early "
                    "or hang?)",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            except Exception as exc:  # reported: exit goes on with the other managers
                warnings.warn(f"collective_gc: at exit: {exc}", ExitLeakWarning, stacklevel=1)
        if self.pending():
            why = (
                f"the manager is unusable since {self._broken}"
                if self._broken is not None
                else "they were not queued on every rank"
            )
            warnings.warn(
                f"collective_gc: rank {self._rank}: leaked at exit ({why}): {self.leak_text()}",
                ExitLeakWarning,
                stacklevel=1,
            )

    def end_exit(self) -> None:
        """At exit, once every manager's exit agreement ran: withdraw the
        standing receive of the agreement's watch, since MPI is finalized next
        (mpi4py's ``Py_AtExit``) and a receive still posted then is erroneous.
        No sync point runs on this manager afterwards. Local."""
        with self._lock:
            if self._agreement is not None and not MPI.Is_finalized():
                self._close_agreement()
                if self._broken is None:
                    self._broken = "the program is exiting (its exit agreement ran)"

    def drain_at_exit(self) -> None:
        """After MPI was finalized by hand: take the inbox in, so that
        :meth:`pending` names everything left. Local, no MPI."""
        with self._lock:
            self._registry.drain(self._seq)

    def after_fork(self) -> None:
        """In a forked child: nothing here belongs to this process. Fresh locks:
        one that another thread held at the fork is never released there."""
        self._lock = threading.RLock()
        self._forked = True
        self._registry.after_fork()

    def comm_was_freed(self) -> None:
        """Called from an MPI attribute delete callback: record only, no MPI."""
        self._comm_freed = True

    def release(self) -> bool:
        """After the user freed the communicator: free the private duplicate once
        nothing is registered. Local. True if released."""
        with self._lock:
            if self._collective or not self._registry.is_empty():
                return False
            if self._comm is not None and self._size > 1:
                self._close_agreement()
                self._comm.Free()
            self._comm = None
            if self._broken is None:
                self._broken = "its communicator was freed"
        return True
