"""The registrations of one family of congruent communicators: keys, the
inbox, the pending keys.

Keys come from a per-family counter: registration is collective over the
communicator it is made on, which has the family's processes in the same
order, so every rank gives the same object the same key. Registrations on
the family's other communicators (its members) are numbered by the same
counter; a member's registrations also add to an order fingerprint
(``order``), so that ranks that registered on two members in different
orders (the same count, different objects under one key) are told apart by
the agreement. A dead object's finalizer
appends its registration to the inbox (a list: ``append`` is atomic and safe
inside a finalizer); only a sync point drains the inbox into the pending
keys, so what a sync point sees never depends on a diagnostic having run
before it. Everything else here is a read that changes nothing.
"""

from __future__ import annotations

import operator
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _registration
from ._errors import RegistrationError
from ._registration import (
    DETACHED,
    Ledger,
    Owner,
    Registration,
    check_destroy,
    construct,
    make_registration,
    owned_by,
    plain_adder,
)
from ._switch import SPEEDUPS

__all__ = ["Registry", "NO_KEYS", "add_plain", "add_plain_py", "order_step", "keys_of"]

NO_KEYS = np.empty(0, dtype=np.int64)
_KEY_OF = operator.attrgetter("key")
_FUNCTION = types.FunctionType
_get_ident = threading.get_ident
_getweakrefs = weakref.getweakrefs
_CYCLIC_OF = operator.attrgetter("cyclic")


def keys_of(batch: list[Registration]) -> tuple[np.ndarray[Any, Any], bool]:
    """The keys of ``batch``, ascending, and whether any of them died in the
    cyclic collector."""
    if SPEEDUPS is not None:
        try:
            raw, cyclic, ascending = SPEEDUPS.keys_of(batch)
        except TypeError:
            pass  # not all exact Registrations: read them one by one
        else:
            keys = np.frombuffer(raw, np.int64)
            if not ascending:
                keys.sort(kind="stable")  # finds the runs finalizers queue
            return keys, cyclic
    keys = np.fromiter(map(_KEY_OF, batch), np.int64, len(batch))
    keys.sort(kind="stable")
    return keys, any(map(_CYCLIC_OF, batch))


def _thread_name(ident: int) -> str:
    # Only for error messages: the registrar records the cheap ident.
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return f"(thread {ident})"


def order_step(key: int, tag: int) -> int:
    """What a registration with ``key`` on the member tagged ``tag`` adds to
    the order fingerprint (mod 2**64): nothing on the family's first member
    (tag 0), so a family of one communicator never pays for it. A hash of
    both (splitmix64's finalizer), so that sums of these differ, but for a
    chance of about 2**-64, when some key went to different members."""
    if not tag:
        return 0
    x = (key * _GOLDEN + tag) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class Registry(Ledger):
    """Registrations of one family, from registration to agreed destroy."""

    __slots__ = (
        "label",
        "next_key",
        "order",
        "inbox",
        "pend",
        "pend_seq",
        "stale",
        "registrar",
        "registrar_ident",
        "busy",
        "thread",
        "thread_name",
        "push",
        "cyclic_total",
        "last_cyclic",
        "cyclic_log",
    )

    # How many cyclic deaths the log keeps (the oldest go first).
    LOG = 10_000

    def __init__(self, label: str, parallel: bool) -> None:
        super().__init__()
        self.label = label  # the family, in messages
        self.next_key = 0
        # The registrations' order over the family's members (see order_step),
        # an unsigned 64-bit value; agreed for equality at every sync point.
        self.order = 0
        self.inbox: list[Registration] = []
        # Every registration's finalizer appends to the inbox (one bound
        # method for all of them).
        self.push = self.inbox.append
        # Keys drained and not yet destroyed, ascending, with the sync point
        # at which each was drained (its age, for view).
        self.pend = NO_KEYS
        self.pend_seq = NO_KEYS
        # Set when an explicit destroy or detach may have left a dead key in
        # the inbox or the pending keys: the next drain filters them.
        self.stale = False
        # On a family of size > 1, held by the thread that is registering:
        # two threads registering at once would number objects in an order
        # that may differ between ranks, so the second one is refused, never
        # made to wait.
        self.registrar: threading.RLock | None = threading.RLock() if parallel else None
        self.registrar_ident = 0
        # How many registrations are between taking their key and storing the
        # next one in add (under its guard): add_plain, which takes no guard,
        # leaves the registry to them while it is not 0.
        self.busy = 0
        # On a family of size > 1, the ident of the one thread that has
        # registered since the last sync point (0: none yet). Two threads
        # registering between the same two sync points would be numbered in
        # an order that may differ between ranks even when their calls never
        # overlap (add_plain's never do), so the second is refused. -1: any
        # thread may register (the keys of a family of size 1 are local).
        self.thread = 0 if parallel else -1
        self.thread_name = ""  # its name, for a refusal (it may have exited since)
        self.cyclic_total = 0
        # (type, name, key, origin) of the cyclic deaths the last drain found,
        # and of the last LOG ones found by any drain (cyclic_total - len of
        # it is the ordinal of its first entry).
        self.last_cyclic: list[tuple[str, str, int, Any]] = []
        self.cyclic_log: list[tuple[str, str, int, Any]] = []

    # -- registration ----------------------------------------------------------

    def add(
        self,
        owner: Owner,
        tag: int,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        then: Callable[[], object] | None = None,
    ) -> Registration:
        """Give ``obj`` the next key, as a registration of ``owner`` (the
        member tagged ``tag``), then call ``then`` (if given) while still the
        only registering thread. Local; the caller makes it collective."""
        if args or kwargs or type(destroy) is not _FUNCTION or destroy.__closure__:
            check_destroy(obj, destroy, args, kwargs)  # else a plain function: nothing to check
        registrar = self.registrar
        if registrar is None:
            # Any thread may register: the key is taken and the registration
            # stored under the lock (re-entrant: a finalizer run by an
            # allocation here may register on this very thread).
            guard = self.lock
            guard.acquire()
        else:
            # One registering thread at a time: the registrar, never waited for.
            if not registrar.acquire(False):
                holder = self._holder_or_acquire(registrar)
                if holder:
                    self._refuse_thread(owner, holder)
            me = _get_ident()
            interval = self.thread
            if interval != me:
                if interval:
                    registrar.release()
                    self._refuse_thread(owner, interval)
                # The first registration since the last sync point (add_plain
                # leaves it to this one): this thread is the interval's.
                self.thread_name = threading.current_thread().name
                self.thread = me
            self.registrar_ident = me
            guard = registrar
        self.busy += 1
        try:
            if _getweakrefs(obj):
                self._refuse_duplicate(owner, obj)
            # The key is taken and the next one stored with no call in
            # between: making the registration allocates, and a collection
            # may run before this thread stores anything more (CPython 3.12
            # runs a scheduled one when a C call returns), whose finalizers
            # may register on this very thread (the lock is re-entrant) and
            # must get keys of their own.
            key = self.next_key
            self.next_key = key + 1
            try:
                reg = None
                if not kwargs and not _registration.TRACK_ORIGINS[0]:
                    try:  # the common case in one C call
                        reg = construct(obj, owner, self.push, key, destroy, args, name, None)
                    except TypeError:
                        pass  # make_registration below says why
                if reg is None:
                    reg = make_registration(obj, owner, self.push, key, destroy, args, kwargs, name)
            except BaseException:
                if self.next_key == key + 1:
                    self.next_key = key  # refused: the key back, unless one was taken since
                raise
            if tag:
                self.order = (self.order + order_step(key, tag)) & _MASK64
            self.live[key] = reg
            if then is not None:
                then()
            return reg
        finally:
            self.busy -= 1
            if registrar is not None:
                # Cleared first: a thread refused later must not name a thread
                # that has finished registering (and may have exited).
                self.registrar_ident = 0
            guard.release()

    def _refuse_duplicate(self, owner: Owner, obj: object) -> None:
        for ref in _getweakrefs(obj):
            if isinstance(ref, Registration) and self.live.get(ref.key) is ref:
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
        name = self.thread_name if holder == self.thread else _thread_name(holder)
        raise RegistrationError(
            f"thread {threading.current_thread().name!r} tried to register an object "
            f"on the {owner.describe()} while thread {name!r} was "
            "registering objects on it or on a communicator congruent with it (since the "
            "last sync point): registration on a communicator of size > 1 is collective, "
            "and ranks would number objects registered from two threads between the "
            "same two sync points in different orders. Register from one thread, or run "
            "a sync point between the two threads' registrations."
        )

    def new_interval(self) -> None:
        """A sync point was agreed: the next registration may come from any
        one thread (see ``thread``)."""
        if self.thread > 0:
            self.thread = 0

    def retire(
        self, reg: Registration, state: int
    ) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """An explicit destroy or detach: :meth:`Ledger.claim`, and mark the
        queue stale if the object had died (its key may be queued)."""
        call = self.claim(reg, state)
        if call is not None and reg() is None:
            self.stale = True
        return call

    # -- the queue -------------------------------------------------------------

    def drain(self, seq: int) -> int:
        """Take the inbox into the pending keys; return the cyclic deaths among them.

        Only sync points drain (under their manager's lock).
        """
        if self.last_cyclic:
            self.last_cyclic = []
        inbox = self.inbox
        n = len(inbox)
        if not n and not self.stale:
            return 0
        batch = inbox[:n]
        del inbox[:n]  # one C call: appends racing with it land after the slice
        cyclic = 0
        new, any_cyclic = keys_of(batch)
        if any_cyclic:
            for reg in batch:
                if reg.cyclic and reg.alive:
                    cyclic += 1
                    self.last_cyclic.append((reg.typename, reg.name, reg.key, reg.origin))
            self.cyclic_total += cyclic
            self.cyclic_log.extend(self.last_cyclic)
            if len(self.cyclic_log) > self.LOG:
                del self.cyclic_log[: len(self.cyclic_log) - self.LOG]
        if self.stale:
            # Rare: explicit destroys or detaches of dead objects since the last
            # drain. Drop their keys, wherever they are.
            self.stale = False
            batch = [r for r in batch if r.alive]
            new = keys_of(batch)[0]
            live = self.live
            keep = np.fromiter((k in live for k in self.pend.tolist()), bool, self.pend.size)
            self.pend, self.pend_seq = self.pend[keep], self.pend_seq[keep]
        if batch:
            if self.pend.size:
                pend = np.concatenate((self.pend, new))
                ages = np.concatenate((self.pend_seq, np.full(new.size, seq)))
                order = np.argsort(pend, kind="stable")
                self.pend, self.pend_seq = pend[order], ages[order]
            else:
                self.pend, self.pend_seq = new, np.full(new.size, seq)
        return cyclic

    def remove_pending(self, keys: np.ndarray[Any, Any]) -> None:
        """Agreed keys leave the pending keys (before any destroy runs)."""
        pend = self.pend
        if not pend.size:
            return  # the C steady state's: drained and agreed at once, never stored
        if keys.size == pend.size:  # agreed keys are a subset of the pending ones
            self.pend = self.pend_seq = NO_KEYS
        else:
            keep = ~np.isin(pend, keys, assume_unique=True)
            self.pend, self.pend_seq = pend[keep], self.pend_seq[keep]

    def forget_all(self) -> None:
        """Detach every registration, without running them (the family lets go)."""
        self.forget()
        self.inbox.clear()
        self.pend = self.pend_seq = NO_KEYS

    def forget_owned(self, owner: Owner) -> list[Registration]:
        """Detach ``owner``'s registrations, without running them (a member
        lets go: Manager.close). Their keys may stay in the inbox or the
        pending keys: the next drain drops them. Returns what was live."""
        with self.lock:
            regs = owned_by(list(self.live.values()), owner)
            for reg in regs:
                self.claim(reg, DETACHED)
            if regs:
                self.stale = True
        return regs

    def after_fork(self) -> list[Registration]:
        """In a forked child: the parent's registrations are not ours. Fresh
        locks: one another thread held at the fork is never released there."""
        if self.registrar is not None:
            self.registrar = threading.RLock()
            self.thread = 0
        regs = Ledger.after_fork(self)
        self.inbox.clear()
        self.pend = self.pend_seq = NO_KEYS
        return regs

    # -- reads that change nothing ---------------------------------------------

    def pending(self, seq: int, owner: Owner | None = None) -> list[Registration]:
        """Queued on this rank (drained or in the inbox), oldest key first;
        only ``owner``'s if given."""
        live = self.live
        queued: dict[int, int] = dict(zip(self.pend.tolist(), self.pend_seq.tolist()))
        for reg in tuple(self.inbox):  # tuple() copies in C: appends cannot interleave
            if reg.alive:
                queued.setdefault(reg.key, seq)
        out = []
        for key in sorted(queued):
            found = live.get(key)
            if found is not None and found.alive:
                found.queued_at = queued[key]
                out.append(found)
        return out if owner is None else owned_by(out, owner)

    def alive(self, owner: Owner | None = None) -> list[Registration]:
        """Registrations whose objects are still alive on this rank; only
        ``owner``'s if given."""
        regs = list(self.live.values())  # copied in C: no registration can interleave
        if owner is not None:
            regs = owned_by(regs, owner)
        return sorted((r for r in regs if r() is not None), key=_KEY_OF)

    def count(self, owner: Owner) -> int:
        """Registrations of ``owner`` whose destroy has not run."""
        return len(owned_by(list(self.live.values()), owner))

    def cyclic_pending(self) -> list[Registration]:
        """Cyclic-GC deaths in the inbox, not yet seen by a sync point."""
        return [r for r in tuple(self.inbox) if r.cyclic and r.alive]

    def is_empty(self) -> bool:
        """Whether nothing is left to destroy (keys still queued belong to
        registrations detached or destroyed since: nothing to agree on)."""
        return not self.live


def add_plain_py(
    registry: Registry,
    owner: Owner,
    tag: int,
    obj: object,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    name: str | None,
) -> Registration | None:
    """What ``_speedups.add_plain`` does, from Python: :meth:`Registry.add`'s
    common case (a plain function without a closure as the destroy,
    arguments that are not ``obj`` and not callable, no origin to record,
    ``obj`` with no other weak reference, no other registration half-way
    through, this thread the one that registers since the last sync point),
    or None having changed nothing, for :meth:`Registry.add` to do it (or to
    say what is wrong). No guard is taken: the registration is made first
    (an allocation may start the collector, whose finalizers may register on
    this thread), and from reading the key to storing the next one no
    Python code of anyone else can run on this registry: another thread
    that registers is refused by :meth:`Registry.add`, never given a key.
    Unlike the C version it leaves a family of size 1 (any thread may
    register) to :meth:`Registry.add`'s lock, since Python can switch
    threads between any two of its steps."""
    if (
        _registration.TRACK_ORIGINS[0]
        or type(destroy) is not _FUNCTION
        or destroy.__closure__ is not None
        or type(args) is not tuple
        or not (name is None or type(name) is str)
    ):
        return None
    for a in args:
        if a is obj or callable(a):
            return None
    try:
        reg = construct(obj, owner, registry.push, -1, destroy, args, name, None)
    except TypeError:
        return None  # not weakly referenceable: Registry.add says so
    if len(_getweakrefs(obj)) != 1 or registry.busy or registry.thread != _get_ident():
        return None  # dropped here: its callback never runs
    key = registry.next_key
    reg.key = key
    registry.live[key] = reg
    registry.next_key = key + 1
    if tag:
        registry.order = (registry.order + order_step(key, tag)) & _MASK64
    return reg


# add_plain(registry, owner, tag, obj, destroy, args, name): Registry.add's
# common case in one call, or None (see add_plain_py, and _registration.plain_adder).
add_plain = plain_adder(Registry, add_plain_py)
