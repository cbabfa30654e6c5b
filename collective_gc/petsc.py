"""petsc4py adapter: PETSc objects destroyed at sync points, PETSc's garbage cleaned there too.

Two kinds of PETSc object need a collective destroy in a Python program:

- objects a wrapper class owns (a solver's KSP, its work Vecs): :func:`manage`
  registers the wrapper so that, once it has died on every rank, ``.destroy()``
  runs on each object at the agreed sync point, in the agreed order;
- petsc4py objects Python drops on its own (temporaries, sub-objects fetched
  with ``ksp.getPC()``): petsc4py >= 3.18 hands them to PETSc's *delayed
  destroy*, which parks them in a per-communicator garbage map until someone
  calls ``PETSc.garbage_cleanup(comm)``. Nothing calls it for the user, so
  memory and communicators pile up. :func:`install` makes every sync point on a
  communicator also clean PETSc's garbage of that communicator and of
  ``COMM_SELF`` (before PETSc 3.20 even serial objects are delayed).

``collective_gc.view(comm)`` shows PETSc's garbage entries beside ours. They are
read from PETSc's own hash map through ``ctypes`` (a local attribute lookup,
no communication), for the PETSc releases whose layout was read (see
``_CHECKED``); with another release, or a build that does not export what
that needs, the view omits them and every sync point calls
``garbage_cleanup`` unconditionally.

A destroy that fails on some ranks leaves PETSc's objects of the
communicator different between ranks: later sync points there refuse, saying
so. An owner that one of its own managed objects refers back to can never
die: :func:`immortal`, the view, the leak check and a warning at exit name it.

petsc4py 3.18 has no KSP/SNES post-solve hooks (``KSP.setPostSolve`` came to
petsc4py in 2024), and a sync point inside one would run while PETSc is in the
middle of the solve, with the solver's own objects possibly among those to
destroy. Make the wrapper's solve method the sync point instead: decorate it
with :func:`collective_gc.sync_point`, or call :func:`solve`.

This is the only module of collective_gc that imports petsc4py.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import petsc4py
from mpi4py import MPI
from petsc4py import PETSc

from ._api import add_comm_resolver, register
from ._comms import adopt, contains, relation
from ._destroy import set_batch
from ._diagnose import reference_paths
from ._errors import ExitLeakWarning, RegistrationError
from ._lookup import manager, managers
from ._manager import Manager, Participant
from ._registration import SPEEDUPS, Registration
from ._scope import sync_point

__all__ = ["manage", "destroy_all", "install", "garbage", "immortal", "solve", "batch_destroys"]


# -- which PETSc and petsc4py this module knows ---------------------------------

# What this module relies on beyond petsc4py's public API was read in PETSc's
# and petsc4py's sources of every release from 3.18 to 3.24: the garbage map
# (a khash table of PetscInt64 creation index to PetscObject, attached to
# PETSc's inner communicator under Petsc_Garbage_HMap_keyval) and the
# destroy() methods of the classes _fast_types() lists (XDestroy on the
# handle slot that PyPetscObject_GetPtr returns, nothing else). Outside that
# range neither is used: the view leaves PETSc's entries out, sync points
# clean PETSc's garbage unconditionally, and destroys are destroy() calls.
_CHECKED = ((3, 18), (3, 24))


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


_PETSC_RELEASE = tuple(PETSc.Sys.getVersion()[:2])
_PETSC4PY_RELEASE = _release(petsc4py.__version__)


def _checked(release: tuple[int, ...]) -> bool:
    return _CHECKED[0] <= release <= _CHECKED[1]


# Before 3.20, PETSc's delayed destroy parks serial objects too (in
# COMM_SELF's garbage); from 3.20 on it destroys them at once.
_SERIAL_DELAYED = _PETSC_RELEASE < (3, 20)


# -- reading PETSc's garbage maps (local, read-only) -------------------------


class _KHash(ctypes.Structure):
    # The khash table behind PETSc's PetscHMapObj (include/petsc/private/
    # hashmapobj.h: PetscInt64 creation index -> PetscObject).
    _fields_ = [
        ("n_buckets", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("n_occupied", ctypes.c_uint32),
        ("upper_bound", ctypes.c_uint32),
        ("flags", ctypes.POINTER(ctypes.c_uint32)),
        ("keys", ctypes.POINTER(ctypes.c_int64)),
        ("vals", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Internals:
    """PETSc's communicator attributes and garbage maps, through ctypes.

    PETSc keeps its objects on an *inner* duplicate of the user's communicator,
    found through an attribute of the user's one, and bins delayed-destroy
    garbage in a hash map attached to that inner communicator. Reading them is
    ``MPI_Comm_get_attr`` (local: no message, no synchronization) and plain
    memory reads, so it is safe at any time on one rank alone.
    """

    def __init__(self) -> None:
        # dlsym through the extension modules' handles searches the libraries
        # they link, whatever the PETSc and MPI libraries are called here.
        petsc = ctypes.CDLL(PETSc.__file__)
        mpi = ctypes.CDLL(MPI.__file__)
        self._inner_kv = ctypes.c_int.in_dll(petsc, "Petsc_InnerComm_keyval")
        self._counter_kv = ctypes.c_int.in_dll(petsc, "Petsc_Counter_keyval")
        self._garbage_kv = ctypes.c_int.in_dll(petsc, "Petsc_Garbage_HMap_keyval")
        # MPI_Comm is a pointer in Open MPI and an int in MPICH.
        self._handle_t: Any = ctypes.c_void_p if MPI._sizeof(MPI.Comm) == 8 else ctypes.c_int
        get_attr = mpi.MPI_Comm_get_attr
        get_attr.argtypes = [
            self._handle_t,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
        ]
        get_attr.restype = ctypes.c_int
        self._get_attr = get_attr
        class_name = petsc.PetscObjectGetClassName
        class_name.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p)]
        class_name.restype = ctypes.c_int
        self._class_name = class_name
        self._invalid = MPI.KEYVAL_INVALID

    def _attr(self, handle: int, keyval: ctypes.c_int) -> int | None:
        kv = keyval.value
        if kv == self._invalid:
            return None  # PETSc has not created this keyval yet: nothing attached
        value = ctypes.c_void_p()
        flag = ctypes.c_int()
        if self._get_attr(handle, kv, ctypes.byref(value), ctypes.byref(flag)) or not flag.value:
            return None
        return int(value.value or 0)

    def _to_handle(self, raw: int) -> int:
        # PETSc stores an MPI_Comm in a union with a void*: for int handles
        # the value is in the low 32 bits.
        if self._handle_t is ctypes.c_int:
            return ctypes.c_int(raw & 0xFFFFFFFF).value
        return raw

    def inner(self, comm: MPI.Comm) -> int | None:
        """The handle of PETSc's inner communicator of ``comm``, or None if PETSc has none."""
        handle: int = MPI._handleof(comm)
        raw = self._attr(handle, self._inner_kv)  # the common case first: one lookup
        if raw is not None:
            return self._to_handle(raw)
        if self._attr(handle, self._counter_kv) is not None:
            return handle  # comm is itself a PETSc inner communicator
        return None

    def _table(self, inner: int) -> _KHash | None:
        """The garbage map of an inner communicator, if it has one and it looks whole."""
        table = self._attr(inner, self._garbage_kv)
        if not table:
            return None
        kh = _KHash.from_address(table)
        n = kh.n_buckets
        # khash keeps a power-of-two bucket count, at most that many live or
        # deleted entries, and its three arrays once it has buckets. Anything
        # else means this is not the table we know: read nothing more of it.
        if (
            n & (n - 1)
            or not kh.size <= kh.n_occupied <= n
            or (n and not (kh.flags and kh.keys and kh.vals))
        ):
            raise _Unreadable(f"PETSc's garbage map at {table:#x} does not look like a khash table")
        return kh

    def count(self, inner: int) -> int:
        """How many garbage entries this rank holds on an inner communicator."""
        kh = self._table(inner)
        return 0 if kh is None else int(kh.size)

    def entries(self, inner: int) -> list[tuple[int, str]]:
        """(creation index, class name) of this rank's garbage on an inner communicator."""
        kh = self._table(inner)
        if kh is None:
            return []
        out = []
        name = ctypes.c_char_p()
        for i in range(kh.n_buckets):
            # khash keeps two flag bits per bucket (empty, deleted); 0 means occupied.
            if (kh.flags[i >> 4] >> ((i & 0xF) << 1)) & 3:
                continue
            if self._class_name(kh.vals[i], ctypes.byref(name)) or name.value is None:
                cls = "PetscObject"
            else:
                cls = name.value.decode(errors="replace")
            out.append((kh.keys[i], cls))
        out.sort()
        return out


class _Unreadable(RuntimeError):
    """PETSc's garbage map is not laid out as this module knows it."""


def _load_internals() -> _Internals | None:
    if not _checked(_PETSC_RELEASE):
        return None  # a layout we have not read: never guess at memory
    try:
        return _Internals()
    except (OSError, AttributeError, ValueError):
        # A static or differently built PETSc: we cannot look, so we clean
        # unconditionally and the view leaves PETSc's entries out.
        return None


_PETSC = _load_internals()


def _user_comm(obj: object) -> MPI.Comm | None:
    """The communicator a PETSc object was made on, for ``cgc.collect(obj)``.

    A PETSc object holds PETSc's inner duplicate of it, not the user's, so
    the user's is the managed one whose inner communicator that is.
    """
    if not isinstance(obj, PETSc.Object):
        return None
    if not obj.handle:
        # petsc4py 3.18 crashes reading .comm of a destroyed object.
        raise TypeError(
            f"this PETSc {type(obj).__name__} is destroyed: it has no communicator; "
            "pass the communicator it was made on to collect"
        )
    handle = MPI._handleof(obj.comm.tompi4py())
    for mgr in managers():
        if mgr.comm_freed or mgr.broken is not None:
            continue
        if MPI._handleof(mgr.comm) == handle or (
            _PETSC is not None and _PETSC.inner(mgr.comm) == handle
        ):
            return mgr.comm
    raise TypeError(
        f"cannot tell which communicator this PETSc {type(obj).__name__} was made on "
        "(PETSc objects hold PETSc's own duplicate of it, and no managed communicator "
        "has it): pass that communicator to collect"
    )


add_comm_resolver(_user_comm)


def garbage(comm: MPI.Comm) -> list[tuple[int, str]]:
    """This rank's PETSc garbage on ``comm``: ``(creation index, class name)`` pairs. Local.

    These are objects petsc4py handed to PETSc's delayed destroy (Python dropped
    them) that no ``PETSc.garbage_cleanup(comm)`` has destroyed yet. Raises
    RuntimeError if this PETSc build does not let us read its garbage maps.
    """
    if _PETSC is None:
        raise RuntimeError(
            "collective_gc.petsc cannot read PETSc's garbage maps with this PETSc build "
            "(its Petsc_*_keyval symbols are not exported); use PETSc.garbage_view(comm)"
        )
    inner = _PETSC.inner(comm)
    return [] if inner is None else _PETSC.entries(inner)


# -- what this rank knows of each communicator's PETSc state ------------------


class _CommState:
    """This rank's record of the PETSc objects managed on one communicator.

    ``failed`` counts this rank's managed PETSc destroys that raised (the
    wrecks are leaked, see :func:`_forget`).
    """

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = 0


# One per installed manager. Registrations of serial objects get _SERIAL: a
# serial wreck cannot make the ranks disagree about anything collective.
_STATES: weakref.WeakKeyDictionary[Manager, _CommState] = weakref.WeakKeyDictionary()
_SERIAL = _CommState()
_INSTALLING = threading.Lock()


def _count(inner: int) -> int:
    assert _PETSC is not None
    try:
        return _PETSC.count(inner)
    except _Unreadable:
        return 1  # cannot tell: say there is garbage (an empty cleanup is harmless)


# -- the sync and view hooks ---------------------------------------------------


# The bits of PETSc's vote (ORed over the ranks).
_HAS_GARBAGE = 1  # this rank holds PETSc garbage on the communicator
_HAS_INNER = 2  # this rank has PETSc's inner communicator for it
_LACKS_INNER = 4  # this rank does not
_FAILED = 8  # a managed PETSc destroy raised on this rank
_SELF_GARBAGE = 16  # this rank holds PETSc garbage on COMM_SELF


class _Cleanup(Participant):
    """PETSc's own garbage cleanup, at every sync point of one communicator."""

    field = 1

    def vote(self, mgr: Manager) -> int:
        """This rank's vote: whether it holds garbage (on the communicator, on
        COMM_SELF), has PETSc's inner communicator, and saw a managed destroy
        fail. Local."""
        state = _STATES.get(mgr)
        failed = _FAILED if state is not None and state.failed > 0 else 0
        if _PETSC is None:
            return failed
        mine = failed | (_SELF_GARBAGE if _self_garbage() else 0)
        # No look once the user's communicator is freed (collectively, so on
        # every rank alike): its handle is dead.
        if mgr.comm_freed:
            return mine
        inner = _PETSC.inner(mgr.comm)
        if inner is None:
            return mine | _LACKS_INNER
        return mine | _HAS_INNER | (_HAS_GARBAGE if _count(inner) else 0)

    def may_raise(self, flags: int) -> bool:
        """Whether a cleanup (its destroys may raise on some ranks only) runs."""
        votes = self.votes(flags)
        if _PETSC is None or votes & _SELF_GARBAGE:
            return True
        wanted = votes & _HAS_GARBAGE and not votes & (_LACKS_INNER | _FAILED)
        return bool(wanted)

    def finish(self, mgr: Manager, flags: int) -> None:
        """Collective over ``mgr.comm``: clean PETSc's garbage there and on COMM_SELF.

        ``PETSc.garbage_cleanup`` is itself collective and not free even with
        nothing to clean, so it runs only when the agreed vote (carried in the
        sync point's own collectives, taken again after its destroys, which
        may have made garbage) says some rank holds garbage and every rank
        has PETSc's inner communicator: it costs no message of its own but
        one word after it (see :meth:`may_raise`), which says whether a
        cleanup raised on any rank, so that every rank raises alike.

        If a managed PETSc destroy raised on any rank, PETSc's objects of the
        communicator may differ between ranks (the wreck, and PETSc's inner
        communicator with it, survive where it failed), and any later
        collective PETSc call on it may hang: the manager is made unusable on
        every rank, with that explanation, and nothing is cleaned there.
        """
        votes = self.votes(flags)
        if not mgr.comm_freed:
            self._clean(mgr, votes)
        if _PETSC is None:
            if mgr.comm_freed or mgr.comm != MPI.COMM_SELF:  # unlooked: not the same one twice
                PETSc.garbage_cleanup(MPI.COMM_SELF)
        elif votes & _SELF_GARBAGE and _self_garbage():
            # Rank-local, but only when the vote said so: then every rank
            # knows a cleanup may raise (see may_raise). Garbage made since
            # the vote waits for the next sync point.
            PETSc.garbage_cleanup(MPI.COMM_SELF)

    def _clean(self, mgr: Manager, votes: int) -> None:
        # The communicator's own garbage (not freed, so its handle is live).
        comm = mgr.comm
        if mgr.size > 1 and votes & _FAILED:
            _refuse(mgr)  # nothing collective on comm any more
        elif _PETSC is None:
            PETSc.garbage_cleanup(comm)  # cannot look: clean unconditionally (every rank alike)
        elif mgr.size > 1:
            if votes & _HAS_GARBAGE and not votes & _LACKS_INNER:
                PETSc.garbage_cleanup(comm)
            elif votes & _HAS_GARBAGE and votes & _HAS_INNER:
                _warn_split_state(mgr)
        else:
            state = _STATES.get(mgr)
            if state is not None:
                state.failed = 0  # one rank: nothing can differ between ranks
            inner = _PETSC.inner(comm)
            if inner is not None and _count(inner):
                PETSc.garbage_cleanup(comm)


def _self_garbage() -> bool:
    """Whether this rank holds PETSc garbage on COMM_SELF. Local."""
    if _PETSC is None or not _SERIAL_DELAYED:
        return False  # PETSc destroys serial objects at once: COMM_SELF's map stays empty
    # Look first: an empty cleanup of COMM_SELF is not free (PETSc
    # duplicates and frees an inner communicator to find nothing).
    self_inner = _PETSC.inner(MPI.COMM_SELF)
    return self_inner is not None and _count(self_inner) > 0


def _refuse(mgr: Manager) -> None:
    """No more sync points on ``mgr``; on every rank alike, since the vote is agreed."""
    mgr.mark_unusable(
        f"a PETSc destroy raised on some rank (seen at sync point {mgr.sync_count - 1}), so "
        f"the PETSc objects of this communicator of size {mgr.size} may now differ between "
        "ranks (the failed object, and PETSc's inner communicator with it, survive "
        "where it failed) and further collective use of PETSc on it may hang; no "
        "later sync point runs on it: finish with it, or go on with a fresh communicator"
    )


_WARNED: weakref.WeakSet[Manager] = weakref.WeakSet()


def _warn_split_state(mgr: Manager) -> None:
    if mgr in _WARNED:
        return
    _WARNED.add(mgr)
    warnings.warn(
        f"collective_gc: rank {mgr.rank}: PETSc's state of the {mgr!r} differs "
        "between ranks (a PETSc destroy failed on some ranks only?), so its PETSc garbage "
        "is no longer cleaned: cleaning it now would hang. Creating new PETSc objects on "
        "this communicator may hang too; use a fresh one.",
        RuntimeWarning,
        stacklevel=2,
    )


def _view_hook(mgr: Manager) -> Iterator[tuple[str, str]]:
    """PETSc's garbage on ``mgr.comm`` (and on COMM_SELF), and owners that can never die. Local."""
    for line in _immortal(mgr):
        yield "never dies", line
    if _PETSC is None:
        return
    try:
        inner = _PETSC.inner(mgr.comm)
        if inner is not None:
            for cidx, cls in _PETSC.entries(inner):
                yield cls, f"PETSc garbage #{cidx}"
        self_inner = _PETSC.inner(MPI.COMM_SELF)
        if self_inner is not None and self_inner != inner:
            for cidx, cls in _PETSC.entries(self_inner):
                yield cls, f"PETSc garbage #{cidx} (COMM_SELF)"
    except _Unreadable as exc:
        yield "PETSc garbage", f"not shown: {exc}"


def install(comm: MPI.Comm | None = None) -> Manager:
    """Make every sync point on ``comm`` also clean PETSc's garbage. Collective.

    From then on each sync point of ``comm``'s manager (``cgc.collect``, a
    scope's sync or exit, a solve made a sync point, a parent's sync point
    for a ``cgc.dup``/``cgc.split`` communicator) ends with
    ``PETSc.garbage_cleanup(comm)`` when any rank holds PETSc garbage on
    ``comm``, and cleans this rank's ``COMM_SELF`` garbage; ``cgc.view(comm)``
    lists PETSc's entries, and it and the pytest plugin's leak check name
    managed owners that can never die (see :func:`immortal`). ``comm``
    defaults to ``COMM_WORLD``. :func:`manage` calls it for you. Idempotent.

    Call it on every rank of ``comm``: the cleanup is collective, so a rank
    without the hook would skip it while the others wait for it.
    """
    mgr = manager(MPI.COMM_WORLD if comm is None else comm)
    if mgr not in _STATES:
        with _INSTALLING:  # one state per manager, whichever threads install
            if mgr not in _STATES:
                mgr.add_participant(_Cleanup())
                mgr.add_view_hook(_view_hook)
                mgr.add_leak_hook(_immortal)
                _STATES[mgr] = _CommState()  # last: seen installed only once it is
    return mgr


# -- owners their own resources keep alive ------------------------------------

# Not walked into: their referents are the interpreter's, not the user's
# object graph (a function's globals reach every module). The manager is
# left out too: through its other registrations every owner would look
# reachable from every other.
_OPAQUE = (
    type,
    types.ModuleType,
    types.FrameType,
    types.CodeType,
    types.BuiltinFunctionType,
    str,
    bytes,
    int,
    float,
    Manager,
)
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def _opaque(obj: object) -> bool:
    # A weak proxy holds nothing strongly, and isinstance() on a dead one
    # raises ReferenceError: its type is read directly.
    return type(obj) in _PROXIES or isinstance(obj, _OPAQUE)


def _edges(obj: object) -> Iterator[tuple[str, object]]:
    """(label, referent) for the strong references out of ``obj`` that matter here."""
    if _opaque(obj):
        return
    # Containers are copied by their own copy(), in one C call: list() of a
    # dict's items allocates a tuple per item, so a collection (its callbacks,
    # finalizers, another thread given the GIL there) may change the dict in
    # the middle of it, and the walk would raise instead of looking.
    if isinstance(obj, dict):
        for k, v in dict.copy(obj).items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):  # a list's iterator never raises for a change
            yield f"[{i}]", v
    elif isinstance(obj, (set, frozenset)):
        for v in set.copy(obj) if isinstance(obj, set) else obj:
            yield "{...}", v
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield f".<closure of {obj.__name__}>", cell.cell_contents
            except ValueError:  # an empty cell
                pass
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
    elif isinstance(obj, PETSc.Object):
        # petsc4py's traverse gives the PETSc object's own attribute dict
        # (application context, callbacks, setAttr values): what petsc4py's
        # own cyclic collection follows.
        for ref in gc.get_referents(obj):
            yield ".<PETSc attributes>", ref
    else:
        inst = getattr(obj, "__dict__", None)
        for ref in gc.get_referents(obj):
            if ref is inst and isinstance(inst, dict):
                for k, v in dict.copy(inst).items():
                    yield f".{k}", v
            else:
                yield f".<{type(ref).__name__}>", ref


def _path_to(
    roots: list[tuple[str, object]], owner: object, max_objects: int
) -> tuple[str | None, int]:
    """The shortest path of strong references from one of ``roots`` (named) to
    ``owner``, or None; and how many objects were looked at (at most about
    ``max_objects``). Local. See :func:`collective_gc._diagnose.reference_paths`."""
    for name, root in roots:
        if root is owner:
            return f"{name} -> {type(owner).__name__}", 1
    if _opaque(owner):
        return None, 0  # never walked to: a class or a module is alive anyway
    paths, seen = reference_paths(
        roots, owner, _edges, skip=_opaque, max_depth=8, max_objects=max_objects, limit=1
    )
    return (paths[0] if paths else None), seen


def _keeper(reg: Registration, owner: object, max_objects: int) -> tuple[str | None, int]:
    """How ``reg``'s own destroy call reaches its owner (see :func:`_path_to`).

    The registration holds its destroy and arguments strongly, and is held
    by its manager, so an owner reachable from them can never die.
    """
    roots = [
        ("destroy args" if isinstance(ref, tuple) else "destroy", ref)
        for ref in gc.get_referents(reg)
        # Not the manager, nor its inbox's bound append.
        if not (_opaque(ref) or isinstance(ref, types.BuiltinMethodType))
    ]
    return _path_to(roots, owner, max_objects)


def _immortal(mgr: Manager, budget: int = 200_000) -> list[str]:
    # The budget bounds the whole walk (a view or the exit of a program with
    # many live owners must stay quick); what it leaves unchecked is said.
    out = []
    regs = mgr.alive()
    for i, reg in enumerate(regs):
        if budget <= 0:
            out.append(
                f"{len(regs) - i} more live registrations not checked for owners "
                "their own destroy call keeps alive (too many objects to walk)"
            )
            break
        owner = reg()
        path, seen = (None, 0) if owner is None else _keeper(reg, owner, min(budget, 5000))
        del owner
        budget -= max(seen, 1)
        if path is not None:
            out.append(
                f"{reg.typename} {reg.name!r} (key {reg.key}) is kept alive by its own "
                f"destroy call, so it never dies and its destroy never runs: {path}"
            )
    return out


def immortal(comm: MPI.Comm) -> list[str]:
    """Managed owners on ``comm`` that their own resources keep alive, on this rank. Local.

    A registration holds its objects until its owner dies; if one of them
    refers back to the owner (``ksp.setAppCtx(owner)``,
    ``snes.setFunction(owner.F)``, ``obj.setAttr("o", owner)``, a monitor
    closing over it), the owner can never die. Plain petsc4py would collect
    such a cycle; here the registration is what keeps it. One line per such
    owner, naming it and the path from its destroy call back to it; break
    that path (a ``weakref.proxy`` of the owner, say). ``cgc.view(comm)``
    and the pytest plugin's leak check show the same lines, and a warning
    says them at exit. Only managers
    :func:`install` (or :func:`manage`) ran on are looked at.
    """
    mgr = manager(comm)
    return _immortal(mgr) if mgr in _STATES else []


def _warn_immortal_at_exit() -> None:
    # Runs before collective_gc's own exit handler (registered after it), and
    # only looks: no MPI call, no destroy.
    for mgr in list(_STATES.keys()):
        try:
            lines = _immortal(mgr)
        except Exception:  # a diagnostic must never break the exit
            continue
        for line in lines:
            warnings.warn(
                f"collective_gc: rank {mgr.rank}: on the {mgr!r} at exit: {line}",
                ExitLeakWarning,
                stacklevel=1,
            )


atexit.register(_warn_immortal_at_exit)


# -- wrappers that own PETSc objects --------------------------------------------


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


def _destroy_one(obj: Any, state: _CommState) -> None:
    # The managed destroy of a wrapper owning one object (the common case, so
    # no loop and no varargs).
    try:
        _destroy(obj)
    except BaseException:
        _forget(obj)
        state.failed += 1
        raise


def _destroy_many(state: _CommState, *objs: Any) -> None:
    # The managed destroy of a wrapper owning several objects.
    _destroy_each(objs, state)


def _destroy_each(objs: tuple[Any, ...], state: _CommState | None) -> None:
    """``obj.destroy()`` for each object, last first, every one tried whatever
    raises (a KeyboardInterrupt too); then the first exception is raised, an
    interrupt before any other, the rest as its notes. A failed object is
    forgotten (see :func:`_forget`) and counted in ``state``."""
    errors: list[tuple[Any, BaseException]] = []
    for obj in reversed(objs):
        try:
            _destroy(obj)
        except BaseException as exc:  # every object is still tried; raised after
            _forget(obj)
            if state is not None:
                state.failed += 1
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


def _fast_types() -> tuple[type, ...]:
    # petsc4py's own classes whose destroy() is XDestroy(&handle) and nothing
    # else (read in the sources of each release in _CHECKED), so
    # PetscObjectDestroy on the handle slot does the same. Exact types only: a
    # user's subclass may override destroy(), and gets it called. Outside
    # _CHECKED the C loop calls every object's destroy() method.
    if not _checked(_PETSC4PY_RELEASE):
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


def _fast_destroyer() -> Callable[[list[tuple[Any, ...]]], list[tuple[int, BaseException]]] | None:
    """A batch destroy for :func:`_destroy_one` calls, run in C, or None if unavailable.

    It needs our optional C extension, petsc4py's C API and PETSc's
    PetscObjectDestroy; without any of them sync points call ``destroy()``
    on each object from Python, with the same outcome.
    """
    if SPEEDUPS is None:
        return None
    try:
        lib = ctypes.CDLL(PETSc.__file__)
        addresses = (
            _capi_address("PyPetscObject_GetPtr"),
            ctypes.cast(lib.PetscObjectDestroy, ctypes.c_void_p).value or 0,
            _capi_address("PyPetscError_Set"),
        )
        fast = _fast_types()
    except (OSError, AttributeError, KeyError, ValueError, TypeError):
        return None
    if not all(addresses):
        return None
    destroy_each = SPEEDUPS.destroy_each

    def destroy_batch(argss: list[tuple[Any, ...]]) -> list[tuple[int, BaseException]]:
        # argss: [(obj, state), ...], the arguments of _destroy_one calls; the
        # same outcome as making each call, in order. A chunk at a time, each
        # chunk's calls dropped from the list once done: what only they held
        # (the Python objects of the destroyed PETSc objects, usually) is
        # freed while still in cache, not in a second pass over the whole
        # batch after PETSc's destroys have evicted it.
        errors: list[tuple[int, BaseException]] = []
        for start in range(0, len(argss), _CHUNK):
            part = argss[start : start + _CHUNK]
            for i, exc in destroy_each(part, 0, fast, *addresses):
                obj, state = part[i]
                _forget(obj)
                state.failed += 1
                errors.append((start + i, _original(exc)))
                del obj, state, exc  # this frame outlives the loop in the tracebacks
            argss[start : start + len(part)] = _NONES[: len(part)]
            del part
        try:
            return errors
        finally:
            del errors  # see collective_gc._destroy.Failure

    return destroy_batch


_CHUNK = 512
_NONES: list[Any] = [None] * _CHUNK


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


# Sync points destroy runs of managed single-object wrappers in C (see
# collective_gc._speedups); explicit destroys still call _destroy_one.
_BATCH = _fast_destroyer()
set_batch(_destroy_one, _BATCH)
_BATCHING = [_BATCH is not None]


def batch_destroys(enabled: bool | None = None) -> bool:
    """Whether sync points destroy the objects of single-object wrappers from C,
    a run of them at a time; ``enabled`` sets it first. Local.

    True by default where the C extension and petsc4py's C API are available
    (then False cannot be changed to True). False: each object's
    ``destroy()`` is called from Python, with the same order, errors and
    outcome (what a user without a C compiler gets). For benchmarks and tests;
    set it alike on every rank, between sync points.
    """
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True, False or None, not {enabled!r}")
        on = enabled and _BATCH is not None
        set_batch(_destroy_one, _BATCH if on else None)
        _BATCHING[0] = on
    return _BATCHING[0]


def _describe_object(obj: Any) -> str:
    try:
        name = obj.getName()
    except Exception:  # noqa: BLE001 (a name is only for the message)
        name = None
    return f"{type(obj).__name__} {name!r}" if name else type(obj).__name__


def _check(obj: Any, comm: MPI.Comm, inner: int | None) -> MPI.Intracomm | None:
    """Refuse what cannot be managed on ``comm``. Returns None if ``obj`` is
    serial or lives on ``comm`` itself (PETSc's inner duplicate of it), else
    the communicator it lives on, congruent with or a subset of ``comm``."""
    if not isinstance(obj, PETSc.Object):
        raise RegistrationError(
            f"collective_gc.petsc.manage() manages petsc4py objects, not a "
            f"{type(obj).__name__!r} object (use collective_gc.register for other resources)"
        )
    if not obj.handle:
        raise RegistrationError(
            f"this {type(obj).__name__} is destroyed or was never created; "
            "create it before handing it to collective_gc.petsc.manage()"
        )
    ocomm = obj.getComm()
    osize = ocomm.getSize()
    if osize == 1:
        return None  # a serial object: destroying it at a sync point of any communicator is safe
    # PETSc keeps the object on its inner duplicate of the communicator it was
    # created with: of comm itself, or of a library's duplicate of it
    # (DOLFINx: each mesh's, and each IndexMap's), which Python sees only there.
    where = MPI.Intracomm(ocomm.tompi4py())
    if _PETSC is not None and inner is not None and MPI._handleof(where) == inner:
        return None
    if contains(MPI.Intracomm(comm), where):
        return where
    raise RegistrationError(
        f"this {_describe_object(obj)} lives on a communicator of size {osize} whose "
        f"processes are not all in the communicator of size {comm.Get_size()} it is being "
        f"registered on (MPI_Comm_compare: {relation(where, comm)}); pass comm= a "
        "communicator that contains every process of it: the one it was created on "
        "(obj.getComm().tompi4py() is PETSc's duplicate of that), or COMM_WORLD"
    )


def manage(owner: object, *objs: Any, comm: MPI.Comm, name: str | None = None) -> Registration:
    """Destroy petsc4py ``objs`` at a sync point on ``comm`` once ``owner`` has died.

    Collective over ``comm``, like :func:`collective_gc.register` (which it
    calls): every rank manages the same wrappers in the same order; a rank that
    does not makes the next sync point raise ``CollectiveMismatchError``.

    ``owner`` is the wrapper that holds the objects (a solver class, a cache
    entry); it may sit in reference cycles and die in either collector, on any
    rank, at any time: that only queues the destroy. The objects are destroyed
    with ``.destroy()``, last first, at the first sync point on ``comm`` at
    which every rank has queued them, on every rank in the same order. If one
    raises on any rank, every other destroy still runs and
    ``collective_gc.DestroyError`` is raised on every rank, naming the
    exception that made it fail; if it was a parallel object, PETSc's objects
    on ``comm`` may now differ between ranks, and later sync points on
    ``comm`` refuse to run, saying so. Destroying an object yourself before then is
    fine: petsc4py nulls its handle, and the managed destroy skips it.

    The objects must live on ``comm`` (the communicator they were created
    with), on a communicator congruent with it or a subset of it (a
    library's own duplicate, as each DOLFINx mesh and IndexMap has: PETSc
    keeps the objects on its inner duplicate of that), or be serial (size 1).
    Their destroys run at ``comm``'s sync points; PETSc's garbage on their own
    communicators is cleaned there too (those are reached as derived
    communicators). The registration keeps them alive until
    then, so they must not refer back to ``owner``: an application context,
    a callback that is a method of the owner or an attribute set with
    ``setAttr`` would keep the owner alive for ever (use a weak reference
    there). An object that already refers back to ``owner`` is refused
    with :class:`~collective_gc.RegistrationError`, naming the path; for a
    reference made later, :func:`immortal`, ``cgc.view``, the leak check and
    a warning at exit name such owners and the path back to them. Also
    installs the PETSc garbage hook on ``comm`` (see :func:`install`).
    Returns the registration (``.destroy()`` destroys now, collectively;
    ``.detach()`` leaves the objects to you).
    """
    if not objs:
        raise RegistrationError("collective_gc.petsc.manage() needs at least one petsc4py object")
    mgr = install(comm)
    inner = None if _PETSC is None else _PETSC.inner(comm)
    serial = True
    elsewhere: dict[int, MPI.Intracomm] = {}
    for obj in objs:
        where = _check(obj, comm, inner)
        if where is not None:
            elsewhere.setdefault(MPI._handleof(where), where)
        serial = serial and obj.getComm().getSize() == 1
    for where in elsewhere.values():
        # PETSc bins the garbage of these objects' other Python references
        # on their own communicator: clean it there too, at comm's sync
        # points, which reach it as a derived communicator.
        adopt(mgr, install(where))
    state = _SERIAL if serial else _STATES[mgr]
    # (The owner itself among objs is register()'s to refuse.) Most objects
    # have no Python attributes at all: nothing to walk.
    roots = [(type(obj).__name__, obj) for obj in objs if obj is not owner]
    path = None
    if any(gc.get_referents(obj) for _, obj in roots):
        path, _ = _path_to(roots, owner, 1000)
    if path is not None:
        raise RegistrationError(
            f"this {type(owner).__name__} is referred to by an object it hands to "
            f"collective_gc.petsc.manage() ({path}), and the registration holds that "
            "object until the owner dies, so it would never die; refer to the owner "
            "through a weakref.proxy there"
        )
    if name is None:
        name = type(owner).__name__
    if len(objs) == 1:
        return register(owner, _destroy_one, objs[0], state, comm=comm, name=name)
    return register(owner, _destroy_many, state, *objs, comm=comm, name=name)


# -- solves as sync points -----------------------------------------------------


def _solve(solver: Any, *args: Any) -> Any:
    return solver.solve(*args)


def solve(solver: Any, *args: Any, comm: MPI.Comm | None = None) -> Any:
    """Collective: ``solver.solve(*args)`` (a KSP or SNES), then a sync point.

    The sync point is the innermost open ``collective_scope`` of this thread
    (on ``comm``, if given), or ``cgc.collect(comm)`` with no scope open. So
    every rank must call it, as it must call the solve. If the solve raises,
    no sync point runs. For a wrapper class, decorating its own solve method
    with ``@collective_gc.sync_point`` does the same.
    """
    fn: Callable[..., Any] = sync_point(_solve, comm=comm)
    return fn(solver, *args)
