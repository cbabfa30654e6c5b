"""The per-communicator manager: keys, the pending set, sync points, exit.

One :class:`Manager` per communicator, found through an MPI attribute cached
on the communicator, so every Python wrapper of the same handle gets the same
manager and a freed-then-reused handle does not. Agreement traffic goes over a
private duplicate of the communicator (made when the manager is), so it can
never match a user's message.

Registrations are collective: every rank registers the same objects in the
same order, so a per-manager counter gives each object the same key on every
rank. Finalizers push dead registrations onto a lock-free inbox; a sync point
drains the inbox into the pending set, agrees with the other ranks on the keys
pending everywhere (:mod:`._agree`), and destroys those newest first.
"""

from __future__ import annotations

import array
import atexit
import gc
import itertools
import operator
import os
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
from mpi4py import MPI

from . import _agree, local
from ._agree import (
    H_CHILD_ERRORS,
    H_COUNT,
    H_CYCLIC,
    H_KIND,
    H_LO,
    H_NEG_DEADLINE,
    H_NEG_HI,
    H_NEG_KIND,
    H_NEG_NEXT,
    H_NEG_SEQ,
    H_NEXT,
    H_POLICY,
    H_SEQ,
    H_VOTE,
    NO_DEADLINE,
    NO_KEY,
)
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DestroyError,
    ExitLeakWarning,
    RegistrationError,
)
from ._registration import (
    _FLAGS,
    ALIVE,
    DESTROYED,
    DETACHED,
    SPEEDUPS,
    Registration,
    check_destroy,
    make_registration,
)

__all__ = [
    "Manager",
    "CollectStats",
    "manager",
    "lookup",
    "register",
    "collect",
    "pending",
    "managers",
    "check_timeout",
    "exit_timeout",
    "release_freed",
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
        sync: the sync-point number on this communicator (0 for the first).
        collected: what the local ``gc.collect`` returned, or None if skipped.
    """

    destroyed: int
    pending: int
    cyclic: int
    seconds: float
    sync: int
    collected: int | None = None  # noqa: UP007 (evaluated at class creation on 3.9)


class _Child(Protocol):
    """A communicator derived from a manager's (see :mod:`._comms`)."""

    released: bool

    def visit(self, deadline: float | None) -> list[tuple[int, str, BaseException]]: ...


_IN_PLACE = MPI.IN_PLACE
_new_tuple = tuple.__new__
_get_ident = threading.get_ident


def _thread_name(ident: int) -> str:
    # Only for error messages: a registration records the cheap ident.
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"(thread {ident})"


_MAX = MPI.MAX
_NO_KEYS = np.empty(0, dtype=np.int64)
_KEY_OF = operator.attrgetter("key")


# Destroy functions that can run a whole run of their calls at once (see
# set_batch), matched by identity: a destroy callable need not be hashable,
# nor compare sanely. Two parallel tuples, as _speedups.take_batch takes the
# first, replaced together in one store (a sync point reads them once).
_Batch = Callable[[list[tuple[Any, ...]]], list[tuple[int, BaseException]]]  # see set_batch
_BATCHES: tuple[tuple[Callable[..., object], ...], tuple[_Batch, ...]] = ((), ())


def set_timeout_source(source: Callable[[], float | None]) -> None:
    """Where the first registration on a communicator finds its timeout (seconds or None)."""
    _TIMEOUT_SOURCE[0] = source


def set_batch(destroy: Callable[..., object], batch: _Batch | None) -> None:
    """Let sync points run consecutive destroys by ``destroy`` as one batch. Local.

    ``batch(argss)`` gets the argument tuples of consecutive calls to
    ``destroy``, in the agreed destroy order, and must do what calling
    ``destroy(*args)`` for each would do, in that order, trying every one even
    if some raise; it returns ``(index, exception)`` for those that raised.
    It may replace entries of ``argss`` it is done with (by None, say), so
    that the destroyed objects are freed early: the list is never read again.
    ``collective_gc.petsc`` uses it to destroy petsc4py objects from C.
    ``None`` removes it.
    """
    global _BATCHES
    pairs = [(f, b) for f, b in zip(*_BATCHES) if f is not destroy]
    if batch is not None:
        pairs.append((destroy, batch))
    _BATCHES = (tuple(f for f, _ in pairs), tuple(b for _, b in pairs))


_Taken = tuple[
    list[Registration],
    list[Callable[..., object]],
    list[tuple[Any, ...]],
    "list[tuple[int, int, int]] | None",
]


def _take_batch_py(
    regs: dict[int, Registration], keys: list[int], state: int, batched: tuple[object, ...]
) -> _Taken:
    """What ``_speedups.take_batch`` does, from Python (tests compare the two).

    A key whose registration is gone from the dict, or has no destroy left,
    is skipped and stays where it is: it was destroyed or detached explicitly
    meanwhile, on every rank.
    """
    taken: list[Registration] = []
    fns: list[Callable[..., object]] = []
    argss: list[tuple[Any, ...]] = []
    for key in keys:
        reg = regs.get(key)
        if reg is None or reg._destroy is None:
            continue
        del regs[key]
        reg._state = state
        fns.append(reg._destroy)
        argss.append(reg._args)
        reg._destroy, reg._args = None, ()
        taken.append(reg)
    # Runs of consecutive calls with the same batch index (by the destroy's
    # identity; -1 for a destroy with no batch).
    ids = [id(f) for f in batched]
    segments: list[tuple[int, int, int]] = []
    start = 0
    for index, group in itertools.groupby(ids.index(id(f)) if id(f) in ids else -1 for f in fns):
        end = start + sum(1 for _ in group)
        segments.append((start, end, index))
        start = end
    return taken, fns, argss, segments


def _run_each_py(
    fns: list[Callable[..., object]], argss: list[tuple[Any, ...]]
) -> list[tuple[int, BaseException]]:
    """What ``_speedups.run_each`` does: ``fns[i](*argss[i])`` for each i, in order,
    every call made even if some raise; (index, exception) of those that raised."""
    errors: list[tuple[int, BaseException]] = []
    for i, (fn, args) in enumerate(zip(fns, argss)):
        try:
            fn(*args)
        except BaseException as exc:  # every call is made; the caller raises after
            errors.append((i, exc))
    return errors


_take_batch: Callable[..., _Taken] = _take_batch_py if SPEEDUPS is None else SPEEDUPS.take_batch
_run_each: Callable[..., list[tuple[int, BaseException]]] = (
    _run_each_py if SPEEDUPS is None else SPEEDUPS.run_each
)


class Manager:
    """The collective deferred-destroy manager of one communicator.

    Get it with :func:`collective_gc.manager`; do not construct it.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        # Agreement traffic never shares a communicator with the user's
        # messages: a private duplicate, made by the first registration or
        # sync point (both collective, both with a deadline if they have
        # one), so that no local call (a lookup, a scope's constructor,
        # pending()) ever waits for other ranks.
        self._comm: MPI.Intracomm | None = None
        # Never hold the user's own communicator object: it may be a managed
        # one (cgc.dup) whose death we are waiting for; hold a wrapper of the handle.
        self._user_comm = MPI.Intracomm(comm)
        self._next_key = 0
        # Every registration whose destroy has not run (object alive or dead).
        self._regs: dict[int, Registration] = {}
        # Finalizers append dead registrations here (list.append is atomic);
        # a sync point takes them in two C calls, however many there are.
        self._inbox: list[Registration] = []
        self._cyclic_inbox: list[Registration] = []
        # Keys drained and waiting for agreement, with the sync point at which
        # each was drained (its age, for view). Changed only by sync points.
        self._pend = _NO_KEYS
        self._pend_seq = _NO_KEYS
        # Set when an explicit destroy or detach may have left a dead key in the
        # inbox or the pending keys: the next drain filters them.
        self._stale = False
        self._seq = 0
        # Sync points and explicit destroys, one thread at a time.
        self._lock = threading.RLock()
        # The registry dict and the key counter: held for a few stores only,
        # never across a destroy or an MPI call, so registering from another
        # thread never waits for a sync point's destroys. Re-entrant: an
        # allocation inside it may start the collector, whose finalizers may
        # detach or destroy on this very thread.
        self._reg_lock = threading.RLock()
        # Size > 1: held by the thread that is registering. Two threads
        # registering at once would number the objects in an order that may
        # differ between ranks, so the second one is refused, never made to wait.
        self._registrar: threading.RLock | None = threading.RLock() if self._size > 1 else None
        self._registrar_ident = 0
        # Ident of the thread running this manager's destroys, or 0.
        self._destroying = 0
        # True while a sync point is inside its collective part on this rank:
        # leaving it by an exception then makes the manager unusable.
        self._collective = False
        self._broken: str | None = None
        self._comm_freed = False
        self._forked = False
        # Totals over the manager's life.
        self.created = 0
        self.destroyed = 0
        self.cyclic = 0
        # Adapter hooks (PETSc's own garbage cleanup, say); see add_sync_hook.
        self._sync_hooks: list[Callable[[Manager], None]] = []
        self._vote: Callable[[Manager], tuple[int, int]] | None = None
        # The hook vote's MAX over every rank at the last sync point (taken
        # after its destroys, if it ran any).
        self.votes: tuple[int, int] = (0, 0)
        # Communicators derived from this one with cgc.dup/cgc.split (see _comms),
        # in creation order, which is the same on every rank.
        self._children: list[_Child] = []
        self.children_made = 0
        # (type, name, key, origin) of the cyclic finalizations drained at the
        # last sync point, for strict mode's diagnostics.
        self.last_cyclic: list[tuple[str, str, int, traceback.StackSummary | None]] = []
        self._view_hooks: list[Callable[[Manager], Iterable[tuple[str, str]]]] = []
        self._leak_hooks: list[Callable[[Manager], Iterable[str]]] = []

    # -- description ---------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The user's communicator this manager was made for (not its private duplicate).

        Raises :class:`CollectiveGCError` once that communicator was freed, or
        MPI finalized: its handle is then dead, and using it would crash.
        """
        if self._comm_freed:
            raise CollectiveGCError(
                f"the {self._describe()} was freed (comm.Free()); its manager can no "
                "longer give it out"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"MPI is finalized: the {self._describe()} is gone")
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
    def has_sync_hooks(self) -> bool:
        """Whether sync hooks were added (see :meth:`add_sync_hook`). Local."""
        return bool(self._sync_hooks)

    def mark_unusable(self, reason: str) -> None:
        """Refuse every later registration and sync point, saying ``reason``. Local, no MPI.

        Collective in effect: call it on every rank alike (from a sync hook
        deciding on the agreed :attr:`votes`, say), or the ranks will
        disagree on whether the next sync point runs. The first reason
        stays. A :class:`DestroyError` raised by the sync point during which
        it was called says it too.
        """
        if self._broken is None:
            self._broken = reason

    def add_leak_hook(self, hook: Callable[[Manager], Iterable[str]]) -> None:
        """Let leak reports explain why objects on this communicator are still alive.

        ``hook(manager)`` returns sentences for this rank (an owner kept alive
        by its own resource, say). Local; must not make MPI calls.
        """
        if hook not in self._leak_hooks:
            self._leak_hooks.append(hook)

    def leak_reasons(self) -> list[str]:
        """What the leak hooks say for this rank. Local."""
        out: list[str] = []
        for hook in self._leak_hooks:
            out.extend(hook(self))
        return out

    @property
    def registered(self) -> int:
        """Registrations whose destroy has not run (objects alive or queued). Local."""
        return len(self._regs)

    def add_sync_hook(
        self,
        hook: Callable[[Manager], None],
        vote: Callable[[Manager], tuple[int, int]] | None = None,
    ) -> None:
        """Run ``hook(manager)`` at every sync point on this communicator.

        Collective: add it on every rank, since it runs on every rank at each
        sync point, after the agreed destroys and before any
        :class:`DestroyError` is raised, so it may make collective calls on
        :attr:`comm` (PETSc's garbage cleanup does). Adding the same hook again
        does nothing. A hook that raises does so on its rank only, and leaves
        the manager unusable there: keep hooks to calls that succeed or fail
        on every rank alike.

        ``vote(manager)`` (local, no MPI) returns two ints that ride in the
        sync point's own header allreduce; their MAX over every rank is in
        :attr:`votes` when the hook runs, so a hook can decide, the same way on
        every rank, whether it has work, without a collective of its own. One
        voting hook per manager.
        """
        if vote is not None:
            if self._vote is not None and self._vote is not vote:
                raise CollectiveGCError(f"the {self._describe()} already has a voting sync hook")
            self._vote = vote
        if hook not in self._sync_hooks:
            self._sync_hooks.append(hook)

    def add_child(self, child: _Child) -> None:
        """Visit ``child``, a derived communicator (see :mod:`._comms`), at each sync point.

        Collective over the child's group: add it on every rank of the child,
        in the same order.
        """
        self._children.append(child)
        self.children_made += 1

    def add_view_hook(self, hook: Callable[[Manager], Iterable[tuple[str, str]]]) -> None:
        """Let :func:`collective_gc.view` show pending entries we do not manage.

        ``hook(manager)`` returns ``(type name, description)`` pairs for this
        rank (PETSc's own garbage, say). Local; must not make MPI calls.
        """
        if hook not in self._view_hooks:
            self._view_hooks.append(hook)

    def view_rows(self) -> list[tuple[str, str]]:
        """What the view hooks report for this rank. Local."""
        rows: list[tuple[str, str]] = []
        for hook in self._view_hooks:
            rows.extend(hook(self))
        return rows

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
        return self._next_key

    def _describe(self) -> str:
        return f"communicator of size {self._size} (rank {self._rank})"

    def describe(self) -> str:
        """``"communicator of size N (rank r)"``, for messages."""
        return self._describe()

    def __repr__(self) -> str:
        state = " broken" if self._broken else ""
        return (
            f"<collective_gc.Manager{state} of a {self._describe()}: "
            f"{len(self._regs)} registered, {self._pend.size + len(self._inbox)} pending, "
            f"{self.destroyed} destroyed, {self._seq} sync points>"
        )

    # -- registration --------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self._forked:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {self._describe()} and its "
                "registrations belong to the parent process"
            )
        if self._destroying and self._destroying == threading.get_ident():
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{self._seq} on the {self._describe()}; do it after the sync point"
            )
        if self._broken is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {self._describe()} is unusable since {self._broken}"
            )
        if MPI.Is_finalized():
            raise CollectiveGCError(f"cannot {what} on the {self._describe()}: MPI is finalized")

    def _private(self, deadline: _agree.Deadline) -> MPI.Intracomm:
        """The private duplicate, made at first use against ``deadline``. Collective."""
        if self._comm is not None:
            return self._comm
        # The lock: a first registration on one thread and a first sync point
        # on another must not make two duplicates (ranks could pair them
        # differently).
        with self._lock:
            if self._comm is not None:
                return self._comm
            if self._comm_freed:
                raise CollectiveGCError(
                    f"the {self._describe()} was freed before its first sync point: "
                    "its pending destroys cannot be agreed"
                )
            # Non-blocking, so that a deadline bounds it, and never left pending
            # once we return: a duplicate still in progress when the user frees
            # the communicator would be completed on freed memory.
            comm, req = _agree.dup(self._user_comm)
            try:
                _agree.wait(req, deadline, self._what("duplicating its communicator"))
            except BaseException as exc:
                self._broken = f"duplicating its communicator was abandoned ({type(exc).__name__})"
                raise
            self._comm = comm
            _in_collective_order(self)
            return comm

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
        check_destroy(obj, destroy, args, kwargs)
        registrar = self._registrar
        held = False
        if registrar is not None:
            held = registrar.acquire(False)
            if not held:
                holder = self._registrar_ident
                if not holder:  # it has the lock, and is about to write its ident
                    time.sleep(0.001)
                    holder = self._registrar_ident
                raise RegistrationError(
                    f"thread {threading.current_thread().name!r} tried to register an object "
                    f"on the {self._describe()} while thread {_thread_name(holder)!r} was "
                    "registering one: registration on a communicator of size > 1 is "
                    "collective, and ranks would number objects registered from two "
                    "threads at once in different orders. Register from one thread."
                )
            self._registrar_ident = _get_ident()
        try:
            for ref in weakref.getweakrefs(obj):
                if isinstance(ref, Registration) and ref._owner is self and ref._state == ALIVE:
                    raise RegistrationError(
                        f"this {type(obj).__name__!r} object is already registered on the "
                        f"{self._describe()} as key {ref.key} ({ref.name!r}); register one "
                        "destroy that releases all it owns, or detach the first registration"
                    )
            reg = make_registration(obj, self, self._inbox.append, -1, destroy, args, kwargs, name)
            # The key is taken and the registration stored with nothing in
            # between that allocates (so no collector and no finalizer can run
            # and register meanwhile): every key is given once. On a larger
            # communicator the registrar lock already lets one thread at a
            # time here, and each dict operation is atomic.
            if registrar is None:
                with self._reg_lock:
                    key = self._next_key
                    self._next_key = key + 1
                    reg.key = key
                    self._regs[key] = reg
                    self.created += 1
            else:
                key = self._next_key
                self._next_key = key + 1
                reg.key = key
                self._regs[key] = reg
                self.created += 1
            if self._comm is None and self._size > 1:
                # The first registration makes the private duplicate while the
                # communicator is surely alive (the user may free it before
                # any sync point), against the innermost scope's timeout.
                timeout = _TIMEOUT_SOURCE[0]()
                at = None if timeout is None else time.monotonic() + timeout
                self._private(_agree.Deadline(at))
            return reg
        finally:
            if held:
                registrar.release()  # type: ignore[union-attr]

    def _retire(self, reg: Registration, state: int) -> None:
        # State first: a finalizer that runs after it pushes nothing; one that
        # ran before it left the object dead, which marks the queue stale.
        reg._state = state
        with self._reg_lock:
            self._regs.pop(reg.key, None)
        if reg() is None:
            self._stale = True

    def _destroy_now(self, reg: Registration) -> None:
        with self._lock:
            if reg._state >= DESTROYED:
                return
            self._check_usable(f"destroy key {reg.key} ({reg.name!r})")
            self._retire(reg, DESTROYED)
            self.destroyed += 1
            reg._run()

    def _detach(self, reg: Registration) -> bool:
        with self._lock:
            if reg._state >= DESTROYED:
                return False
            self._retire(reg, DETACHED)
            reg._destroy, reg._args = None, ()
            return True

    def _votes_now(self) -> tuple[int, int]:
        # No vote once the user's communicator is freed (collectively, so on
        # every rank alike): a hook looking at it then would read a dead handle.
        if self._vote is None or self._comm_freed:
            return (0, 0)
        return self._vote(self)

    def _note_cyclic(self, reg: Registration) -> None:
        # Called by the finalizer inside the cyclic collector: append only.
        self._cyclic_inbox.append(reg)

    # -- the queue -------------------------------------------------------------

    def _drain(self) -> int:
        """Take the inbox into the pending keys; count and note cyclic finalizations.

        Only sync points drain (under the manager's lock): what a sync point
        sees never depends on a diagnostic having run before it.
        """
        cyc = self._cyclic_inbox
        cyclic = 0
        if cyc:
            nc = len(cyc)
            batch_c = cyc[:nc]
            del cyc[:nc]  # one C call: appends racing with it land after the slice
            for reg in batch_c:
                if reg._state == ALIVE:
                    cyclic += 1
                    self.last_cyclic.append((reg._typename, reg.name, reg.key, reg.origin))
            self.cyclic += cyclic
        inbox = self._inbox
        n = len(inbox)
        if n or self._stale:
            batch = inbox[:n]
            del inbox[:n]
            if self._stale:
                # Rare: explicit destroys or detaches of dead objects since the
                # last drain. Drop their keys, wherever they are.
                self._stale = False
                batch = [r for r in batch if r._state == ALIVE]
                regs = self._regs
                keep = np.fromiter((k in regs for k in self._pend.tolist()), bool, self._pend.size)
                self._pend, self._pend_seq = self._pend[keep], self._pend_seq[keep]
            if batch:
                new = np.fromiter(map(_KEY_OF, batch), np.int64, len(batch))
                self._pend = np.concatenate((self._pend, new))
                self._pend_seq = np.concatenate((self._pend_seq, np.full(new.size, self._seq)))
        return cyclic

    def pending(self) -> list[Registration]:
        """What this rank has queued, oldest key first. Local, and changes nothing.

        Safe to call at any time, from any thread, inside a destroy too: it
        reads the pending keys and the inbox without draining them.
        """
        regs = self._regs
        seq = self._seq
        queued: dict[int, int] = dict(zip(self._pend.tolist(), self._pend_seq.tolist()))
        for reg in tuple(self._inbox):  # tuple() copies in C: appends cannot interleave
            if reg._state == ALIVE:
                queued.setdefault(reg.key, seq)
        out = []
        for key in sorted(queued):
            found = regs.get(key)
            if found is not None and found._state == ALIVE:
                found.queued_at = queued[key]
                out.append(found)
        return out

    def alive(self) -> list[Registration]:
        """Registrations whose objects are still alive on this rank. Local, changes nothing."""
        regs = list(self._regs.values())  # copied in C: no registration can interleave
        return sorted((r for r in regs if r() is not None), key=_KEY_OF)

    def cyclic_pending(self) -> list[Registration]:
        """Registrations finalized by the cyclic collector and not yet seen by a
        sync point. Local, changes nothing."""
        return [r for r in tuple(self._cyclic_inbox) if r._state == ALIVE]

    # -- sync points -----------------------------------------------------------

    def _what(self, stage: str) -> Callable[[], str]:
        # Formatted only on timeout, while the caller's frames are still on the
        # stack; extracting a stack at every sync point would cost more than
        # the agreement itself.
        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self._rank}: sync point {self._seq} on the {self._describe()} did "
                f"not complete {stage} before its deadline; called from:\n{where}"
            )

        return describe

    def allgather(self, value: Any, timeout: float | None = None) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), over the private duplicate.

        For diagnostics that gather from every rank (``view``). ``timeout``
        bounds the wait (then :class:`CollectiveTimeoutError`, and the manager
        is unusable: the abandoned gather could match a later one).
        """
        if self._size == 1:
            return [value]
        with self._lock:
            # Allowed inside a destroy: every rank runs the same destroys in
            # the same order, so a gather there is in step.
            if self._forked or self._broken is not None or MPI.Is_finalized():
                self._check_usable("gather from every rank")
            deadline = _agree.Deadline(None if timeout is None else time.monotonic() + timeout)
            try:
                comm = self._private(deadline)
                return _agree.allgather(comm, value, deadline, self._what("a gather"))
            except BaseException as exc:
                self._broken = f"a gather was left by {type(exc).__name__} ({exc})"
                raise

    def sync(
        self,
        *,
        deadline: float | None = None,
        policy: Sequence[int] = (),
        on_header: Callable[[Sequence[int]], None] | None = None,
        collected: int | None = None,
        t0: float | None = None,
        at_exit: bool = False,
    ) -> CollectStats:
        """Collective. Agree on the keys pending on every rank and destroy them.

        ``deadline`` is a ``time.monotonic()`` value. ``policy`` fills the
        header's policy slots (from ``H_POLICY`` on) and ``on_header`` sees the
        reduced header before anything is destroyed (it may raise, and then
        does so on every rank alike); both are for :mod:`._scope`.
        ``collected``/``t0`` only feed the returned stats. ``at_exit`` marks the
        exit agreement, which never matches a sync point of the program.
        """
        if t0 is None:
            t0 = time.perf_counter()
        with self._lock:
            if self._forked or self._destroying or self._broken is not None or MPI.Is_finalized():
                self._check_usable("run a sync point")
            dl = _agree.Deadline(deadline)
            try:
                # Derived communicators first: their resources are newer, and may
                # have to go before one of ours (the communicator itself) can.
                child_failures = self._sync_children(dl) if self._children else []
                if self.last_cyclic:
                    self.last_cyclic = []
                if self._inbox or self._cyclic_inbox or self._stale:
                    cyclic = self._drain()
                else:
                    cyclic = 0
                return self._sync_locked(
                    dl, policy, on_header, collected, t0, cyclic, child_failures, at_exit
                )
            except CollectiveTimeoutError:
                # An abandoned collective could match a later one: never again.
                self._broken = f"sync point {self._seq} timed out on this rank"
                raise
            except CollectiveMismatchError:
                # Every rank saw the same reduced header, so every rank gets here.
                self._broken = f"the ranks disagreed at sync point {self._seq}"
                raise
            except BaseException as exc:
                if self._collective:
                    # Left half-way through its collectives on this rank only:
                    # the other ranks' next collective would match the wrong one.
                    self._broken = (
                        f"sync point {self._seq} was left on this rank by "
                        f"{type(exc).__name__} before its collectives were done"
                    )
                raise
            finally:
                self._collective = False

    def _sync_locked(
        self,
        dl: _agree.Deadline,
        policy: Sequence[int],
        on_header: Callable[[Sequence[int]], None] | None,
        collected: int | None,
        t0: float,
        cyclic: int,
        child_failures: list[tuple[int, str, BaseException]],
        at_exit: bool,
    ) -> CollectStats:
        """The body of :meth:`sync` after the drain, under the manager's lock."""
        votes = self._votes_now()
        agreed, any_errors = self._agreement(
            dl, policy, on_header, cyclic, len(child_failures), votes, at_exit
        )
        seq = self._seq
        self._seq += 1
        failures = self._destroy_agreed(agreed) if agreed.size else []
        failures.extend(child_failures)
        any_failed = bool(failures)
        # Whether anything ran depends only on agreed values, so every rank
        # takes the same branch: then one more small allreduce says whether
        # a destroy failed anywhere (KeyboardInterrupt and SystemExit
        # included: they are re-raised only after this) and refreshes the
        # hook's vote (the destroys may have changed it: PETSc garbage, say).
        if agreed.size or any_errors:
            votes = self._votes_now()
            if self._size > 1:
                post = _agree.allreduce(
                    self._private(dl),
                    array.array("q", (len(failures), *votes)),
                    _MAX,
                    dl,
                    self._what("its error check"),
                )
                any_failed = post[0] > 0
                votes = (post[1], post[2])
            self.votes = votes
        if self._sync_hooks and not self._comm_freed:
            for hook in self._sync_hooks:
                hook(self)
        if self._children:
            self._children = [c for c in self._children if not c.released]
        if any_failed:
            self._raise_failures(failures, seq, dl)
        self._collective = False
        seconds = time.perf_counter() - t0
        # tuple.__new__: a NamedTuple's own __new__ is a Python function, a
        # measurable part of an empty sync point.
        return _new_tuple(
            CollectStats,
            (agreed.size, self._pend.size + len(self._inbox), cyclic, seconds, seq, collected),
        )

    def _agreement(
        self,
        dl: _agree.Deadline,
        policy: Sequence[int],
        on_header: Callable[[Sequence[int]], None] | None,
        cyclic: int,
        child_errors: int,
        votes: tuple[int, int],
        at_exit: bool,
    ) -> tuple[np.ndarray[Any, Any], bool]:
        """Collective. The keys to destroy now, ascending, and whether any rank
        saw a destroy fail on a derived communicator."""
        pend = self._pend
        if self._size == 1:
            self.votes = votes
            if on_header is not None:
                local = [0] * _agree.HEADER_LEN
                local[H_CYCLIC] = cyclic
                local[H_CHILD_ERRORS] = child_errors
                local[H_POLICY : H_POLICY + len(policy)] = policy
                on_header(local)
            return np.sort(pend), child_errors > 0
        n = pend.size
        if n:
            lo, neg_hi = int(pend.min()), -int(pend.max())
        else:
            lo, neg_hi = NO_KEY, 1
        seq, nk = self._seq, self._next_key
        gen = policy[0] if policy else 0
        kind = int(at_exit)
        head = array.array(
            "q",
            (
                n,
                seq,
                -seq,
                nk,
                -nk,
                lo,
                neg_hi,
                cyclic,
                child_errors,
                gen,
                *votes,
                kind,
                -kind,
                NO_DEADLINE if dl.at is None else dl.wall_us(),
            ),
        )
        # From here until the sync point's last collective, leaving by an
        # exception on this rank only makes the manager unusable (see sync).
        self._collective = True
        comm = self._comm if self._comm is not None else self._private(dl)
        if dl.at is None:
            # The common case, in place: this allreduce is most of an empty
            # sync point's cost. Non-blocking even here: a blocking collective
            # never matches the non-blocking one of a rank with a deadline.
            req = comm.Iallreduce(_IN_PLACE, head, _MAX)
            try:
                req.Wait()
            except BaseException:
                _agree.keep_alive(req, head)  # MPI may still write into it
                raise
            red = head
        else:
            red = _agree.allreduce(comm, head, _MAX, dl, self._what("its header"))
        if red[H_NEG_DEADLINE] != NO_DEADLINE:
            dl.agree(red[H_NEG_DEADLINE])
            if dl.late_after is not None and time.time() > dl.late_after:
                raise CollectiveTimeoutError(
                    self._what("its header")()
                    + "\n(it completed here only after the deadline of another rank had "
                    "passed: that rank gave up on this sync point)"
                )
        if (
            red[H_SEQ] != -red[H_NEG_SEQ]
            or red[H_NEXT] != -red[H_NEG_NEXT]
            or red[H_KIND] != -red[H_NEG_KIND]
        ):
            raise self._mismatch(red, at_exit)
        self.votes = (red[H_VOTE], red[H_VOTE + 1])
        if on_header is not None:
            on_header(red)
        any_errors = red[H_CHILD_ERRORS] > 0
        if red[H_COUNT] == 0:
            return _NO_KEYS, any_errors
        common = _agree.intersect(
            comm,
            np.sort(pend),
            red[H_LO],
            -red[H_NEG_HI],
            red[H_COUNT],
            dl,
            self._what("the key agreement"),
        )
        return common, any_errors

    def _sync_children(self, dl: _agree.Deadline) -> list[tuple[int, str, BaseException]]:
        failures: list[tuple[int, str, BaseException]] = []
        for child in list(self._children):
            failures.extend(child.visit(dl.at))
            if child.released:
                self._children.remove(child)
        return failures

    def _mismatch(self, red: Sequence[int], at_exit: bool) -> CollectiveMismatchError:
        parts = []
        if red[H_KIND] != -red[H_NEG_KIND]:
            parts.append(
                "some ranks were at a sync point of the program and others at the exit "
                f"agreement (this rank: {'exit' if at_exit else 'a sync point'}); a rank "
                "ran more sync points than the others, or exited early"
            )
        if red[H_SEQ] != -red[H_NEG_SEQ]:
            parts.append(
                f"sync-point numbers range from {-red[H_NEG_SEQ]} to {red[H_SEQ]} across "
                f"the ranks (this rank: {self._seq}); a rank skipped a sync point"
            )
        if red[H_NEXT] != -red[H_NEG_NEXT]:
            parts.append(
                f"registration counts range from {-red[H_NEG_NEXT]} to {red[H_NEXT]} "
                f"(this rank: {self._next_key}); the ranks did not register the same "
                "objects (register is collective)"
            )
        return CollectiveMismatchError(
            f"rank {self._rank}: the ranks of the {self._describe()} disagree at sync "
            f"point {self._seq}: " + "; ".join(parts) + ". Nothing was destroyed."
        )

    def _destroy_agreed(self, agreed: np.ndarray[Any, Any]) -> list[tuple[int, str, BaseException]]:
        """Run the agreed destroys; return (key, name, exception) of those that raised.

        Newest first: a resource made from another one (a KSP from a Mat, a
        sub-communicator from a communicator) is released before its source.
        Every agreed destroy runs, whatever raises (KeyboardInterrupt and
        SystemExit too: the caller re-raises them once the sync point's
        collectives are done).
        """
        # Every registration out of the dict and marked destroyed before any
        # destroy runs (a destroy that reaches for another registration of the
        # batch finds it destroyed), its call taken out (a registration someone
        # still holds lets go of the destroyed objects), registrations
        # destroyed explicitly meanwhile skipped; and the runs of calls to a
        # batched destroy found. The cost per key is the point of this
        # function, so these passes run in C where the extension is built.
        batched, runs = _BATCHES
        with self._reg_lock:
            regs, fns, argss, segments = _take_batch(
                self._regs, agreed[::-1].tolist(), DESTROYED, batched
            )
        # Segments [0, begun) have been handed to a runner, which makes every
        # call whatever raises; an interrupt (a signal) can only land between
        # runners, and then the rest is put back (see _untake).
        begun = 0
        failures: list[tuple[int, str, BaseException]] = []
        try:
            if not self._regs:
                # A dict never shrinks but clear() gives back a large backlog's
                # memory; the same dict, as registration on another thread may
                # be storing into it.
                self._regs.clear()
            if segments is None:  # out of memory finding the batches: one by one then
                segments = [(0, len(fns), -1)]
            # The agreed keys leave the pending set before any destroy runs, so
            # nothing a destroy calls can see them pending, and nothing it
            # queues can be mistaken for them.
            pend = self._pend
            if agreed.size == pend.size:  # agreed is a subset of pend: they are equal
                self._pend = self._pend_seq = _NO_KEYS
            else:
                keep = ~np.isin(pend, agreed, assume_unique=True)
                self._pend, self._pend_seq = pend[keep], self._pend_seq[keep]
            self._destroying = threading.get_ident()
            for start, end, index in segments:
                if len(segments) == 1:
                    fchunk, achunk = fns, argss
                else:
                    fchunk, achunk = fns[start:end], argss[start:end]
                begun += 1
                try:
                    errors = _run_each(fchunk, achunk) if index < 0 else runs[index](achunk)
                except BaseException as runner_exc:
                    # The runner itself failed (out of memory recording a
                    # failure), after trying every call: which one is unknown.
                    errors = [(-1, runner_exc)]
                for i, exc in errors:
                    if i < 0:
                        failures.append((-1, f"one of {end - start} destroys", exc))
                    else:
                        failures.append((regs[start + i].key, regs[start + i].name, exc))
                del fchunk, achunk
        except BaseException:
            if segments is None:
                rest = 0
            else:
                rest = segments[begun][0] if begun < len(segments) else len(fns)
            self._untake(regs[rest:], fns[rest:], argss[rest:])
            regs = regs[:rest]
            raise
        finally:
            self._destroying = 0
            self.destroyed += len(regs)
            del regs, fns, argss  # the destroyed objects go here, unless someone else holds them
        return failures

    def _untake(
        self,
        regs: list[Registration],
        fns: list[Callable[..., object]],
        argss: list[tuple[Any, ...]],
    ) -> None:
        """Put back agreed registrations whose destroys never started (an
        interrupt between two runs of destroys): they are pending again, not lost."""
        if not regs:
            return
        with self._reg_lock:
            for reg, fn, args in zip(regs, fns, argss):
                reg._destroy, reg._args, reg._state = fn, args, ALIVE
                self._regs[reg.key] = reg
        keys = np.fromiter((r.key for r in regs), np.int64, len(regs))
        keys = keys[~np.isin(keys, self._pend)]  # interrupted before they left it
        self._pend = np.concatenate((self._pend, keys))
        self._pend_seq = np.concatenate((self._pend_seq, np.full(keys.size, self._seq)))

    def _raise_failures(
        self,
        failures: list[tuple[int, str, BaseException]],
        seq: int,
        dl: _agree.Deadline,
    ) -> None:
        """Collective when some rank had a failure (agreed by the caller): raise on all.

        A rank whose destroy raised KeyboardInterrupt or SystemExit re-raises
        it, with a note; every other rank raises :class:`DestroyError`.
        """
        mine = [(self._rank, k, n, f"{type(e).__name__}: {e}") for k, n, e in failures]
        if self._size > 1:
            everyone = _agree.allgather(self._private(dl), mine, dl, self._what("its error report"))
            mine = [f for per_rank in everyone for f in per_rank]
        self._collective = False
        lines = "\n".join(f"  rank {r}, key {k} ({n!r}): {msg}" for r, k, n, msg in mine)
        text = (
            f"{len(mine)} destroy(s) raised at sync point {seq} on the "
            f"{self._describe()}; every other agreed destroy ran:\n{lines}"
        )
        if self._broken is not None:
            text += f"\nThe {self._describe()} is unusable from now on: {self._broken}"
        local = [e for _, _, e in failures]
        interrupt = next((e for e in local if not isinstance(e, Exception)), None)
        if interrupt is not None:
            interrupt.add_note(
                f"collective_gc: raised by a destroy on rank {self._rank}; every agreed "
                "destroy ran, and the other ranks raised DestroyError. " + text
            )
            try:
                raise interrupt
            finally:
                interrupt = None
        error = DestroyError(text, mine, local)
        cause = local[0] if local else None
        try:
            raise error from cause
        finally:
            error = cause = None  # type: ignore[assignment]

    # -- exit and fork ---------------------------------------------------------

    def _leak_text(self) -> str:
        regs = self.pending()
        names = ", ".join(f"key {r.key} ({r.name!r})" for r in regs[:10])
        more = f" and {len(regs) - 10} more" if len(regs) > 10 else ""
        return f"{len(regs)} pending destroy(s) on the {self._describe()}: {names}{more}"

    def _exit_sync(self, deadline: float) -> None:
        if self._forked:
            return
        if self._broken is None and not (self._size > 1 and self._comm is None):
            try:
                self.sync(deadline=deadline, at_exit=True)
            except CollectiveTimeoutError:
                warnings.warn(
                    f"collective_gc: rank {self._rank}: the final agreement on the "
                    f"{self._describe()} timed out at exit (did another rank exit early "
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
                f"collective_gc: rank {self._rank}: leaked at exit ({why}): {self._leak_text()}",
                ExitLeakWarning,
                stacklevel=1,
            )

    def _after_fork(self) -> None:
        self._forked = True
        for reg in list(self._regs.values()):
            reg._state = DETACHED
        self._regs.clear()
        self._inbox.clear()
        self._cyclic_inbox.clear()
        self._pend = self._pend_seq = _NO_KEYS

    def _on_comm_freed(self) -> None:
        # Called from an MPI attribute delete callback: record only, no MPI.
        self._comm_freed = True
        _FREED.append(self)

    def _release(self) -> bool:
        """After the user freed the communicator: free the private duplicate and
        leave the registry, once nothing is registered. Local (MPI_Comm_free
        does not wait for the other ranks). True if released."""
        with self._lock:
            if self._collective or self._regs or self._inbox or self._pend.size:
                return False
            if self._comm is not None and self._size > 1:
                self._comm.Free()
            self._comm = None
            if self._broken is None:
                self._broken = "its communicator was freed"
        with _REGISTRY_LOCK:
            if self in _MANAGERS:
                _MANAGERS.remove(self)
            if self in _COLLECTIVE_ORDER:
                _COLLECTIVE_ORDER.remove(self)
            if _LAST[1] is self:
                _LAST[0] = _LAST[1] = None
        return True


# -- the registry of managers ------------------------------------------------

_MANAGERS: list[Manager] = []
# Managers of communicators of size > 1 in the order of their first
# collective (the duplicate's), which is the same on every rank that shares
# them (unlike the order of lookups, which are local): the exit agreement
# and the pytest plugin visit managers in this order.
_COLLECTIVE_ORDER: list[Manager] = []


def _in_collective_order(mgr: Manager) -> None:
    with _REGISTRY_LOCK:
        _COLLECTIVE_ORDER.append(mgr)


_REGISTRY_LOCK = threading.RLock()
_KEYVAL: list[int] = []
# A weak reference to the communicator object of the last lookup, and its
# manager: a cache for the common case of many registrations on one communicator.
_LAST: list[Any] = [None, None]
# The timeout of the innermost collective_scope of this thread, for waits
# outside sync points (the first registration's duplicate); set by _scope.
_TIMEOUT_SOURCE: list[Callable[[], float | None]] = [lambda: None]
# Managers whose user communicator was freed (appended by the attribute delete
# callback, which must not call MPI): released at the next safe point.
_FREED: list[Manager] = []


def release_freed() -> None:
    """Release the managers of freed communicators that have nothing left. Local.

    A freed communicator's manager that still has registrations stays: its
    destroys are agreed at exit, over its private duplicate.
    """
    if MPI.Is_finalized():
        return
    # One still holding registrations is kept in the list (its destroys are
    # agreed at exit, or at a sync point someone runs on it) and tried again.
    _FREED[:] = [m for m in list(_FREED) if not m._release() and m.registered]


def _delete_attr(comm: MPI.Comm, keyval: int, mgr: Manager) -> None:
    mgr._on_comm_freed()


def _keyval() -> int:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_delete_attr))
    return _KEYVAL[0]


def _check_comm(comm: object) -> MPI.Intracomm:
    """Refuse what is not a usable intracommunicator, with a clear error."""
    if MPI.Is_finalized():
        raise CollectiveGCError("MPI is already finalized")
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError("the communicator is MPI.COMM_NULL (freed, or this rank is not in it)")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"expected an mpi4py intracommunicator, got {type(comm).__name__!r} object"
            + (" (use comm=None for a rank-local registration)" if comm is None else "")
        )
    return comm


def _cached(comm: object) -> Manager | None:
    last = _LAST
    mgr = last[1]
    if mgr is not None and last[0]() is comm and not mgr._comm_freed:
        # The same Python object as last time, and its handle was not freed
        # (freeing runs our attribute delete callback): the same manager.
        return mgr  # type: ignore[no-any-return]
    return None


def lookup(comm: MPI.Comm) -> Manager | None:
    """The manager of ``comm`` if it has one, else None. Local: no communication."""
    mgr = _cached(comm)
    if mgr is not None:
        return mgr
    c = _check_comm(comm)
    if not _KEYVAL:
        return None
    found = c.Get_attr(_KEYVAL[0])
    return found if isinstance(found, Manager) else None


def manager(comm: MPI.Comm) -> Manager:
    """The manager of ``comm``: the same object each time for the same communicator.

    Local: making a manager sends no message (its private duplicate of the
    communicator is made by the first registration and sync point, which
    are collective anyway).
    """
    mgr = _cached(comm)
    if mgr is not None:
        return mgr
    c = _check_comm(comm)
    if _FREED:
        release_freed()
    kv = _keyval()
    # Get or create under the lock: two threads making the first lookup of one
    # communicator must get one manager (a second Set_attr would replace the
    # first, and MPI would run the delete callback on it).
    with _REGISTRY_LOCK:
        found = c.Get_attr(kv)
        if isinstance(found, Manager):
            mgr = found
        else:
            mgr = Manager(c)
            c.Set_attr(kv, mgr)
            _MANAGERS.append(mgr)
    # A weak reference: holding the user's communicator object would keep a
    # managed one (cgc.dup) alive for ever.
    _LAST[0], _LAST[1] = weakref.ref(comm), mgr
    assert isinstance(mgr, Manager)
    return mgr


def managers() -> list[Manager]:
    """Every manager in use in this process. Local.

    Those of communicators of size > 1 come first, in the order of their
    first collective use (the same on every rank that shares them), then the
    others in the order they were made.
    """
    with _REGISTRY_LOCK:
        ordered = list(_COLLECTIVE_ORDER)
        seen = set(map(id, ordered))
        return ordered + [m for m in _MANAGERS if id(m) not in seen]


def register(
    obj: object,
    destroy: Callable[..., object],
    *args: Any,
    comm: MPI.Comm | None,
    name: str | None = None,
    **kwargs: Any,
) -> Registration:
    """Collective over ``comm``: manage ``obj``; when it dies, queue ``destroy(*args, **kwargs)``.

    Every rank registers the same objects in the same order, so the
    registration gets the same key on every rank; a rank that registers in a
    different order makes the next sync point raise
    :class:`CollectiveMismatchError` on every rank. On a communicator of size
    > 1, register from one thread at a time: a registration that starts while
    another thread is registering on the same communicator raises
    :class:`RegistrationError`. On ``COMM_SELF`` (and any communicator of
    size 1) and with ``comm=None``, any thread may register at any time.

    When ``obj`` dies (by refcounting or in the cyclic collector, on any
    thread) the destroy is only queued: it runs at the next sync point on
    ``comm`` (:func:`collect`, a scope's sync) at which every rank has queued
    it, on the thread calling that sync point, newest key first.

    ``comm=None`` makes a rank-local registration, for resources that are safe
    to release from another thread: the destroy runs on a background reaper
    thread soon after ``obj`` dies, exactly once, with no agreement.

    The registration holds only a weak reference to ``obj``, and must not hold
    a strong one: a ``destroy`` or argument that is ``obj``, a bound method of
    it, or a partial or closure over it, is refused with
    :class:`RegistrationError` (as is an object that cannot be weakly
    referenced, a destroy that is not callable, or an object already
    registered on the same communicator). The keyword arguments ``comm`` and
    ``name`` belong to ``register`` and cannot be passed on to the destroy.
    """
    if comm is None:
        return local.register(obj, destroy, *args, name=name, **kwargs)
    return manager(comm).register(obj, destroy, args, kwargs, name)


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as seconds (None: no deadline), or ValueError/TypeError. Local."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not timeout > 0:  # also refuses nan
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return None if timeout == float("inf") else float(timeout)


def _check_generation(generation: object) -> None:
    if generation is not None and (isinstance(generation, bool) or generation not in (0, 1, 2)):
        raise ValueError(f"generation must be 0, 1, 2 or None, not {generation!r}")


def collect(
    comm: MPI.Comm, *, generation: int | None = 2, timeout: float | None = None
) -> CollectStats:
    """Collective sync point: collect garbage locally, then destroy what all ranks queued.

    Runs ``gc.collect(generation)`` on this rank (``None`` skips it), then agrees
    with the other ranks of ``comm`` on the keys every rank has queued and runs
    those destroys, newest first, in the same order on every rank. Keys queued
    on only some ranks stay queued for a later sync point.

    Every rank of ``comm`` must call it: a rank that skips it leaves the others
    waiting in the agreement (for ever, or until ``timeout`` seconds pass, when
    :class:`CollectiveTimeoutError` is raised and the manager becomes
    unusable, on every rank: a rank that arrives after the others gave up
    raises it too). If any destroy raises, on any rank, every agreed destroy
    still runs and then :class:`DestroyError` is raised on every rank (a
    KeyboardInterrupt or SystemExit raised by a destroy is re-raised on its
    rank instead, after the same collectives). A bad ``timeout`` or
    ``generation`` raises ValueError before any collective.
    """
    t0 = time.perf_counter()
    # The common case (no timeout, default generation) without extra calls:
    # an empty sync point is mostly overhead around one small allreduce.
    seconds = None if timeout is None else check_timeout(timeout)
    if generation is not None and generation != 2:
        _check_generation(generation)
    mgr = manager(comm)
    collected = None if generation is None else gc.collect(generation)
    deadline = None if seconds is None else time.monotonic() + seconds
    return mgr.sync(deadline=deadline, collected=collected, t0=t0)


def pending(comm: MPI.Comm | None) -> list[Registration]:
    """The destroy requests this rank has queued on ``comm``, oldest first.

    Local: no communication, and it changes nothing (a communicator with no
    manager yet has nothing pending).
    """
    if comm is None:
        return []
    mgr = lookup(comm)
    return [] if mgr is None else mgr.pending()


def exit_timeout() -> float:
    """Seconds the exit agreement may wait (``COLLECTIVE_GC_EXIT_TIMEOUT``, default 10)."""
    try:
        value = float(os.environ.get("COLLECTIVE_GC_EXIT_TIMEOUT", "10"))
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


def _at_exit() -> None:
    # Runs before mpi4py and petsc4py finalize (they use Py_AtExit, which runs
    # after every atexit handler).
    if _FLAGS[1]:
        return  # already shut down
    if os.getpid() != _PID:
        # A forked child never runs the parent's destroys or sync points.
        _FLAGS[1] = 1
        local.shutdown()
        return
    try:
        if _UNCAUGHT[0] and _MANAGERS:
            # Dying of an uncaught exception, which may have happened on this
            # rank only: the others may never reach an exit agreement, and
            # under `python -m mpi4py` the job is about to be aborted. Waiting
            # for them would only delay that; leak instead, and say so.
            left = sum(len(m.pending()) for m in _MANAGERS)
            if left:
                warnings.warn(
                    f"collective_gc: exiting on an uncaught exception: {left} pending "
                    "collective destroy(s) not run",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            return
        if not MPI.Is_initialized() or not _MANAGERS:
            return
        if MPI.Is_finalized():
            # MPI was finalized by hand: nothing can be agreed any more.
            for mgr in list(_MANAGERS):
                mgr._drain()
                if mgr.pending():
                    warnings.warn(
                        f"collective_gc: rank {mgr.rank}: leaked at exit (MPI was finalized "
                        f"before them): {mgr._leak_text()}",
                        ExitLeakWarning,
                        stacklevel=1,
                    )
            return
        gc.collect()
        release_freed()
        deadline = time.monotonic() + exit_timeout()
        # Newest first: sub-communicators before the communicators they came from.
        for mgr in reversed(managers()):
            mgr._exit_sync(deadline)
    finally:
        _FLAGS[1] = 1  # finalizers from now on do nothing
        local.shutdown()


def _after_fork_in_child() -> None:
    _FLAGS[0] = 0
    _LAST[0] = _LAST[1] = None
    for mgr in _MANAGERS:
        mgr._after_fork()
    local.after_fork()


# Whether the interpreter is dying of an uncaught exception: noted by our
# sys.excepthook, which the interpreter calls only for that. (sys.last_value
# is no sign of it: pytest, for one, sets it for every failed test.)
_UNCAUGHT: list[bool] = [False]
_previous_excepthook = sys.excepthook


def _excepthook(
    tp: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
    _UNCAUGHT[0] = True
    _previous_excepthook(tp, value, tb)


sys.excepthook = _excepthook
_PID = os.getpid()
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
