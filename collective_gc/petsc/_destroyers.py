"""The destroys of managed PETSc objects: one at a time from Python, or a run in C.

``destroy_one`` and ``destroy_many`` are the destroy calls of
``collective_gc.petsc.manage``'s registrations; ``destroy_all`` is the public
explicit one. A destroy that raised leaves a wreck that is leaked, never
destroyed again (:func:`_forget`), and is counted in the communicator's
:class:`CommState` (the cleanup participant's vote says so to every rank).
Before a parallel object is destroyed, its PETSc inner communicator is held
(:meth:`CommState.hold`, see the NOTE there).
``NATIVE`` (collective_gc._speedups.Petsc, given the addresses of petsc4py's
and PETSc's C functions) destroys a sync point's run of managed
registrations at once, from C, with the same outcome.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc

from .._destroy import set_batch
from .._state import LOOK
from .._switch import SPEEDUPS
from . import _internals


class CommState:
    """This rank's record of the PETSc objects managed on one family.

    ``failed`` counts this rank's managed PETSc destroys that raised (the
    wrecks are leaked, see :func:`_forget`; :meth:`failure` and
    :meth:`forgive` are its writers, as the methods are of every field);
    ``holds`` maps the handle of each PETSc inner communicator held (see the
    NOTE) to the clock of the vote that first saw it; :meth:`vote` is the
    cleanup participant's vote, which the steady state calls as it is
    (:func:`comm_state` makes the C twin, collective_gc._speedups.CommState,
    where :data:`NATIVE` is).

    NOTE [ A failed PETSc destroy and PETSc's inner communicator ]
    A parallel PETSc object lives on PETSc's inner duplicate of its
    communicator, which PETSc frees with the last object on it. When a
    destroy raises on one rank only, the wreck keeps the inner communicator
    there while the other ranks free theirs; the program's next PETSc call
    on the communicator then makes a new inner one (MPI_Comm_dup) on those
    ranks and not on that one: a hang, before the family's next agreement
    could say what failed. One more collective after every sync point that
    destroys PETSc objects would tell at once, at a price every clean step
    pays. Instead, the reference the destroys would drop is taken first
    (PetscCommDuplicate of the inner communicator: a counter, no MPI), at
    the same agreed point on every rank, so the inner communicator survives
    every rank's destroys alike and PETSc's state cannot differ between
    the ranks before the next sync point. That one's agreement carries the
    failure (the cleanup participant's vote) and refuses the family on every
    rank, which keeps its holds for good. Otherwise a hold is dropped
    (PetscCommDestroy, at a vote of the family's own sync point: every rank
    at once; a parent's look, which some ranks take and others answer
    before, drops nothing) once two later votes have passed with no
    failure. A run of destroys on the same inner communicator at every step
    keeps its hold and takes no other.
    """

    __slots__ = ("failed", "holds", "members", "parallel", "stale")

    def __init__(self, parallel: bool) -> None:
        self.failed = 0
        # handle -> the clock of the first vote that saw it held (UNSEEN
        # until then: a hold is aged by votes, not by when it was taken).
        self.holds: dict[int, int] = {}
        # The handles of the family's installed communicators still in use
        # (set_members); False: serial objects, nothing to hold or vote on.
        self.members: tuple[int, ...] = ()
        self.parallel = parallel
        # A hold was dropped on a member: PETSc may have freed it (see vote).
        self.stale = False

    def failure(self) -> None:
        """Count a managed PETSc destroy (or a cleanup) that raised here:
        the next vote says so. Local."""
        self.failed += 1

    def forgive(self) -> None:
        """Forget the failures counted: on a family of one rank, where
        nothing can differ between ranks. Local."""
        self.failed = 0

    def set_members(self, handles: tuple[int, ...]) -> None:
        """The communicators the vote looks at for garbage. Set by the
        cleanup participant's Python vote, which runs at the first sync
        point after any of them is freed (a freed member's family holds
        HOLD_LEAVING until then, so no steady sync point votes before it)."""
        self.members = tuple(handles)
        self.stale = False

    def hold(self, handle: int) -> None:
        """Hold the PETSc inner communicator ``handle`` (of size > 1: the
        callers skip COMM_SELF's), or refresh its hold. Local, no MPI."""
        if not self.parallel:
            return  # serial objects: nothing to differ between ranks
        if handle not in self.holds:
            out = _COMM_T()
            if _COMM_DUP is None or _COMM_DUP(_COMM_T(handle), ctypes.byref(out), None) != 0:
                return
        self.holds[handle] = UNSEEN

    def vote(self, clock: int) -> int:
        """This rank's vote (the bits below), at the sync point whose
        family has completed ``clock`` sync points: a managed destroy failed
        here, it holds PETSc garbage on a member or on COMM_SELF. Local.

        It also drops the holds that two sync points have passed since a
        vote first saw (every rank alike: the clock is the family's, and
        only the count matters, so the several votes of one sync point
        agree), unless ``clock`` is LOOK: a parent family's look, which
        some ranks take and others do not (a rank with an object queued on
        this family answers before asking the votes), ages and drops
        nothing: the holds go in the family's own sync points. A hold taken
        in sync point j is first seen by the vote after its destroys (j's
        revote, or j + 1's), so it goes at j + 3's: after j + 1's agreement,
        which would have refused the family (for good) had a destroy failed
        at j."""
        if self.holds and clock != LOOK:
            for handle, since in list(self.holds.items()):
                if since == UNSEEN:
                    self.holds[handle] = clock
                elif clock - since >= 2:
                    del self.holds[handle]
                    self.stale = self.stale or handle in self.members
                    if _COMM_FREE is not None:
                        _COMM_FREE(ctypes.byref(_COMM_T(handle)))
        mine = FAILED if self.failed > 0 else 0
        look = garbage
        if look is None:
            return mine
        if _internals.SERIAL_DELAYED and look(SELF_HANDLE) not in (-1, 0):
            mine |= SELF_GARBAGE
        if self.stale:
            # The hold dropped was the last reference to a member's inner
            # communicator (one installed member can be another's inner
            # one), PETSc freed it, and its handle is dead: this vote, and
            # any other before the members are set again (a look of a
            # parent's, a vote of the steady state's that the steps vote
            # again after), reads none. It says there is garbage (a cleanup
            # is harmless): the finish looks, through the members' own
            # state, and sets them again.
            return mine | HAS_GARBAGE
        for handle in self.members:
            if look(handle) not in (0, -1):
                mine |= HAS_GARBAGE  # (unreadable, -2: say there is: a cleanup is harmless)
        return mine


# The bits of PETSc's vote (ORed over the ranks): all 0 when there is nothing
# to do, so that a quiet sync point stays in the steady state. (The C twin
# spells them too.)
HAS_GARBAGE = 1  # this rank holds PETSc garbage on an installed communicator
FAILED = 8  # a managed PETSc destroy raised on this rank
SELF_GARBAGE = 16  # this rank holds PETSc garbage on COMM_SELF
UNSEEN = -1  # a hold no vote has seen yet
SELF_HANDLE = MPI._handleof(MPI.COMM_SELF)


def _comm_functions() -> tuple[Any, Any, Any]:
    # PetscCommDuplicate and PetscCommDestroy through ctypes, with MPI_Comm
    # spelled as the MPI spells it (a pointer in Open MPI, an int in MPICH).
    pointer = MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_void_p)
    comm_t = ctypes.c_void_p if pointer else ctypes.c_int
    try:
        lib = ctypes.CDLL(PETSc.__file__)
        dup, free = lib.PetscCommDuplicate, lib.PetscCommDestroy
    except (OSError, AttributeError):
        return comm_t, None, None
    dup.restype = free.restype = ctypes.c_int
    dup.argtypes = [comm_t, ctypes.POINTER(comm_t), ctypes.c_void_p]
    free.argtypes = [ctypes.POINTER(comm_t)]
    return comm_t, dup, free


_COMM_T, _COMM_DUP, _COMM_FREE = _comm_functions()


def _hold(state: CommState, obj: Any) -> None:
    # Before a managed destroy from Python: hold obj's inner communicator if
    # it is parallel (the C runs do the same, in C, through CommState).
    try:
        if not obj.handle:
            return  # destroyed already (petsc4py 3.18 fails reading its comm), nothing to hold
        comm = obj.getComm()
        if comm.getSize() > 1:
            state.hold(MPI._handleof(comm.tompi4py()))
    except Exception:  # a destroyed or odd object: its destroy says what is wrong
        pass


def _capi_address(name: str) -> int:
    # The address of one of petsc4py's exported C functions (a Cython capsule).
    capsule = PETSc.__pyx_capi__[name]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address: int = api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))
    return address


def _capi_handle_slot() -> Callable[[Any], int] | None:
    # petsc4py's C API gives where a Python object stores its PETSc handle
    # (PyPetscObject_GetPtr); we use it only to forget a handle whose destroy
    # failed half-way.
    try:
        address = _capi_address("PyPetscObject_GetPtr")
        fn: Callable[[Any], int] = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(address)
        return fn
    except (AttributeError, KeyError, ValueError, TypeError):
        return None


_HANDLE_SLOT = _capi_handle_slot()


def _forget(obj: Any) -> None:
    """After a failed destroy: make sure PETSc never destroys ``obj`` again.

    A destroy that raised may have run half-way, and petsc4py keeps the
    handle. Another destroy of the wreck can crash (a Mat whose Python context
    raised in its destroy, when the wreck, which petsc4py had meanwhile handed
    to PETSc's garbage, was cleaned). So hold
    one more PETSc reference, which any later destroy or cleanup only drops,
    and null the Python object's handle: the object is leaked, safely.
    """
    try:
        if not obj.handle:
            return
        obj.incRef()
        if _HANDLE_SLOT is not None:
            ctypes.c_void_p.from_address(_HANDLE_SLOT(obj)).value = None
    except Exception:  # best effort; the destroy's own error is what gets reported
        pass


def _original(exc: BaseException) -> BaseException:
    """The exception to report for a destroy that raised ``exc``.

    When Python code that PETSc called (a Python-type Mat's context, say)
    raises, petsc4py 3.18 lets that exception through, while later ones raise
    a ``PETSc.Error`` whose ``__cause__`` it is, and whose text is PETSc's
    error trace (the same message once per PETSc frame). Report the user's
    exception in both cases, once, with its own type and message.
    """
    cause = exc.__cause__
    if isinstance(exc, PETSc.Error) and cause is not None and not isinstance(cause, PETSc.Error):
        return cause
    return exc


def _destroy(obj: Any) -> None:
    try:
        obj.destroy()
    except PETSc.Error as exc:
        if _original(exc) is exc:
            raise
        # Nothing in this frame may hold the cause: its traceback holds the frame.
        raise _original(exc) from None


def destroy_one(obj: Any, state: CommState) -> None:
    # The managed destroy of a wrapper owning one object (the common case, so
    # no loop and no varargs).
    _hold(state, obj)
    try:
        _destroy(obj)
    except BaseException:
        _forget(obj)
        state.failure()
        raise


def destroy_many(state: CommState, *objs: Any) -> None:
    # The managed destroy of a wrapper owning several objects.
    _destroy_each(objs, state)


def _destroy_each(objs: tuple[Any, ...], state: CommState | None) -> None:
    """``obj.destroy()`` for each object, last first, every one tried whatever
    raises (a KeyboardInterrupt too); then the first exception is raised, an
    interrupt before any other, the rest as its notes. A failed object is
    forgotten (see :func:`_forget`) and counted in ``state``."""
    errors: list[tuple[Any, BaseException]] = []
    for obj in reversed(objs):
        if state is not None:
            _hold(state, obj)
        try:
            _destroy(obj)
        except BaseException as exc:  # every object is still tried; raised after
            _forget(obj)
            if state is not None:
                state.failure()
            errors.append((obj, exc))
    if not errors:
        return
    errors.sort(key=lambda e: isinstance(e[1], Exception))  # stable: interrupts first
    first = errors[0][1]
    for note in [f"also raised for a {type(o).__name__}: {e!r}" for o, e in errors[1:]]:
        first.add_note(note)
    del errors, obj
    try:
        raise first
    finally:
        del first  # no frame-traceback cycle keeping the objects alive


def fast_types() -> tuple[type, ...]:
    # petsc4py's own classes whose destroy() is XDestroy(&handle) and nothing
    # else (read in the sources of each release in _internals.CHECKED), so
    # PetscObjectDestroy on the handle slot does the same. Exact types only: a
    # user's subclass may override destroy(), and gets it called. Outside
    # _internals.CHECKED the C loop calls every object's destroy() method.
    if not _internals.checked(_internals.PETSC4PY_RELEASE):
        return ()
    names = ("Vec", "Mat", "IS", "KSP", "PC", "SNES")
    out = [getattr(PETSc, n) for n in names if hasattr(PETSc, n)]
    dm_destroy = PETSc.DM.destroy
    out += [
        c
        for c in vars(PETSc).values()
        if isinstance(c, type)
        and issubclass(c, PETSc.DM)
        and getattr(c, "destroy", None) is dm_destroy
    ]
    return tuple(dict.fromkeys(out))


def _failed(state: CommState, bad: list[tuple[Any, BaseException]]) -> BaseException:
    """What the C runs do when destroys of one registration raised (``bad``:
    (object, exception) of each, last first): the wrecks are made safe and
    counted, as the Python destroys do, and the exception to report is the
    first (an interrupt before any other), the rest as its notes."""
    errors = []
    for obj, exc in bad:
        if obj is not None:
            _forget(obj)
        state.failure()
        errors.append((obj, _original(exc)))
    errors.sort(key=lambda e: isinstance(e[1], Exception))  # stable: interrupts first
    first = errors[0][1]
    for note in [f"also raised for a {type(o).__name__}: {e!r}" for o, e in errors[1:]]:
        first.add_note(note)
    bad.clear()
    del errors
    try:
        return first
    finally:
        del first  # no frame-traceback cycle keeping the objects alive


def _native() -> Any:
    """collective_gc._speedups.Petsc over this PETSc (where the extension is
    built, the release's layout was read, and petsc4py's C API is there), or None."""
    reader = _internals.READER
    if SPEEDUPS is None or reader is None:
        return None
    try:
        lib = ctypes.CDLL(PETSc.__file__)
        addresses = (
            _capi_address("PyPetscObject_GetPtr"),
            ctypes.cast(lib.PetscObjectGetComm, ctypes.c_void_p).value or 0,
            ctypes.cast(lib.PetscObjectDestroy, ctypes.c_void_p).value or 0,
            _capi_address("PyPetscError_Set"),
            ctypes.cast(lib.PetscCommDuplicate, ctypes.c_void_p).value or 0,
            ctypes.cast(lib.PetscCommDestroy, ctypes.c_void_p).value or 0,
        )
        fast = fast_types()
    except (OSError, AttributeError, KeyError, ValueError, TypeError):
        return None
    if not all(addresses):
        return None
    return SPEEDUPS.Petsc(*reader.keyvals(), *addresses, fast, _failed, _internals.SERIAL_DELAYED)


# PETSc from C where it can be (collective_gc._speedups.Petsc): its garbage
# counts (what every sync point's vote reads; through ctypes its reads cost
# more than the rest of the vote), the check of what cp.manage is given, and
# the runs of managed destroys at sync points (explicit destroys still call
# destroy_one and destroy_many).
NATIVE = _native()
garbage: Callable[[int], int] | None = (
    NATIVE.garbage
    if NATIVE is not None
    else None
    if _internals.READER is None
    else _internals.READER.garbage
)
# A family's CommState, bound once: C's where NATIVE is (its votes read
# PETSc's garbage and its holds call PETSc from C, with no Python frame in a
# steady sync point), else the Python twin.
comm_state: Callable[[bool], CommState] = CommState if NATIVE is None else NATIVE.comm_state
_RUNNERS: dict[Callable[..., object], Any] = (
    {} if NATIVE is None else {destroy_one: NATIVE.runner(False), destroy_many: NATIVE.runner(True)}
)


def destroy_all(*objs: Any) -> None:
    """Collective: ``obj.destroy()`` for each object, last first.

    Every object is tried even if one raises (a KeyboardInterrupt too); then
    the first exception is raised, an interrupt before any other, the others
    as its notes. What is raised is PETSc's own error, or the Python
    exception that made PETSc fail. An object whose destroy raised is left
    alone for good (its handle is nulled: destroying a half-destroyed object
    again can crash). Already destroyed objects (null handle) are skipped by
    petsc4py itself, so a second call does nothing. Called on every rank of
    the objects' communicators, as their destroys are.
    """
    _destroy_each(objs, None)


for _fn, _runner in _RUNNERS.items():
    set_batch(_fn, _runner)
_batching = bool(_RUNNERS)


def batch_destroys(enabled: bool | None = None) -> bool:
    """Whether sync points destroy managed PETSc objects from C, a run of
    registrations at a time; ``enabled`` sets it first. Local.

    True by default where the C extension and petsc4py's C API are available
    (then False cannot be changed to True). False: each object's
    ``destroy()`` is called from Python, with the same order, errors and
    outcome (what a user without a C compiler gets). For benchmarks and tests;
    set it alike on every rank, between sync points.
    """
    global _batching
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True, False or None, not {enabled!r}")
        on = enabled and bool(_RUNNERS)
        for fn, runner in _RUNNERS.items():
            set_batch(fn, runner if on else None)
        _batching = on
    return _batching
