"""The registrations of one family of congruent communicators: their guarded
path, the reads that change nothing, the log of cyclic deaths.

Keys come from the family's counter (its :class:`~collective_gc._state.FamilyState`):
registration is collective over the communicator it is made on, which has
the family's processes in the same order, so every rank gives the same object
the same key. Registrations on the family's other communicators (its members)
are numbered by the same counter; a member's registrations also add to the
order fingerprint, so that ranks that registered on two members in different
orders (the same count, different objects under one key) are told apart by
the agreement. A dead object's finalizer appends its registration to the
state's inbox; only a sync point drains the inbox into the pending keys, so
what a sync point sees never depends on a diagnostic having run before it.
Everything else here is a read that changes nothing.
"""

from __future__ import annotations

import operator
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

from ._errors import RegistrationError
from ._registration import (
    DETACHED,
    Owner,
    Registration,
    check_destroy,
    make_registration,
    owned_by,
)
from ._state import ALIVE, FamilyState, note_queued

__all__ = ["Registry"]

_KEY_OF = operator.attrgetter("key")
_FUNCTION = types.FunctionType
_get_ident = threading.get_ident
_getweakrefs = weakref.getweakrefs


def _thread_name(ident: int) -> str:
    # Only for error messages: the registrar records the cheap ident.
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"(thread {ident})"


class Registry:
    """Registrations of one family, from registration to agreed destroy."""

    __slots__ = (
        "state",
        "label",
        "lock",
        "registrar",
        "registrar_ident",
        "named",
        "cyclic_total",
        "last_cyclic",
        "last_cyclic_at",
        "cyclic_log",
    )

    # How many cyclic deaths the log keeps (the oldest go first).
    LOG = 10_000

    def __init__(self, state: FamilyState, label: str) -> None:
        self.state = state
        self.label = label  # the family, in messages
        parallel = state.size > 1
        # On a family of size 1 any thread may register: the guarded path
        # holds this (re-entrant: a finalizer run by an allocation here may
        # register on this very thread).
        self.lock = threading.RLock()
        # On a family of size > 1, held by the thread that is registering:
        # two threads registering at once would number objects in an order
        # that may differ between ranks, so the second one is refused, never
        # made to wait.
        self.registrar: threading.RLock | None = threading.RLock() if parallel else None
        self.registrar_ident = 0
        # (ident, name) of the last thread this path saw begin an interval,
        # for a refusal that names it after it exited (the state's fast
        # path begins intervals too, without a name: found then).
        self.named: tuple[int, str] = (0, "")
        self.cyclic_total = 0
        # (type, name, key, origin) of the cyclic deaths the last drain that
        # found any found, the sync point it drained at, and the last LOG ones
        # found by any drain (cyclic_total - len of it is the ordinal of its
        # first entry). Nothing clears them (the steady state drains no
        # cyclic death: it leaves them to the steps): cyclic_of_last reads
        # them only for the sync point that drained them.
        self.last_cyclic: list[tuple[str, str, int, Any]] = []
        self.last_cyclic_at = -1
        self.cyclic_log: list[tuple[str, str, int, Any]] = []

    @property
    def live(self) -> dict[int, Registration]:
        """The registrations whose destroy has not run, by key (the state's)."""
        return self.state.live

    # -- registration ----------------------------------------------------------

    def add(
        self,
        owner: Owner,
        mark: int,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        then: Callable[[], object] | None = None,
    ) -> Registration:
        """Give ``obj`` the next key, as a registration of ``owner`` (the
        member whose order mark is ``mark``: its tag, or where it was made,
        see collective_gc._lineage), then call ``then`` (if given) while still the
        only registering thread. Local; the caller makes it collective. The
        guarded path: the state's ``add_plain`` takes the common case in one
        call, and leaves this to the rest."""
        if args or kwargs or type(destroy) is not _FUNCTION or destroy.__closure__:
            check_destroy(obj, destroy, args, kwargs)  # else a plain function: nothing to check
        state = self.state
        registrar = self.registrar
        if registrar is None:
            guard = self.lock
            guard.acquire()
        else:
            # One registering thread at a time: the registrar, never waited for.
            if not registrar.acquire(False):
                holder = self._holder_or_acquire(registrar)
                if holder:
                    self._refuse_thread(owner, holder)
            me = _get_ident()
            interval = state.thread
            if interval != me:
                if interval:
                    registrar.release()
                    self._refuse_thread(owner, interval)
                # The first registration since the last sync point (add_plain
                # leaves it to this one): this thread is the interval's.
                self.named = (me, threading.current_thread().name)
                state.begin_interval(me)
            self.registrar_ident = me
            guard = registrar
        state.add_busy(1)
        try:
            if _getweakrefs(obj):
                self._refuse_duplicate(owner, obj)
            # The key is taken and the next one stored at once: making the
            # registration allocates, and a collection may run before this
            # thread stores anything more (CPython 3.12 runs a scheduled one
            # when a C call returns), whose finalizers may register on this
            # very thread (the guard is re-entrant) and must get keys of their own.
            key = state.take_key(mark)
            try:
                reg = make_registration(
                    obj, owner, state.inbox.append, key, destroy, args, kwargs, name
                )
            except BaseException:
                state.give_back(key, mark)  # refused: the key back, unless one was taken since
                raise
            state.store(reg)
            if then is not None:
                then()
            return reg
        finally:
            state.add_busy(-1)
            if registrar is not None:
                # Cleared first: a thread refused later must not name a thread
                # that has finished registering (and may have exited).
                self.registrar_ident = 0
            guard.release()

    def _refuse_duplicate(self, owner: Owner, obj: object) -> None:
        # Twice on one communicator is refused (one registration per object
        # and communicator, as before families). On two communicators of the
        # family (two layers of a program each managing what it owns on one
        # owner: a solver on the mesh's communicator, a Mat on PETSc's inner
        # duplicate of it) it is two keys, like any two registrations, both
        # queued when the object dies and destroyed newest first.
        for ref in _getweakrefs(obj):
            if (
                isinstance(ref, Registration)
                and self.live.get(ref.key) is ref
                and owned_by([ref], owner)
            ):
                raise RegistrationError(
                    f"this {type(obj).__name__!r} object is already registered on the "
                    f"{owner.describe()} as key {ref.key} ({ref.name!r}); register "
                    "one destroy that releases all it owns, or detach the first registration"
                )

    def _holder_or_acquire(self, registrar: threading.RLock) -> int:
        """The registrar is held by another thread: its ident, for the refusal.
        If the holder is only about to write it, or has just cleared it on its
        way out, look again for a moment; 0 if this thread got the registrar
        meanwhile (no other registration was in progress after all)."""
        for _ in range(50):
            holder = self.registrar_ident
            if holder:
                return holder
            time.sleep(0.001)
            if registrar.acquire(False):
                return 0
        return self.registrar_ident or -1

    def _refuse_thread(self, owner: Owner, holder: int) -> None:
        ident, name = self.named
        if holder != ident:
            main = threading.main_thread()  # (the fast path begins its intervals, unnamed)
            name = main.name if holder == main.ident else _thread_name(holder)
        raise RegistrationError(
            f"thread {threading.current_thread().name!r} tried to register an object "
            f"on the {owner.describe()} while thread {name!r} was "
            "registering objects on it or on a communicator congruent with it (since the "
            "last sync point): registration on a communicator of size > 1 is collective, "
            "and ranks would number objects registered from two threads between the "
            "same two sync points in different orders. Register from one thread, or run "
            "a sync point between the two threads' registrations."
        )

    def retire(
        self, reg: Registration, state: int
    ) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """An explicit destroy or detach: the state's claim (its key, if the
        object had died, is dropped by the next drain)."""
        return self.state.claim(reg, state)

    # -- the queue -------------------------------------------------------------

    def drain(self, seq: int) -> int:
        """Take the inbox into the pending keys; log the cyclic deaths among
        them and return how many. Only sync points drain (under their
        family's lock)."""
        found = self.state.drain(seq)
        if found:
            self.last_cyclic = [(r.typename, r.name, r.key, r.origin) for r in found]
            self.last_cyclic_at = seq
            self.cyclic_total += len(found)
            self.cyclic_log.extend(self.last_cyclic)
            if len(self.cyclic_log) > self.LOG:
                del self.cyclic_log[: len(self.cyclic_log) - self.LOG]
        return len(found)

    def cyclic_of_last(self) -> list[tuple[str, str, int, Any]]:
        """The cyclic deaths the last agreed sync point drained (it is
        counted once agreed: the one before ``seq``). Local."""
        return list(self.last_cyclic) if self.last_cyclic_at == self.state.seq - 1 else []

    def forget_owned(self, owner: Owner) -> list[Registration]:
        """Detach ``owner``'s registrations, without running them (a member
        lets go: Manager.close). Their keys may stay in the inbox or the
        pending keys: the next drain drops them. Returns what was live."""
        return self.state.forget(owner)

    def after_fork(self) -> list[Any]:
        """In a forked child: the parent's registrations are not ours. Fresh
        locks: one another thread held at the fork is never released there.
        Returns their calls, which the child keeps (see FamilyState.after_fork)."""
        self.lock = threading.RLock()
        if self.registrar is not None:
            self.registrar = threading.RLock()
        return self.state.after_fork()

    # -- reads that change nothing ---------------------------------------------

    def pending(self, seq: int, owner: Owner | None = None) -> list[Registration]:
        """Queued on this rank (drained or in the inbox), oldest key first;
        only ``owner``'s if given."""
        state = self.state
        live = state.live
        keys, ages = state.pending_keys()
        queued: dict[int, int] = dict(zip(_ints(keys), _ints(ages)))
        for reg in tuple(state.inbox):  # tuple() copies in C: appends cannot interleave
            if reg._state == ALIVE:
                queued.setdefault(reg.key, seq)
        out = []
        for key in sorted(queued):
            found = live.get(key)
            if found is not None and found.alive:
                note_queued(found, queued[key])
                out.append(found)
        return out if owner is None else owned_by(out, owner)

    def alive(self, owner: Owner | None = None) -> list[Registration]:
        """Registrations whose objects are still alive on this rank; only
        ``owner``'s if given."""
        regs = list(self.state.live.values())  # copied in C: no registration can interleave
        if owner is not None:
            regs = owned_by(regs, owner)
        return sorted((r for r in regs if r() is not None), key=_KEY_OF)

    def count(self, owner: Owner) -> int:
        """Registrations of ``owner`` whose destroy has not run."""
        return len(owned_by(list(self.state.live.values()), owner))

    def cyclic_pending(self) -> list[Registration]:
        """Cyclic-GC deaths in the inbox, not yet seen by a sync point."""
        return [r for r in tuple(self.state.inbox) if r.cyclic and r.alive]

    def is_empty(self) -> bool:
        """Whether nothing is left to destroy (keys still queued belong to
        registrations detached or destroyed since: nothing to agree on)."""
        return not self.state.live


def _ints(raw: bytes) -> list[int]:
    return memoryview(raw).cast("q").tolist() if raw else []


_DETACHED = DETACHED
