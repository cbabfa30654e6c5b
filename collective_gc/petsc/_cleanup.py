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
from collections.abc import Callable, Iterator

from mpi4py import MPI
from petsc4py import PETSc

from .._agree import FIELD_PETSC
from .._errors import ExitLeakWarning
from .._lookup import lookup, manager
from .._manager import Manager, State, open_family
from .._syncpoint import Participant
from . import _destroyers, _internals
from ._destroyers import FAILED as _FAILED
from ._destroyers import HAS_GARBAGE as _HAS_GARBAGE
from ._destroyers import SELF_GARBAGE as _SELF_GARBAGE
from ._destroyers import SELF_HANDLE as _SELF_HANDLE
from ._destroyers import comm_state
from ._internals import Unreadable
from ._keepers import keepers

SERIAL = comm_state(False)  # registrations of serial objects: a serial wreck disagrees with nobody
_INSTALLING = threading.Lock()


# The bits of PETSc's vote are CommState's (_destroyers). What each rank says
# of one installed communicator once some rank holds garbage (one more word
# per communicator, see _Cleanup._clean).
_HAS_INNER = 2  # this rank has PETSc's inner communicator for it
_LACKS_INNER = 4  # this rank does not


class _Cleanup(Participant):
    """PETSc's own garbage cleanup, at every sync point of one family: on
    each of its communicators :func:`install` ran on (PETSc bins garbage per
    communicator: a family's members each have theirs)."""

    field = FIELD_PETSC

    def __init__(self) -> None:
        # With nothing voted (no garbage anywhere, no failure), nothing to do;
        # unless PETSc's garbage cannot be read here: then every sync point cleans.
        self.quiet_finish = _internals.READER is not None
        # The installed members, in the order install ran on them (the same on
        # every rank: install is collective), each with its communicator's
        # handle read at install (the vote's reads); weak, so that the
        # family's participants never keep a manager alive. One tuple,
        # rebound in one store by its two writers (install, and the votes'
        # _look_at, on any thread) under the lock: a reader takes it whole.
        self.installed: tuple[tuple[weakref.ref[Manager], int], ...] = ()
        self.lock = threading.Lock()
        self.state = comm_state(True)

    def add(self, mgr: Manager) -> None:
        """Clean ``mgr``'s communicator too. Collective (install)."""
        with self.lock:
            if all(ref() is not mgr for ref, _ in self.installed):
                self.installed += ((weakref.ref(mgr), MPI._handleof(mgr.comm)),)
        self._look_at()

    def members(self) -> list[Manager]:
        """The installed communicators still in use (not freed: collectively,
        so alike on every rank). Local."""
        out = []
        for ref, _ in self.installed:
            mgr = ref()
            if mgr is not None and not mgr.comm_freed and mgr.state is not State.RELEASED:
                out.append(mgr)
        return out

    def _look_at(self) -> None:
        # Forget the members freed (collectively, so on every rank alike: a
        # freed one's handle is dead, and MPI may reuse it) or gone, and give
        # the state the handles of the others, which its vote reads. Run at
        # install and by every vote of the steps (each sync point after a
        # member's free), so the lists hold the members in use, not every one
        # a long run installed (a DOLFINx loop installs a mesh's at each step).
        with self.lock:
            kept = tuple(
                (ref, handle)
                for ref, handle in self.installed
                if (member := ref()) is not None and not member.comm_freed
            )
            if len(kept) != len(self.installed):
                self.installed = kept
            handles = tuple(handle for _, handle in kept)
            if handles != self.state.members:
                self.state.set_members(handles)

    def vote(self, mgr: Manager) -> int:
        """This rank's vote: whether it holds garbage (on an installed
        communicator, on COMM_SELF) and saw a managed destroy fail (see
        CommState.vote). Local. The sync point's steps call this, which
        first tells the state which members are still in use; the steady
        state calls the state's vote itself (:meth:`voter`): it runs only
        when no member was freed since the steps last ran (a freed member's
        family leaves the steady state until its next sync point's steps)."""
        self._look_at()
        return self.state.vote(mgr.sync_count)

    def voter(self, mgr: Manager) -> Callable[[int], int]:
        return self.state.vote

    def may_raise(self, flags: int) -> bool:
        """A cleanup's failure is reported like a failed destroy's: by the
        family's next agreement (it is kept in the vote, _FAILED, too)."""
        return False

    def finish(self, mgr: Manager, flags: int) -> None:
        """Collective over the family: clean PETSc's garbage on its installed
        communicators that hold some, and on COMM_SELF.

        ``PETSc.garbage_cleanup`` is itself collective and not free even with
        nothing to clean, so it runs only on a communicator where the agreed
        vote (carried in the sync point's own collectives, taken again after
        its destroys when a cleanup is due) says some rank holds garbage and
        every rank has PETSc's inner communicator. Once some rank holds garbage,
        one more word per installed communicator says which, and whether a
        rank lacks the inner one there.

        If a managed PETSc destroy raised on any rank, PETSc's objects of the
        family may differ between ranks (the wreck, and PETSc's inner
        communicator with it, survive where it failed), and any later
        collective PETSc call on it may hang: the family is made unusable on
        every rank, with that explanation, and nothing is cleaned there.
        """
        votes = self.votes(flags)
        self._look_at()  # (a stale state voted garbage: see CommState.vote)
        reader = _internals.READER
        try:
            members = self.members()
            if mgr.size > 1 and votes & _FAILED:
                _refuse(mgr)  # nothing collective on it any more
            elif reader is None:
                _clean_each(members)  # cannot look: clean every member (every rank alike)
            elif mgr.size == 1:
                self.state.forgive()  # one rank: nothing can differ between ranks
                for member in members:
                    if not member.comm_freed and _look(member) & _HAS_GARBAGE:
                        PETSc.garbage_cleanup(member.comm)
            elif votes & _HAS_GARBAGE:
                self._clean(mgr, members, votes)
            if reader is None:
                # (Not the same one twice.)
                if all(m.comm_freed or m.comm != MPI.COMM_SELF for m in members):
                    PETSc.garbage_cleanup(MPI.COMM_SELF)
            elif votes & _SELF_GARBAGE and _self_garbage():
                # Rank-local, but only when the vote said so: then every rank
                # knows to look. Garbage made since the vote waits for the next
                # sync point.
                PETSc.garbage_cleanup(MPI.COMM_SELF)
        except BaseException:
            self.state.failure()  # the next vote says so: the family is refused then
            raise

    def _clean(self, mgr: Manager, members: list[Manager], votes: int) -> None:
        # Some rank holds garbage on some installed communicator: one word per
        # communicator (ORed) says which, and whether a rank lacks PETSc's
        # inner communicator there (a cleanup would make one on some ranks
        # only: a hang). Looked at now, after the destroys, not at the vote:
        # a destroy the user registered (no hold, see CommState's NOTE) that
        # fails on some ranks only frees the inner communicator on the others.
        # (Over a member still in use: the participant's own may be freed,
        # and any member's collectives are the family's.)
        if not members:
            return
        looked = members[0].reduce_or([_look(m) for m in members])
        due = []
        for member, seen in zip(members, looked):
            if seen & _HAS_GARBAGE and not seen & _LACKS_INNER:
                due.append(member)
            elif seen & _HAS_GARBAGE and seen & _HAS_INNER:
                _warn_split_state(member)
        _clean_each(due)

    def view_rows(self, mgr: Manager) -> Iterator[tuple[str, str]]:
        """PETSc's garbage on ``mgr.comm`` (and on COMM_SELF), and owners that can never die."""
        return _view_rows(mgr)

    def leak_reasons(self, mgr: Manager) -> list[str]:
        return keepers(mgr)


# What each rank says before each cleanup of _clean_each after the first
# (ORed over the ranks).
_STOP = 1  # a cleanup of this loop raised on this rank
_FREED = 2  # this member's communicator is freed here
_LIVE = 4  # it is not


def _clean_each(members: list[Manager]) -> None:
    """``PETSc.garbage_cleanup`` on each of ``members`` (agreed, in the same
    order on every rank), each collective over its member's communicator.
    Collective over the family.

    Whether each further cleanup runs is agreed first, in one word over the
    family: a cleanup that raised on one rank only (a destroy PETSc runs
    failed there) leaves that rank's PETSc objects, and maybe its inner
    communicators, unlike the others', and a rank that went on to the next
    cleanup while another left the loop would wait in it for ever. So
    after a failure anywhere, no rank starts another cleanup (the failure
    is in the vote: the family is refused at its next sync point). And a
    member is passed over on every rank if an earlier cleanup of the loop
    freed its communicator on any (PETSc's inner communicator of one member
    can be another member, which the first's cleanup frees with its last
    object; freed on some ranks only if PETSc's state was split already:
    then warned of). Its cost: one word per cleanup after the first, only
    when a sync point cleans two communicators or more."""
    for i, member in enumerate(members):
        if i:
            word = members[0].reduce_or([_FREED if member.comm_freed else _LIVE])[0]
            if word & _STOP:
                return
            if word & _FREED:
                if word & _LIVE:
                    _warn_split_state(member)
                continue
        try:
            PETSc.garbage_cleanup(member.comm)
        except BaseException:
            if i + 1 < len(members):
                members[0].reduce_or([_STOP])  # the word the others wait for
            raise


def _look(member: Manager) -> int:
    """This rank's vote bits for one installed communicator. Local."""
    garbage = _destroyers.garbage
    assert garbage is not None
    found = garbage(MPI._handleof(member.comm))
    if found == -1:
        return _LACKS_INNER
    # Unreadable (-2): say there is garbage (an empty cleanup is harmless).
    return _HAS_INNER | (_HAS_GARBAGE if found else 0)


def cleanup_of(mgr: Manager) -> _Cleanup | None:
    """The cleanup participant of ``mgr``'s family, if :func:`install` ran on it. Local."""
    found = mgr.participant(_Cleanup)
    return found if isinstance(found, _Cleanup) else None


def _self_garbage() -> bool:
    """Whether this rank holds PETSc garbage on COMM_SELF. Local."""
    if not _internals.SERIAL_DELAYED:
        return False  # PETSc destroys serial objects at once: COMM_SELF's map stays empty
    # Look first: an empty cleanup of COMM_SELF is not free (PETSc
    # duplicates and frees an inner communicator to find nothing). No inner
    # communicator (-1), or an empty map: none; unreadable (-2): say there is.
    garbage = _destroyers.garbage
    return garbage is not None and garbage(_SELF_HANDLE) not in (-1, 0)


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


def _view_rows(mgr: Manager) -> Iterator[tuple[str, str]]:
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

    From then on each sync point of ``comm``'s family (``cgc.collect``, a
    scope's sync or exit, a solve made a sync point, on ``comm`` or on a
    communicator congruent with it: they share sync points) ends with
    ``PETSc.garbage_cleanup(comm)`` when any rank holds PETSc garbage on
    ``comm``, and cleans this rank's ``COMM_SELF`` garbage; ``cgc.view(comm)``
    lists PETSc's entries, and it and the pytest plugin's leak check name
    managed owners that can never die (see :func:`immortal`). ``comm``
    defaults to ``COMM_WORLD``. :func:`manage` calls it for you. Idempotent.

    Call it on every rank of ``comm``: the cleanup is collective, so a rank
    without the hook would skip it while the others wait for it (it may also
    make ``comm``'s first collective).
    """
    mgr = manager(MPI.COMM_WORLD if comm is None else comm)
    open_family(mgr)  # its family's participant, if another communicator of it installed
    with _INSTALLING:  # one participant per family, whichever threads install
        cleanup = cleanup_of(mgr)
        if cleanup is None:
            cleanup = _Cleanup()
            _INSTALLED.add(cleanup)
        # On each installed member (again if another member installed it: the
        # family's cleanup then outlives whichever of them is freed first).
        mgr.add_participant(cleanup)
        cleanup.add(mgr)
    return mgr


_INSTALLED: weakref.WeakSet[_Cleanup] = weakref.WeakSet()


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
    says them at exit. Only communicators whose family :func:`install` (or
    :func:`manage`) ran on are looked at.
    """
    mgr = lookup(comm)  # (a question: no manager is made for it)
    return keepers(mgr) if mgr is not None and cleanup_of(mgr) is not None else []


def _warn_immortal_at_exit() -> None:
    # Runs before collective_gc's own exit handler (registered after it), and
    # only looks: no MPI call, no destroy.
    for cleanup in list(_INSTALLED):
        for ref, _ in cleanup.installed:
            mgr = ref()
            if mgr is None:
                continue
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
