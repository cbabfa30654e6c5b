"""h5py adapter: parallel HDF5 files closed at sync points.

A file opened with the MPI driver (``h5py.File(path, mode, driver="mpio",
comm=comm)``) is closed by ``H5Fclose``, which is collective over the file's
communicator; h5py calls it when the last Python reference to the file goes.
Under plain GC that is whenever one rank's collector frees the step that held
it, while the other ranks are elsewhere: a loop that leaves its file in a
reference cycle hangs (issue 33: at step 1 to 2, 3 runs of 3). And HDF5 closes
a file opened with the MPI driver only once nothing in it is open: if the file
object goes before a Dataset of it, h5py can only print "Exception ignored in
ObjectID.__dealloc__", the file stays open, and it is unreadable afterwards
(``collective_gc.keep(self, dset, f)`` did that to 200 files of 200, while
``keep(self, f, dset)`` worked). ``keep`` therefore refuses h5py objects.

:func:`manage` registers the owner of h5py objects; once it has died on every
rank, their files are closed explicitly at the agreed sync point, every rank
in the same order, with h5py's ``File.close``: it closes what is still open in
the file first (datasets, groups, attributes, named types, whichever Python
object opened them), then the file. So the order of the objects given does not
matter, nor do references to them that survive elsewhere (they become
invalid, as after any ``File.close``). A close that raises, or during which a
destructor reports an error it can only print (see
``collective_gc._keep``), fails the destroy: ``DestroyError`` on every rank.

This is the only module of collective_gc that imports h5py.
"""

from __future__ import annotations

from typing import Any

import h5py
from mpi4py import MPI

from ._errors import RegistrationError, call_each
from ._keep import check_resources, hold, reporting_unraisable
from ._registration import Registration

__all__ = ["manage", "close"]


# Files whose close failed, held for the rest of the process: HDF5 1.10.8
# crashes (SIGSEGV, in H5F__close_cb) when the last reference to such a file
# goes, which would be inside the sync point, on that rank alone, before its
# DestroyError could reach any rank. It crashes at exit all the same.
_UNCLOSED: list[Any] = []


def _close_one(f: Any) -> None:
    if not f.id.valid:  # closed already (by the user, or as another object's file)
        return
    try:
        f.close()
    except BaseException:
        _UNCLOSED.append(f)
        raise


def close(*files: Any) -> None:
    """Collective over each file's communicator: close ``files``, in order,
    each with what is still open in it first (h5py's ``File.close``).

    A file closed already is skipped. Every file is tried even if one fails;
    the first exception is then raised (the others as its notes). A file
    whose close failed is held until the process ends: with HDF5 1.10.8,
    releasing it crashes the process (and so does the exit, when HDF5 closes
    what is left). An error
    that a destructor could only print meanwhile, on this thread, raises
    RuntimeError. Every process that opened a file must call it: a rank that
    skips it leaves the others blocked in ``H5Fclose``.
    """
    reporting_unraisable("closing h5py files", call_each, files, _close_one)


def _file_of(obj: Any, i: int) -> Any:
    if isinstance(obj, h5py.AttributeManager):
        raise RegistrationError(
            f"object {i} given to collective_gc.h5py.manage is an AttributeManager "
            "(.attrs): pass the object it belongs to, or its file"
        )
    if not isinstance(obj, h5py.HLObject):
        raise RegistrationError(
            f"collective_gc.h5py.manage() manages h5py files and what is in them "
            f"(File, Group, Dataset, Datatype), not a {type(obj).__name__!r} object "
            f"(object {i}; use collective_gc.keep or register for other resources)"
        )
    if not obj.id.valid:
        raise RegistrationError(
            f"the h5py {type(obj).__name__} given to collective_gc.h5py.manage (object "
            f"{i}) is closed already"
        )
    return obj if isinstance(obj, h5py.File) else obj.file


def manage(owner: object, *objects: Any, comm: MPI.Comm, name: str | None = None) -> Registration:
    """Collective over ``comm``: close the files of h5py ``objects`` at a sync
    point on ``comm`` once ``owner`` has died on every rank.

    ``objects`` are h5py Files, or Groups, Datasets and named Datatypes of
    them, in any order: each one's file is closed, with everything still
    open in it, when the destroy runs (see :func:`close`), on every rank in
    the agreed order. Open the files on ``comm`` (``driver="mpio",
    comm=comm``), on a communicator congruent with it, or without the MPI
    driver (a rank's own file: closing it at a sync point is harmless).
    Every rank manages the same owners in the same order, as with
    :func:`collective_gc.register`. The registration holds the files until
    then (so they stay open while only it refers to them): ``owner`` may
    keep them as attributes, and references that survive elsewhere see a
    closed file afterwards.

    ``owner`` is what the objects belong to (a step, a writer class); it may
    die in either collector, on any rank, at any time: that only queues the
    close. As with :func:`collective_gc.keep`, ``owner`` must have a
    ``__dict__``, and one whose ``__del__`` resurrects it keeps its files
    open until it dies again. If a close raises, or a destructor reports an
    error it can only print while the files are closed, every other agreed
    destroy still runs and :class:`~collective_gc.DestroyError` is raised on
    every rank. Refused with :class:`~collective_gc.RegistrationError`,
    before anything is registered: no objects, an object that is not an
    h5py File, Group, Dataset or Datatype, one that is closed already, one
    that refers to the owner. Returns the registration (``.destroy()``
    closes now, collectively; ``.detach()`` leaves the files to you).
    """
    if not objects:
        raise RegistrationError("collective_gc.h5py.manage() needs at least one h5py object")
    check_resources(owner, objects, "collective_gc.h5py.manage")
    files = [_file_of(obj, i) for i, obj in enumerate(objects)]
    return hold(owner, close, *files, comm=comm, name=name or f"{type(owner).__name__} (h5py)")
