"""Managed derived communicators: ``dup`` and ``split``.

A communicator is itself a collective resource: freeing it is collective over
its group, and a program that duplicates one per solve and never frees them
runs out of communicators (Firedrake #2669: near 2,036 meshes). Python's GC
never frees an mpi4py communicator, and freeing one from a finalizer or an MPI
attribute delete callback is the hazard this library exists to remove.

``dup``/``split`` make the new communicator a registration on the parent's
manager, so it is freed at a sync point of the parent, in the agreed order,
once every rank has dropped it. The parent's sync points first visit each
derived communicator (in creation order, which is the same on every rank, so
ranks that share several derived communicators visit them in the same order
and ranks outside one skip it): they run a sync point of its manager, if it
has one, and free it once it has been dropped and nothing registered on it is
left. Otherwise it stays, and is tried again at the parent's next sync point.
"""

from __future__ import annotations

from mpi4py import MPI

from ._api import register
from ._destroy import Failure
from ._errors import CollectiveTimeoutError, DestroyError
from ._lookup import lookup, manager
from ._manager import Manager, Participant

__all__ = ["dup", "split", "derived"]

_CHILD_KEYVAL: list[int] = []


def _child_deleted(comm: MPI.Comm, keyval: int, record: _Derived) -> None:
    # An MPI attribute delete callback: record only, never call MPI here.
    record.handle_freed = True


def _keyval() -> int:
    if not _CHILD_KEYVAL:
        _CHILD_KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_child_deleted))
    return _CHILD_KEYVAL[0]


class _Derived:
    """This rank's record of one derived communicator of a parent manager."""

    __slots__ = ("handle", "label", "dropped", "released", "handle_freed", "__weakref__")

    def __init__(self, handle: MPI.Intracomm | None, label: str) -> None:
        # Our own wrapper of the handle: the user's object is the one whose
        # death we watch, so we must not hold it.
        self.handle = handle
        self.label = label
        self.dropped = False
        self.released = False
        self.handle_freed = False

    def drop(self) -> None:
        """The destroy of the user's communicator object: agreed, so every rank runs it."""
        self.dropped = True
        self._try_release()

    def visit(self, deadline: float | None) -> list[Failure]:
        """Collective over the derived communicator: sync its manager, free it if done."""
        failures: list[tuple[int, str, BaseException]] = []
        if self.handle is not None and not self.handle_freed:
            mgr = lookup(self.handle)
            # Only while something is registered on it, or it has participants
            # (PETSc's garbage cleanup): both are the same on every rank of
            # the derived communicator (registration and participants are
            # added collectively, destroys are agreed), so they all skip it alike.
            if mgr is not None and mgr.broken is None and (mgr.registered or mgr.participants):
                # Whatever this sync point raises becomes a failure of the
                # parent's sync point, which the parent's agreement tells every
                # rank of the parent (ranks outside this communicator too), so
                # they all raise together; raising here would leave the
                # parent's other ranks waiting in its header. A timeout still
                # propagates: the parent's other ranks have the same deadline.
                try:
                    mgr.sync(deadline=deadline)
                except DestroyError as exc:
                    failures.extend(
                        (key, f"{name} (on {self.label})", RuntimeError(msg))
                        for r, key, name, msg in exc.failures
                        if r == mgr.rank
                    )
                except CollectiveTimeoutError:
                    raise
                except BaseException as exc:  # an interrupt is re-raised by the parent, later
                    failures.append((-1, f"the sync point of {self.label}", exc))
        if self.dropped:
            self._try_release()
        try:
            return failures
        finally:
            del failures  # see _destroy.Failure

    def _try_release(self) -> None:
        handle = self.handle
        if handle is not None and not self.handle_freed:
            mgr = lookup(handle)
            if mgr is not None and mgr.registered:
                # Still in use. The count left is the same on every rank of
                # the derived communicator after its sync point (registration
                # is collective and destroys are agreed), so they all wait.
                return
            # Its manager, if any, is told by its attribute delete callback
            # and lets go of its private duplicate at the next safe point.
            handle.Free()
        self.handle = None
        self.released = True

    def __repr__(self) -> str:
        state = "released" if self.released else "dropped" if self.dropped else "in use"
        return f"<collective_gc derived communicator {self.label}: {state}>"


class _Children(Participant):
    """The communicators derived from one parent, visited at each of its sync
    points before the agreement (their resources are newer, and may have to
    go before one of the parent's can), in creation order."""

    def __init__(self) -> None:
        self.records: list[_Derived] = []
        self.made = 0

    def prepare(self, mgr: Manager, deadline: float | None) -> list[Failure]:
        failures: list[Failure] = []
        for record in list(self.records):
            failures.extend(record.visit(deadline))
        self.records = [r for r in self.records if not r.released]
        return failures

    def may_raise(self, flags: int) -> bool:
        return False

    def finish(self, mgr: Manager, flags: int) -> None:
        # Those dropped at this sync point were released by their destroys.
        self.records = [r for r in self.records if not r.released]


def _children(parent: Manager) -> _Children:
    for p in parent.participants:
        if isinstance(p, _Children):
            return p
    children = _Children()
    parent.add_participant(children)
    return children


def derived(comm: MPI.Intracomm) -> list[str]:
    """Labels of the derived communicators of ``comm`` not yet freed. Local."""
    mgr = lookup(comm)
    if mgr is None:
        return []
    return [r.label for p in mgr.participants if isinstance(p, _Children) for r in p.records]


def _adopt(
    children: _Children, new: MPI.Intracomm, comm: MPI.Intracomm, label: str
) -> MPI.Intracomm:
    member = new != MPI.COMM_NULL
    record = _Derived(MPI.Intracomm(new) if member else None, label)
    if member:
        new.Set_attr(_keyval(), record)
    children.records.append(record)
    children.made += 1
    try:
        register(new, record.drop, comm=comm, name=label)
    except BaseException:
        # Refused here (another thread registering at that moment, say):
        # nothing is left behind, the new communicator included.
        children.records.remove(record)
        if member:
            record.handle = None
            new.Free()
        raise
    return new


def dup(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective over ``comm``: a duplicate freed by collective_gc, not by you.

    When every rank has dropped the returned communicator, it is freed at a
    sync point of ``comm`` (after anything registered on it is destroyed),
    or at exit. Do not ``Free()`` it yourself while it is still registered
    (that would be seen and not freed twice, but it wastes nothing to let it be).
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    children = _children(parent)
    new = MPI.Intracomm(comm.Dup())
    return _adopt(children, new, comm, f"dup #{children.made} of a {parent.describe()}")


def split(comm: MPI.Intracomm, color: int, key: int = 0) -> MPI.Intracomm:
    """Collective over ``comm``: ``comm.Split(color, key)``, freed by collective_gc.

    As :func:`dup`. A rank that passes ``MPI.UNDEFINED`` gets ``MPI.COMM_NULL``
    (still registered, so the parent's keys stay the same on every rank).
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    children = _children(parent)
    new = MPI.Intracomm(comm.Split(color, key))
    label = f"split #{children.made} (color {color}) of a {parent.describe()}"
    return _adopt(children, new, comm, label)
