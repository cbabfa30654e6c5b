"""PETSc's garbage cleanup at collective_gc's sync points: the participant, install, views.

:func:`install` adds to a communicator's manager the participant that
votes (locally: PETSc's garbage and inner communicator, read through
:mod:`._internals`) and, once the vote is agreed, runs
``PETSc.garbage_cleanup`` on every rank alike, or refuses every later sync
point where a managed PETSc destroy failed on some rank; and the view and
leak hooks that show PETSc's garbage and the owners that never die.
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Iterator

from mpi4py import MPI
from petsc4py import PETSc

from .._agree import FIELD_PETSC
from .._errors import ExitLeakWarning
from .._lookup import manager
from .._manager import Manager
from .._syncpoint import Participant
from . import _internals
from ._destroyers import CommState
from ._internals import Unreadable
from ._keepers import keepers

# One per installed manager. Registrations of serial objects get SERIAL: a
# serial wreck cannot make the ranks disagree about anything collective.
STATES: weakref.WeakKeyDictionary[Manager, CommState] = weakref.WeakKeyDictionary()
SERIAL = CommState()
_INSTALLING = threading.Lock()


# The bits of PETSc's vote (ORed over the ranks).
_HAS_GARBAGE = 1  # this rank holds PETSc garbage on the communicator
_HAS_INNER = 2  # this rank has PETSc's inner communicator for it
_LACKS_INNER = 4  # this rank does not
_FAILED = 8  # a managed PETSc destroy raised on this rank
_SELF_GARBAGE = 16  # this rank holds PETSc garbage on COMM_SELF


class _Cleanup(Participant):
    """PETSc's own garbage cleanup, at every sync point of one communicator."""

    field = FIELD_PETSC

    def vote(self, mgr: Manager) -> int:
        """This rank's vote: whether it holds garbage (on the communicator, on
        COMM_SELF), has PETSc's inner communicator, and saw a managed destroy
        fail. Local."""
        reader = _internals.READER
        state = STATES.get(mgr)
        failed = _FAILED if state is not None and state.failed > 0 else 0
        if reader is None:
            return failed
        mine = failed | (_SELF_GARBAGE if _self_garbage() else 0)
        # No look once the user's communicator is freed (collectively, so on
        # every rank alike): its handle is dead.
        if mgr.comm_freed:
            return mine
        found = reader.garbage(MPI._handleof(mgr.comm))
        if found == -1:
            return mine | _LACKS_INNER
        # Unreadable (-2): say there is garbage (an empty cleanup is harmless).
        return mine | _HAS_INNER | (_HAS_GARBAGE if found else 0)

    def may_raise(self, flags: int) -> bool:
        """Whether a cleanup (its destroys may raise on some ranks only) runs."""
        votes = self.votes(flags)
        if _internals.READER is None or votes & _SELF_GARBAGE:
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
        if _internals.READER is None:
            if mgr.comm_freed or mgr.comm != MPI.COMM_SELF:  # unlooked: not the same one twice
                PETSc.garbage_cleanup(MPI.COMM_SELF)
        elif votes & _SELF_GARBAGE and _self_garbage():
            # Rank-local, but only when the vote said so: then every rank
            # knows a cleanup may raise (see may_raise). Garbage made since
            # the vote waits for the next sync point.
            PETSc.garbage_cleanup(MPI.COMM_SELF)

    def _clean(self, mgr: Manager, votes: int) -> None:
        # The communicator's own garbage (not freed, so its handle is live).
        reader = _internals.READER
        comm = mgr.comm
        if mgr.size > 1 and votes & _FAILED:
            _refuse(mgr)  # nothing collective on comm any more
        elif reader is None:
            PETSc.garbage_cleanup(comm)  # cannot look: clean unconditionally (every rank alike)
        elif mgr.size > 1:
            if votes & _HAS_GARBAGE and not votes & _LACKS_INNER:
                PETSc.garbage_cleanup(comm)
            elif votes & _HAS_GARBAGE and votes & _HAS_INNER:
                _warn_split_state(mgr)
        else:
            state = STATES.get(mgr)
            if state is not None:
                state.failed = 0  # one rank: nothing can differ between ranks
            if reader.garbage(MPI._handleof(comm)) not in (-1, 0):  # see vote
                PETSc.garbage_cleanup(comm)


def _self_garbage() -> bool:
    """Whether this rank holds PETSc garbage on COMM_SELF. Local."""
    reader = _internals.READER
    if reader is None or not _internals.SERIAL_DELAYED:
        return False  # PETSc destroys serial objects at once: COMM_SELF's map stays empty
    # Look first: an empty cleanup of COMM_SELF is not free (PETSc
    # duplicates and frees an inner communicator to find nothing). No inner
    # communicator (-1), or an empty map: none; unreadable (-2): say there is.
    return reader.garbage(MPI._handleof(MPI.COMM_SELF)) not in (-1, 0)


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
    for line in keepers(mgr):
        yield "never dies", line
    reader = _internals.READER
    if reader is None:
        return
    try:
        inner = reader.inner(mgr.comm)
        if inner is not None:
            for cidx, cls in reader.entries(inner):
                yield cls, f"PETSc garbage #{cidx}"
        self_inner = reader.inner(MPI.COMM_SELF)
        if self_inner is not None and self_inner != inner:
            for cidx, cls in reader.entries(self_inner):
                yield cls, f"PETSc garbage #{cidx} (COMM_SELF)"
    except Unreadable as exc:
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
    if mgr not in STATES:
        with _INSTALLING:  # one state per manager, whichever threads install
            if mgr not in STATES:
                mgr.add_participant(_Cleanup())
                mgr.add_view_hook(_view_hook)
                mgr.add_leak_hook(keepers)
                STATES[mgr] = CommState()  # last: seen installed only once it is
    return mgr


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
    return keepers(mgr) if mgr in STATES else []


def _warn_immortal_at_exit() -> None:
    # Runs before collective_gc's own exit handler (registered after it), and
    # only looks: no MPI call, no destroy.
    for mgr in list(STATES.keys()):
        try:
            lines = keepers(mgr)
        except Exception:  # a diagnostic must never break the exit
            continue
        for line in lines:
            warnings.warn(
                f"collective_gc: rank {mgr.rank}: on the {mgr!r} at exit: {line}",
                ExitLeakWarning,
                stacklevel=1,
            )


atexit.register(_warn_immortal_at_exit)
