"""mpi4py adapter: windows and files released at sync points, and managed communicators.

``MPI_Win_free`` synchronizes every process of the window's group, and
``MPI_File_close`` is collective over the file's group: called from a
finalizer on whichever rank's collector happens to run, either hangs (see
``examples/naive_deadlock.py``). mpi4py never frees a handle when its Python
object dies, so without help these leak or get freed from ``__del__``.

:func:`manage` registers the wrapper that owns such handles; they are released
at the agreed sync point once every rank has dropped it. The ready-made
destroys, :func:`free_win` and :func:`close_file`, null the Python object's
handle *before* the collective call, so that whatever happens next (a second
call, an explicit ``Free()`` by the user, the call raising half-way) never
releases the same handle twice.

For duplicated and split communicators use :func:`dup` and :func:`split` (the
core's, re-exported here): they are registered on their parent's manager and
freed at its sync points, after whatever was registered on them.
"""

from __future__ import annotations

import ctypes
from typing import Any

from mpi4py import MPI

from ._api import register
from ._comms import dup, split
from ._errors import RegistrationError, call_each
from ._registration import Registration

__all__ = ["manage", "free_win", "close_file", "release", "dup", "split"]

Handle = MPI.Win | MPI.File


def _null_in_place(obj: Any, null: Any) -> None:
    # mpi4py 3.1 has no public way to null a handle without freeing it;
    # _addressof gives where the object stores its MPI handle (it exists for
    # ctypes/cffi interop), and the null handle's bits are _handleof(null).
    size = MPI._sizeof(obj)
    ctype = ctypes.c_void_p if size == ctypes.sizeof(ctypes.c_void_p) else ctypes.c_int
    ctype.from_address(MPI._addressof(obj)).value = MPI._handleof(null)


def free_win(win: MPI.Win) -> None:
    """Collective over the window's group: free it; a second call does nothing.

    The handle of ``win`` is set to ``MPI.WIN_NULL`` first, then a private copy
    is freed: if the free raises, the handle is never freed again. Every
    process of the window's group must call it (``MPI_Win_free`` waits for all
    of them): a rank that skips it leaves the others blocked in it.
    """
    if win == MPI.WIN_NULL:
        return
    mine = MPI.Win(win)
    _null_in_place(win, MPI.WIN_NULL)
    mine.Free()


def close_file(fh: MPI.File) -> None:
    """Collective over the file's group: close it; a second call does nothing.

    As :func:`free_win`: the handle is nulled first. Every process that
    opened the file must call it (``MPI_File_close`` is collective); a rank
    that skips it leaves the others blocked.
    """
    if fh == MPI.FILE_NULL:
        return
    mine = MPI.File(fh)
    _null_in_place(fh, MPI.FILE_NULL)
    mine.Close()


def release(*handles: Handle) -> None:
    """Collective: :func:`free_win` / :func:`close_file` each handle, last first.

    Every handle is released even if one raises; the first exception is then
    raised. Called on every rank of the handles' groups, like each release.
    """
    call_each(reversed(handles), _release_one)


def _release_one(h: Handle) -> None:
    if isinstance(h, MPI.Win):
        free_win(h)
    else:
        close_file(h)


def _check(h: object, comm: MPI.Comm) -> None:
    if not isinstance(h, (MPI.Win, MPI.File)):
        raise RegistrationError(
            f"collective_gc.mpi.manage() manages MPI.Win and MPI.File handles, not a "
            f"{type(h).__name__!r} object (for communicators use collective_gc.dup/split)"
        )
    if h == MPI.WIN_NULL or h == MPI.FILE_NULL:
        raise RegistrationError(f"this {type(h).__name__} handle is null (already freed or closed)")
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise RegistrationError(
            f"comm must be the mpi4py intracommunicator the {type(h).__name__} was made on, "
            f"not {comm!r}"
        )
    mine = h.Get_group()
    try:
        theirs = comm.Get_group()
        try:
            same = MPI.Group.Compare(mine, theirs) == MPI.IDENT
            size = mine.Get_size()
        finally:
            theirs.Free()
    finally:
        mine.Free()
    if not same:
        raise RegistrationError(
            f"this {type(h).__name__} belongs to a group of {size} processes that is not the "
            f"group of the communicator (size {comm.Get_size()}) it is being registered on; "
            "pass the communicator it was created on, so that every process of its group "
            "takes part in the sync point that releases it"
        )


def manage(
    owner: object, *handles: Handle, comm: MPI.Comm, name: str | None = None
) -> Registration:
    """Release MPI windows and files at a sync point on ``comm`` once ``owner`` has died.

    Collective over ``comm``, like :func:`collective_gc.register` (which it
    calls): every rank manages the same owners in the same order. When
    ``owner`` dies (either collector, any rank, any time) the release is only
    queued; at the first sync point on ``comm`` at which every rank has queued
    it, the handles are released (:func:`free_win`, :func:`close_file`), last
    first, on every rank in the same order. Releasing a handle yourself first
    is fine through the object you managed (``win.Free()``): its handle is
    then null, and the managed release skips it. Not through another Python
    object for the same handle (``MPI.Win.fromhandle``, ``MPI.Win(win)``):
    the managed object still holds the old value, and releasing a freed
    handle is erroneous (an MPI may have given its value to a new object).

    Each handle's group must be that of ``comm`` (create the window or open the
    file on ``comm``, or register it on the communicator it was made on).
    """
    if not handles:
        raise RegistrationError("collective_gc.mpi.manage() needs at least one MPI.Win or MPI.File")
    for h in handles:
        _check(h, comm)
    if name is None:
        name = type(owner).__name__
    if len(handles) == 1:
        h = handles[0]
        return register(
            owner, free_win if isinstance(h, MPI.Win) else close_file, h, comm=comm, name=name
        )
    return register(owner, release, *handles, comm=comm, name=name)
