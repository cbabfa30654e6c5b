"""Registrations and the finalizer that only records.

A :class:`Registration` is itself the weak reference to the managed object (a
``weakref.ref`` subclass, like ``weakref.WeakMethod``), so one allocation carries
the key, the destroy call and the state. Its callback, :func:`_py_on_finalize` (or
the same function in C, from ``collective_gc._speedups``), is
the only code that runs when the object dies, on whatever thread and inside
whichever collector: it notes whether the cyclic collector is running on this
thread and pushes the registration onto its owner's inbox. It takes no lock,
makes no MPI call and runs no destroy, so it is safe at any point at which
Python can run a finalizer (including inside our own sync points).

The inbox is a ``list`` (collective managers) or a ``queue.SimpleQueue`` (the
rank-local reaper); both have an append/put that is atomic under the GIL and
safe to call re-entrantly from a finalizer.

A registration leaves the ALIVE state in one of two ways, both here: one at
a time through :meth:`Ledger.claim` (an explicit destroy or detach, the
rank-local reaper), or as an agreed batch through :func:`take_batch_py` or
its C twin (a sync point). Its private slots are touched nowhere else (and in
``collective_gc._speedups``, which mirrors this module).
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import threading
import traceback
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ._errors import RegistrationError
from ._switch import PURE_PYTHON, SPEEDUPS, speedups

__all__ = [
    "Registration",
    "Ledger",
    "make_registration",
    "check_destroy",
    "check_name",
    "take_batch_py",
    "track_origins",
    "shut_down",
    "set_shut_down",
    "after_fork",
    "speedups",
    "finalizer",
    "gc_hook_back",
    "new_registration_py",
    "construct",
    "plain_adder",
    "owned_by",
    "where",
    "SPEEDUPS",
    "PURE_PYTHON",
    "ALIVE",
    "DESTROYED",
    "DETACHED",
]

ALIVE = 0  # the destroy has not run: the object lives, or died and is queued
DESTROYED = 2  # the destroy has run (or is running)
DETACHED = 3  # detach() was called, or the owner was shut down or forked away

_STATE_NAMES = ("alive", "queued", "destroyed", "detached")

# Process-wide switches the finalizer reads. A list, bound as a default argument
# of the finalizer, so it still works while modules are torn down at exit.
# [0]: ident of the thread running the cyclic collector, or 0.
# [1]: nonzero once collective_gc has shut down (at exit) or in a forked child:
#      finalizers then do nothing at all.
_FLAGS: list[int] = [0, 0]

# How many collections the collector hook (_gc_phase) saw start.
_SEEN: list[int] = [0]

# Whether register() records a stack summary (set by collective_scope's
# track_origins, or by tests). Off by default: extracting a stack costs many
# times a registration.
TRACK_ORIGINS: list[bool] = [False]


def _gc_phase(
    phase: str, info: dict[str, Any], _flags: list[int] = _FLAGS, _seen: list[int] = _SEEN
) -> None:
    # The collector runs finalizers on the thread that started it, between its
    # "start" and "stop" callbacks; recording that thread lets a finalizer tell
    # a cyclic-GC death from a refcount death that happens on another thread
    # while the collector is paused between bytecodes.
    if phase == "start":
        _flags[0] = threading.get_ident()
        _seen[0] += 1
    else:
        _flags[0] = 0


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
_UNSEEN_BASE = [_collections() - _SEEN[0]]
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
    now = _collections() - _SEEN[0]
    lost = max(0, now - _UNSEEN_BASE[0])
    _UNSEEN_BASE[0] = max(now, _UNSEEN_BASE[0])
    return lost


def track_origins(on: bool | None = None) -> bool:
    """Whether new registrations record where they are made; ``on`` sets it.
    Returns the setting before the call."""
    was = TRACK_ORIGINS[0]
    if on is not None:
        TRACK_ORIGINS[0] = bool(on)
    return was


def shut_down() -> bool:
    """Whether finalizers are switched off (at exit, in a forked child)."""
    return bool(_FLAGS[1])


def set_shut_down(off: bool) -> None:
    """Switch every finalizer off (they then do nothing at all), or on again."""
    _FLAGS[1] = int(off)


def after_fork() -> None:
    """In a forked child: only this thread exists, and it is not collecting."""
    _FLAGS[0] = 0


class Owner(Protocol):
    """What a registration asks of whoever made it (a manager, the reaper)."""

    def destroy_registration(self, reg: Registration) -> None: ...
    def detach_registration(self, reg: Registration) -> bool: ...
    def describe(self) -> str: ...


def _py_on_finalize(
    reg: Registration,
    _flags: list[int] = _FLAGS,
    _ident: Callable[[], int] = threading.get_ident,
) -> None:
    # Only record and queue: see the module docstring. collective_gc._speedups
    # has the same function in C (a third of the cost per dropped object); keep
    # the two alike.
    if _flags[1] or reg._state:
        return  # shut down, or destroyed or detached already: nothing to queue
    if _flags[0] and _flags[0] == _ident():
        reg.cyclic = True  # the sync point that drains it reports it
    reg._push(reg)


# The one C/Python decision (collective_gc._switch): the C finalizer reads the
# same list of flags the Python one does, since they change at run time (the
# collector's thread, shut down).
if SPEEDUPS is not None:
    SPEEDUPS.set_flags(_FLAGS)


class Registration(weakref.ref):  # type: ignore[type-arg]
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

    __slots__ = (
        "key",
        "name",
        "origin",
        "cyclic",
        "queued_at",
        "_state",
        "_owner",
        "_push",
        "_destroy",
        "_args",
        "_typename",
    )

    key: int
    name: str
    origin: traceback.StackSummary | None
    cyclic: bool
    queued_at: int
    _state: int
    _owner: Owner
    _push: Callable[[Registration], object]
    # The destroy and its arguments (kwargs folded in with functools.partial),
    # None and () once it has run or was dropped. No tuple is made per
    # registration: args is the caller's own (usually the empty singleton), as
    # each allocation of a tracked object brings Python's collector nearer.
    _destroy: Callable[..., object] | None
    _args: tuple[Any, ...]
    _typename: str

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
        return self._owner.detach_registration(self)

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


if SPEEDUPS is not None:
    # Where the C code finds the slots, by name (an ImportError naming the
    # slot if this class and the built extension disagree).
    SPEEDUPS.set_registration_type(Registration)


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
    origin = _origin() if TRACK_ORIGINS[0] else None
    try:
        return _NEW(_ON_FINALIZE, obj, owner, push, key, destroy, args, name, origin)
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


def new_registration_py(
    callback: Callable[[Registration], None],
    obj: object,
    owner: Owner,
    push: Callable[[Registration], object],
    key: int,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    name: str | None,
    origin: traceback.StackSummary | None,
) -> Registration:
    """What ``_speedups.new_registration`` does, from Python (tests compare the two)."""
    # The C constructor of weakref.ref, then plain slot stores: no Python-level
    # __new__/__init__, since registration is on the hot path of every object.
    reg = Registration(obj, callback)
    typename = type(obj).__name__
    reg.key = key
    reg.name = typename if name is None else name
    reg._typename = typename
    reg.origin = origin
    reg.cyclic = False
    reg.queued_at = -1
    reg._state = ALIVE
    reg._owner = owner
    reg._push = push
    reg._destroy = destroy
    reg._args = args
    return reg


# The finalizer and the constructor every registration gets, bound once.
_ON_FINALIZE: Callable[[Registration], None] = (
    _py_on_finalize if SPEEDUPS is None else SPEEDUPS.on_finalize
)
_NEW: Callable[..., Registration] = (
    new_registration_py if SPEEDUPS is None else SPEEDUPS.new_registration
)

# ``construct(obj, owner, push, key, destroy, args, name, origin)``: the
# constructor with its finalizer bound (one C call where the extension is
# loaded); a registry calls it directly when there are no keyword arguments to
# fold in and no origin to record. TypeError if obj cannot be weakly referenced.
construct: Callable[..., Registration] = functools.partial(_NEW, _ON_FINALIZE)


def plain_adder(
    registry_type: type, python: Callable[..., Registration | None]
) -> Callable[..., Registration | None]:
    """``add(registry, owner, tag, obj, destroy, args, name)``: a registration
    made and stored in one C call in the common case (see
    ``_speedups.add_plain``), or ``python``, its twin, without the
    extension. An ImportError naming the slot if ``registry_type`` lacks
    one that the C code stores into."""
    if SPEEDUPS is None:
        return python
    # TRACK_ORIGINS is a list because it changes at run time (collective_scope,
    # the pytest plugin): add_plain reads it per call. The finalizer does not.
    SPEEDUPS.set_registry_type(registry_type, TRACK_ORIGINS, _ON_FINALIZE)
    add: Callable[..., Registration | None] = SPEEDUPS.add_plain
    return add


def where(reg: Registration) -> str:
    """The communicator ``reg`` was made on, in words (for messages)."""
    try:
        return reg._owner.describe()
    except ReferenceError:  # its owner is gone (a forked child's old reaper)
        return "an owner that is gone"


def owned_by(regs: list[Registration], owner: Owner) -> list[Registration]:
    """Those of ``regs`` made on ``owner`` (by identity: a manager's proxy)."""
    return [r for r in regs if r._owner is owner]


def finalizer() -> Callable[[Registration], None]:
    """The finalizer every registration gets (for tests that build registrations)."""
    return _ON_FINALIZE


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

    __slots__ = ("live", "lock")

    def __init__(self) -> None:
        self.live: dict[int, Registration] = {}
        self.lock = threading.RLock()

    def claim(
        self, reg: Registration, state: int
    ) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """Move ``reg`` from ALIVE to ``state`` (DESTROYED or DETACHED), once.

        Returns its destroy call, now taken out of the registration (so that
        it lets go of the destroyed resources), or None if it had left ALIVE
        already: a destroy runs at most once however threads interleave.
        """
        with self.lock:
            if reg._state != ALIVE:
                return None
            reg._state = state
            self.live.pop(reg.key, None)
            fn, args = reg._destroy, reg._args
            reg._destroy, reg._args = None, ()
        assert fn is not None
        return fn, args

    def after_fork(self) -> list[Registration]:
        """In a forked child: a fresh lock (one that another thread held at the
        fork is never released there), then :meth:`forget`."""
        self.lock = threading.RLock()
        return self.forget()

    def forget(self) -> list[Registration]:
        """Detach everything without running it (a forked child). Returns what was live."""
        with self.lock:
            regs = list(self.live.values())
            for reg in regs:
                reg._state = DETACHED
                reg._destroy, reg._args = None, ()
            self.live.clear()
        return regs


_Taken = tuple[
    list[Registration],
    list[Callable[..., object]],
    list[tuple[Any, ...]],
    "list[tuple[int, int, int]] | None",
]


def take_batch_py(
    regs: dict[int, Registration], keys: list[int], state: int, batched: tuple[object, ...]
) -> _Taken:
    """What ``_speedups.take_batch`` does, from Python (tests compare the two).

    For each key still in ``regs``, in order: pop it, set its state, take its
    destroy call out. A key whose registration is gone, or has no destroy
    left, was destroyed or detached explicitly meanwhile, on every rank, and
    is skipped. Also returns the runs of consecutive calls to the same
    batched destroy (``batched``, by identity) as (start, end, index)
    triples, index -1 for a run of other destroys.
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
    ids = [id(f) for f in batched]
    segments: list[tuple[int, int, int]] = []
    start = 0
    for index, group in itertools.groupby(ids.index(id(f)) if id(f) in ids else -1 for f in fns):
        end = start + sum(1 for _ in group)
        segments.append((start, end, index))
        start = end
    return taken, fns, argss, segments
