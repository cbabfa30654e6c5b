"""Registrations: the finalizer that only records, and the checks of a destroy.

A :class:`Registration` is itself the weak reference to the managed object (a
``weakref.ref`` subclass, like ``weakref.WeakMethod``), so one allocation carries
the key, the destroy call and the state; its fields are
:class:`collective_gc._state.RegistrationFields` (declared in C where the
extension is built). Its callback, :meth:`GcState.finalize
<collective_gc._state.GcState.finalize>` of the process's :data:`GC`, is the
only code that runs when the object dies, on whatever thread and inside
whichever collector: it notes whether the cyclic collector is running on this
thread and pushes the registration onto its owner's inbox. It takes no lock,
makes no MPI call and runs no destroy, so it is safe at any point at which
Python can run a finalizer (including inside our own sync points).

The inbox is a ``list`` (a family's) or a ``queue.SimpleQueue`` (the
rank-local reaper); both have an append/put that is atomic under the GIL and
safe to call re-entrantly from a finalizer. A registration leaves the alive
state through its family's state (an explicit destroy or detach, a sync
point's agreed batch) or, rank-local, through a :class:`Ledger`.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any, Protocol

from ._errors import RegistrationError
from ._state import (
    ALIVE,
    DESTROYED,
    DETACHED,
    GcState,
    RegistrationFields,
    new_registration,
    take_call,
)
from ._switch import PURE_PYTHON, SPEEDUPS, speedups

__all__ = [
    "Registration",
    "Ledger",
    "GC",
    "make_registration",
    "check_destroy",
    "check_name",
    "track_origins",
    "shut_down",
    "set_shut_down",
    "after_fork",
    "speedups",
    "gc_hook_back",
    "owned_by",
    "where",
    "SPEEDUPS",
    "PURE_PYTHON",
    "ALIVE",
    "DESTROYED",
    "DETACHED",
]

_STATE_NAMES = ("alive", "queued", "destroyed", "detached")

# The process's collector state, which every finalizer reads: the thread
# running the cyclic collector (its hook in gc.callbacks), whether finalizers
# are switched off (at exit, in a forked child), whether registrations record
# where they were made (collective_scope's track_origins, the pytest plugin).
GC = GcState(threading.main_thread().ident or 0)
_gc_phase = GC.phase

# The hook lives in a list the program owns: anyone may clear gc.callbacks, or
# assign it a new content (``gc.callbacks[:] = [mine]``, as a test framework
# may), and from then on no death is seen as cyclic. Nothing else in CPython
# 3.11-3.13 tells a finalizer that the cyclic collector runs (gc.isenabled()
# is as it was; gc.get_count() reads during a collection as right after one,
# (0, n, m), which a refcount death can see too), so the hook is put back
# where it matters (:func:`gc_hook_back`: a scope's entry and each of its sync
# points), and what was lost meanwhile is counted: gc.get_stats() counts every
# collection, the hook those it saw start, and while the hook is in place the
# two move together.
#
# The list the collector calls is the one gc.callbacks was at import:
# rebinding the module attribute (gc.callbacks = [...]) changes nothing the
# collector does, so that list is the one checked.
_CALLBACKS = gc.callbacks


def _collections() -> int:
    return sum(s["collections"] for s in gc.get_stats())


# Collections that ran without the hook: (all collections) - (those it saw),
# as of the last time it was put in place.
_UNSEEN_BASE = [_collections() - GC.seen]
_CALLBACKS.append(_gc_phase)


def gc_hook_back() -> int:
    """Put the collector hook back in ``gc.callbacks`` if the program took it
    out; return how many collections ran without it since it was last put
    back (their finalizations of managed objects were not seen as cyclic).
    0 when it is in place: a membership test."""
    if _gc_phase in _CALLBACKS:
        return 0
    _CALLBACKS.append(_gc_phase)
    # A collection under way (this called from one of its finalizers) is
    # counted by gc.get_stats() only once it ends: it is not counted as lost.
    now = _collections() - GC.seen
    lost = max(0, now - _UNSEEN_BASE[0])
    _UNSEEN_BASE[0] = max(now, _UNSEEN_BASE[0])
    return lost


def track_origins(on: bool | None = None) -> bool:
    """Whether new registrations record where they are made. ``on`` True
    asks them to, False takes back one such ask (paired: they record while
    any ask stands). Returns whether they did before the call."""
    return GC.origins > 0 if on is None else GC.track(on)


def shut_down() -> bool:
    """Whether finalizers are switched off (at exit, in a forked child)."""
    return bool(GC.off)


def set_shut_down(off: bool) -> None:
    """Switch every finalizer off (they then do nothing at all), or on again."""
    GC.switch_off(off)


def after_fork() -> None:
    """In a forked child: only this thread exists, and it is not collecting."""
    GC.forked()


class Owner(Protocol):
    """What a registration asks of whoever made it (a manager, the reaper)."""

    def destroy_registration(self, reg: Registration) -> None: ...
    def detach_registration(self, reg: Registration) -> bool: ...
    def describe(self) -> str: ...


class Registration(RegistrationFields):
    """A managed object's destroy request, created by :func:`collective_gc.register`.

    It holds a weak reference to the object, never a strong one, and nothing
    refers back to it from the object, so it can join no reference cycle.

    Attributes:
        key: the registration's key, the same on every rank of the communicator
            (a per-communicator creation counter); rank-local registrations have
            keys of their own.
        name: the name given at registration, or the object's type name.
        origin: where it was registered (with origin tracking on), else None.
        cyclic: whether the cyclic collector finalized its object.
        queued_at: the sync point that took its destroy request in, or -1.
    """

    __slots__ = ()

    @property
    def alive(self) -> bool:
        """True until the destroy has run or the registration was detached."""
        return self._state < DESTROYED

    @property
    def state(self) -> str:
        """One of ``"alive"``, ``"queued"``, ``"destroyed"``, ``"detached"``."""
        if self._state == ALIVE and self() is None:
            return "queued"  # dead, in the inbox, not yet drained
        return _STATE_NAMES[self._state]

    @property
    def typename(self) -> str:
        """The type name of the registered object."""
        return self._typename

    def destroy(self) -> None:
        """Run the destroy now, if it has not run yet; later finalization does nothing.

        Collective for a registration on a communicator of size > 1: call it on
        every rank, in the same order relative to other collectives, as you would
        the destroy itself. It runs locally and immediately, with no agreement,
        and an exception from the destroy propagates on the calling rank only.
        Idempotent: a second call, or a call after the destroy ran at a sync point,
        does nothing.
        """
        if self._state == ALIVE:  # else its owner may be gone (a forked child's)
            self._owner.destroy_registration(self)

    def detach(self) -> bool:
        """Cancel the registration without running the destroy.

        Returns True if it was alive or queued (and is now detached), False if
        its destroy had already run or it was already detached. Local: the
        destroy is never run on this rank, so detach on every rank or none.
        """
        if self._state != ALIVE:
            return False
        return bool(self._owner.detach_registration(self))

    def __repr__(self) -> str:
        try:
            where = self._owner.describe()
        except ReferenceError:  # its owner is gone (a forked child's old reaper)
            where = "an owner that is gone"
        return (
            f"<collective_gc.Registration key={self.key} name={self.name!r} "
            f"{self.state} on {where}>"
        )

    # Registrations compare and hash by identity: weakref.ref's own __eq__ and
    # __hash__ would compare and hash the referents.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


def make_registration(
    obj: object,
    owner: Owner,
    push: Callable[[Registration], object],
    key: int,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str | None,
) -> Registration:
    """Create a registration (the weak reference to ``obj``) in the ALIVE state."""
    if kwargs:
        destroy = functools.partial(destroy, **kwargs)
    origin = _origin() if GC.origins else None
    try:
        reg: Registration = new_registration(
            Registration, GC.finalize, obj, owner, push, key, destroy, args, name, origin
        )
        return reg
    except TypeError:
        if not isinstance(args, tuple):
            raise
        raise RegistrationError(
            f"cannot register {type(obj).__name__!r} object: it cannot be weakly "
            "referenced (give its class a __weakref__ slot, or register a small "
            "weak-referenceable owner object instead)"
        ) from None


_HERE = os.path.dirname(__file__)


def _origin() -> traceback.StackSummary:
    # The caller's frames: this package's own (however deep the registration
    # path is) are left out.
    frames = traceback.extract_stack(limit=24)
    while frames and frames[-1].filename.startswith(_HERE):
        frames.pop()
    return traceback.StackSummary.from_list(frames[-12:])


def where(reg: Registration) -> str:
    """The communicator ``reg`` was made on, in words (for messages)."""
    try:
        return str(reg._owner.describe())
    except ReferenceError:  # its owner is gone (a forked child's old reaper)
        return "an owner that is gone"


def owned_by(regs: list[Registration], owner: Owner) -> list[Registration]:
    """Those of ``regs`` made on ``owner`` (by identity: a manager's proxy)."""
    return [r for r in regs if r._owner is owner]


_METHOD_TYPES = (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)


def _refers_to(value: object, obj: object) -> bool:
    # Dispatch on the exact type first: getattr() with a default on a missing
    # attribute costs an exception internally, and this runs per registration.
    if value is obj:
        return True
    tp = type(value)
    if tp is types.FunctionType:
        cells = value.__closure__  # type: ignore[attr-defined]
        return bool(cells) and any(_cell_is(c, obj) for c in cells)
    if tp in _METHOD_TYPES:
        return value.__self__ is obj  # type: ignore[attr-defined]
    if isinstance(value, functools.partial):
        return (
            _refers_to(value.func, obj)
            or any(a is obj for a in value.args)
            or any(v is obj for v in value.keywords.values())
        )
    return False


def _cell_is(cell: Any, obj: object) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def check_name(name: object) -> None:
    """Refuse a ``name`` that is not a str (or None): sync points send names
    to the other ranks in their error reports, so it must pickle."""
    if name is not None and not isinstance(name, str):
        raise RegistrationError(f"name must be a str or None, not {type(name).__name__!r}")


def check_destroy(
    obj: object, destroy: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse a destroy that is not callable, or that would keep ``obj`` alive.

    Shallow on purpose (the object itself, a bound method of it, a partial or a
    closure over it): it runs at every registration.
    """
    if type(destroy) is types.FunctionType and not destroy.__closure__ and not args and not kwargs:
        return  # the common case: a plain function, nothing to check
    if not callable(destroy):
        raise RegistrationError(
            f"destroy must be callable, got {type(destroy).__name__!r} object {destroy!r}"
        )
    if _refers_to(destroy, obj):
        raise RegistrationError(
            f"the destroy {destroy!r} refers to the registered {type(obj).__name__!r} "
            "object itself, so the registration would keep it alive forever; pass the "
            "resource it owns instead (e.g. register(self, self.ksp.destroy) is fine, "
            "register(self, self.close) is not)"
        )
    for i, arg in enumerate(args):
        if _refers_to(arg, obj):
            raise RegistrationError(
                f"argument {i} of the destroy refers to the registered "
                f"{type(obj).__name__!r} object itself, so the registration would keep "
                "it alive forever; pass the resource it owns instead"
            )
    for k, arg in kwargs.items():
        if _refers_to(arg, obj):
            raise RegistrationError(
                f"keyword argument {k!r} of the destroy refers to the registered "
                f"{type(obj).__name__!r} object itself, so the registration would keep "
                "it alive forever; pass the resource it owns instead"
            )


class Ledger:
    """The registrations of one owner whose destroy has not run, by key.

    ``live`` is a plain dict: its single operations are atomic under the GIL,
    so a reader may copy it at any time; ``lock`` is held for the few stores
    of a state change, never across a destroy or an MPI call (so a
    registration on another thread never waits for a sync point's destroys).
    Re-entrant: an allocation inside it may start the collector, whose
    finalizers may destroy or detach on this very thread.
    """

    __slots__ = ("live", "lock", "released")

    def __init__(self) -> None:
        self.live: dict[int, Registration] = {}
        self.lock = threading.RLock()
        # The keys of live registrations whose calls a forked child lets go
        # of, where it keeps every other's (see after_fork).
        self.released: set[int] = set()

    def claim(
        self, reg: Registration, state: int
    ) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """Move ``reg`` from ALIVE to ``state`` (DESTROYED or DETACHED), once.

        Returns its destroy call, now taken out of the registration (so that
        it lets go of the destroyed resources), or None if it had left ALIVE
        already: a destroy runs at most once however threads interleave.
        """
        with self.lock:
            call = take_call(reg, state, self.live)
            # (After: a fork between the two, on another thread, would find
            # the registration live but no longer released.)
            self.released.discard(reg.key)
            return call

    def after_fork(self) -> list[tuple[Callable[..., object], tuple[Any, ...]]]:
        """In a forked child: a fresh lock (one that another thread held at the
        fork is never released there), then everything detached without
        running it. Returns the calls taken out, which the child keeps: they
        hold the parent's resources (see collective_gc._exit). Save those of
        the keys in ``released``, let go of here: their resources are the
        child's own copies, which it must release (the loader's segments)."""
        self.lock = threading.RLock()
        kept: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        with self.lock:
            for reg in list(self.live.values()):
                call = take_call(reg, DETACHED, self.live)
                if call is not None and reg.key not in self.released:
                    kept.append(call)
            self.live.clear()
            self.released.clear()
        return kept
