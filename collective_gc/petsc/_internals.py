"""What collective_gc.petsc reads of PETSc's internals, through ctypes. Local, read-only.

Which PETSc and petsc4py releases the layouts below were read for
(:data:`CHECKED`), and :class:`Internals`: PETSc's inner communicator of a
user's one and the garbage map attached to it. Nothing here sends a message
or changes PETSc's state. :data:`READER` is None where the release is not
one of those or the build does not export what the reading needs: then
callers read nothing (they look it up at each use, so a test may set it).
"""

from __future__ import annotations

import ctypes
from typing import Any

import petsc4py
from mpi4py import MPI
from petsc4py import PETSc

# What collective_gc.petsc relies on beyond petsc4py's public API was read in PETSc's
# and petsc4py's sources of every release from 3.18 to 3.24: the garbage map
# (a khash table of PetscInt64 creation index to PetscObject, attached to
# PETSc's inner communicator under Petsc_Garbage_HMap_keyval) and the
# destroy() methods of the classes _destroyers.fast_types() lists (XDestroy on the
# handle slot that PyPetscObject_GetPtr returns, nothing else). Outside that
# range neither is used: the view leaves PETSc's entries out, sync points
# clean PETSc's garbage unconditionally, and destroys are destroy() calls.
CHECKED = ((3, 18), (3, 24))


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


PETSC_RELEASE = tuple(PETSc.Sys.getVersion()[:2])
PETSC4PY_RELEASE = _release(petsc4py.__version__)


def checked(release: tuple[int, ...]) -> bool:
    return CHECKED[0] <= release <= CHECKED[1]


# Before 3.20, PETSc's delayed destroy parks serial objects too (in
# COMM_SELF's garbage); from 3.20 on it destroys them at once.
SERIAL_DELAYED = PETSC_RELEASE < (3, 20)


_UINTPTR_MASK = (1 << 8 * ctypes.sizeof(ctypes.c_void_p)) - 1


def comm_handle(raw: int, int_handles: bool) -> int:
    """The communicator PETSc keeps in an attribute (``raw``, the union of an
    MPI_Comm and a void*: an int handle is in its low 32 bits) as
    MPI._handleof gives handles, so that the two compare: the handle cast to
    an unsigned pointer-sized integer (an MPICH duplicate's int is below 0:
    its integer is above 2**63). ``int_handles``: MPI_Comm is an int (MPICH)."""
    if int_handles:
        return ctypes.c_int(raw & 0xFFFFFFFF).value & _UINTPTR_MASK
    return raw


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


class Internals:
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

    def keyvals(self) -> tuple[int, int, int]:
        """Where PETSc keeps its inner-communicator, counter and garbage
        keyvals (addresses: their values are read at each use, as PETSc sets
        them when it first needs them), for the C reads of the same."""
        return (
            ctypes.addressof(self._inner_kv),
            ctypes.addressof(self._counter_kv),
            ctypes.addressof(self._garbage_kv),
        )

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
        return comm_handle(raw, self._handle_t is ctypes.c_int)

    def inner(self, comm: MPI.Comm) -> int | None:
        """The handle of PETSc's inner communicator of ``comm``, or None if PETSc has none."""
        return self._inner_of(MPI._handleof(comm))

    def _inner_of(self, handle: int) -> int | None:
        raw = self._attr(handle, self._inner_kv)  # the common case first: one lookup
        if raw is not None:
            return self._to_handle(raw)
        if self._attr(handle, self._counter_kv) is not None:
            return handle  # the communicator is itself a PETSc inner one
        return None

    def garbage(self, handle: int) -> int:
        """How many garbage entries this rank holds on the PETSc inner
        communicator of the communicator ``handle`` (``MPI._handleof``); -1 if
        PETSc has no inner communicator for it, -2 if its garbage map is not
        laid out as this module knows. Local. ``self.garbage`` is this, or its
        Its C twin, where the extension is built, is
        ``collective_gc.petsc._destroyers.garbage``."""
        inner = self._inner_of(handle)
        if inner is None:
            return -1
        try:
            return self.count(inner)
        except Unreadable:
            return -2

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
            raise Unreadable(f"PETSc's garbage map at {table:#x} does not look like a khash table")
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


class Unreadable(RuntimeError):
    """PETSc's garbage map is not laid out as this module knows it."""


def load() -> Internals | None:
    """The reader for this PETSc, or None if its layout was not read or cannot be reached."""
    if not checked(PETSC_RELEASE):
        return None  # a layout we have not read: never guess at memory
    try:
        return Internals()
    except (OSError, AttributeError, ValueError):
        # A static or differently built PETSc: we cannot look, so we clean
        # unconditionally and the view leaves PETSc's entries out.
        return None


READER = load()
