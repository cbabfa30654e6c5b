"""``keep``: collective resources that are not PETSc objects or MPI handles.

An open ``dolfinx.io.XDMFFile`` closes HDF5 collectively in its C++
destructor, and a C++ mesh frees its communicator there: whichever rank's
collector drops the last Python reference runs that collective alone, while
the other ranks are elsewhere (issue 22: the loop hung at step 2-3). ``keep``
holds the last references itself, in a box that the registration's destroy
empties at the agreed sync point, on every rank in the agreed order: the
destructors run there, and nowhere else.
"""

from __future__ import annotations

from mpi4py import MPI

from ._api import register
from ._registration import Registration

__all__ = ["keep"]


def _drop(box: list[object]) -> None:
    # Emptying the box drops what may be the last references: the resources'
    # own destructors (collective ones included) run here, at the sync point.
    box.clear()


def keep(
    owner: object, *resources: object, comm: MPI.Comm, name: str | None = None
) -> Registration:
    """Collective over ``comm``: hold ``resources`` until ``owner`` has died
    on every rank, then drop them at a sync point of ``comm``, in the agreed order.

    For resources whose destructor is collective and that have no destroy
    call of their own to register (an open ``dolfinx.io.XDMFFile`` or
    ``VTXWriter``, a C++ mesh, an h5py file opened with the MPI driver):
    once this registration holds them, let go of every other reference
    (``owner`` may keep them as attributes: those go with it). The resources
    are dropped last first, when the destroy runs; if a reference survives
    elsewhere, its destructor runs when that one goes instead. Calls
    :func:`collective_gc.register` (same rules: every rank keeps the same
    things in the same order; a resource must not refer back to ``owner``).
    """
    box = list(resources)  # list.clear drops from the end: the last resource goes first
    return register(owner, _drop, box, comm=comm, name=name or f"{type(owner).__name__} (kept)")
