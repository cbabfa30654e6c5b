"""The per-communicator manager: keys, the pending set, sync points, exit.

One :class:`Manager` per communicator, found through an MPI attribute cached
on the communicator, so every Python wrapper of the same handle gets the same
manager and a freed-then-reused handle does not. Agreement traffic goes over a
private duplicate of the communicator (made when the manager is), so it can
never match a user's message.

Registrations are collective: every rank registers the same objects in the
same order, so a per-manager counter gives each object the same key on every
rank. Finalizers push dead registrations onto a lock-free inbox; a sync point
drains the inbox into the pending set, agrees with the other ranks on the keys
pending everywhere (:mod:`._agree`), and destroys those newest first.
"""

from __future__ import annotations

import array
import atexit
import collections
import gc
import itertools
import operator
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
from mpi4py import MPI

from . import _agree, _reaper
from ._agree import (
    H_CHILD_ERRORS,
    H_COUNT,
    H_CYCLIC,
    H_LO,
    H_NEG_HI,
    H_NEG_NEXT,
    H_NEG_SEQ,
    H_NEXT,
    H_POLICY,
    H_SEQ,
    H_VOTE,
    NO_KEY,
)
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DestroyError,
    ExitLeakWarning,
    RegistrationError,
)
from ._queue import (
    _FLAGS,
    ALIVE,
    DESTROYED,
    DETACHED,
    SPEEDUPS,
    Registration,
    check_destroy,
    make_registration,
)

__all__ = ["Manager", "CollectStats", "manager", "register", "collect", "pending", "managers"]


class CollectStats(NamedTuple):
    """What one sync point did on this rank.

    Attributes:
        destroyed: destroys run at this sync point (the same on every rank).
        pending: destroy requests still queued on this rank afterwards (keys
            not yet queued on every rank).
        cyclic: finalizations drained at this sync point that happened inside
            the cyclic collector.
        seconds: wall time of the sync point on this rank, including the local
            ``gc.collect``.
        sync: the sync-point number on this communicator (0 for the first).
        collected: what the local ``gc.collect`` returned, or None if skipped.
    """

    destroyed: int
    pending: int
    cyclic: int
    seconds: float
    sync: int
    collected: int | None = None  # noqa: UP007 (evaluated at class creation on 3.9)


class _Child(Protocol):
    """A communicator derived from a manager's (see :mod:`._comms`)."""

    released: bool

    def visit(self, deadline: float | None) -> list[tuple[int, str, BaseException]]: ...


_ZEROS = array.array("q", bytes(8 * 64))
_IN_PLACE = MPI.IN_PLACE
_MAX = MPI.MAX
_new_tuple = tuple.__new__
_NO_KEYS = np.empty(0, dtype=np.int64)
_KEY_OF = operator.attrgetter("key")
_DESTROY_OF = operator.attrgetter("_destroy")
_ARGS_OF = operator.attrgetter("_args")
# Runs an iterator to its end, in C.
_consume: Callable[[Iterable[object]], None] = collections.deque[object](maxlen=0).extend
_repeat = itertools.repeat


# Destroy functions that can run a whole run of their calls at once (see
# set_batch), matched by identity: a destroy callable need not be hashable,
# nor compare sanely. Two parallel tuples, as _speedups.take_batch takes the
# first, replaced together in one store (a sync point reads them once).
_Batch = Callable[[list[tuple[Any, ...]]], list[tuple[int, BaseException]]]  # see set_batch
_BATCHES: tuple[tuple[Callable[..., object], ...], tuple[_Batch, ...]] = ((), ())


def set_batch(destroy: Callable[..., object], batch: _Batch | None) -> None:
    """Let sync points run consecutive destroys by ``destroy`` as one batch. Local.

    ``batch(argss)`` gets the argument tuples of consecutive calls to
    ``destroy``, in the agreed destroy order, and must do what calling
    ``destroy(*args)`` for each would do, in that order, trying every one even
    if some raise; it returns ``(index, exception)`` for those that raised.
    ``collective_gc.petsc`` uses it to destroy petsc4py objects from C.
    ``None`` removes it.
    """
    global _BATCHES
    pairs = [(f, b) for f, b in zip(*_BATCHES) if f is not destroy]
    if batch is not None:
        pairs.append((destroy, batch))
    _BATCHES = (tuple(f for f, _ in pairs), tuple(b for _, b in pairs))


_Taken = tuple[
    list[Registration],
    list[Callable[..., object]],
    list[tuple[Any, ...]],
    "list[tuple[int, int, int]] | None",
]


def _take_batch_py(
    regs: dict[int, Registration], keys: list[int], state: int, batched: tuple[object, ...]
) -> _Taken:
    """What ``_speedups.take_batch`` does, in C-level passes from Python.

    Pops first: a finalizer that runs meanwhile (any allocation may start the
    collector) and destroys a registration of the batch explicitly finds it
    either still in the dict (then it is gone when its turn comes) or
    already marked destroyed.
    """
    before = len(regs)
    popped = list(map(regs.pop, keys, _repeat(None)))
    if before - len(regs) != len(popped):  # some destroyed explicitly on every rank meanwhile
        popped = [r for r in popped if r is not None]
    taken = cast("list[Registration]", popped)
    _consume(map(setattr, taken, _repeat("_state"), _repeat(state)))
    fns = list(map(_DESTROY_OF, taken))
    argss = list(map(_ARGS_OF, taken))
    _consume(map(setattr, taken, _repeat("_destroy"), _repeat(None)))
    _consume(map(setattr, taken, _repeat("_args"), _repeat(())))
    if not fns:
        return taken, fns, argss, []
    ids = [id(f) for f in batched]
    if not ids or set(ids).isdisjoint(map(id, fns)):
        return taken, fns, argss, [(0, len(fns), -1)]
    segments: list[tuple[int, int, int]] = []
    start = 0
    for fid, group in itertools.groupby(map(id, fns)):
        end = start + sum(1 for _ in group)
        index = ids.index(fid) if fid in ids else -1
        if segments and index == -1 and segments[-1][2] == -1:
            segments[-1] = (segments[-1][0], end, -1)  # one run of unbatched calls
        else:
            segments.append((start, end, index))
        start = end
    return taken, fns, argss, segments


def _call_with(fn: Callable[..., object], args: tuple[Any, ...]) -> object:
    return fn(*args)


def _run_each_py(
    fns: list[Callable[..., object]], argss: list[tuple[Any, ...]]
) -> list[tuple[int, BaseException]]:
    """What ``_speedups.run_each`` does: ``fns[i](*argss[i])`` for each i, in order,
    every call made even if some raise; (index, exception) of those that raised.

    A call that raises stops map(); it resumes after the failed call, whose
    index the list iterator's remaining length gives.
    """
    errors: list[tuple[int, BaseException]] = []
    todo = iter(fns)
    rest = iter(argss)
    while True:
        try:
            _consume(map(_call_with, todo, rest))
            return errors
        except BaseException as exc:
            errors.append((len(fns) - operator.length_hint(todo) - 1, exc))


_take_batch: Callable[..., _Taken] = _take_batch_py if SPEEDUPS is None else SPEEDUPS.take_batch
_run_each: Callable[..., list[tuple[int, BaseException]]] = (
    _run_each_py if SPEEDUPS is None else SPEEDUPS.run_each
)


class Manager:
    """The collective deferred-destroy manager of one communicator.

    Get it with :func:`collective_gc.manager`; do not construct it.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self._size = comm.Get_size()
        self._rank = comm.Get_rank()
        # Agreement traffic never shares a communicator with the user's messages.
        # Never hold the user's own communicator object: it may be a managed
        # one (cgc.dup) whose death we are waiting for; hold a wrapper of the handle.
        self._comm = MPI.Intracomm(comm.Dup() if self._size > 1 else comm)
        self._next_key = 0
        # Every registration whose destroy has not run (object alive or dead).
        self._regs: dict[int, Registration] = {}
        # Finalizers append dead registrations here (list.append is atomic);
        # a sync point takes them in two C calls, however many there are.
        self._inbox: list[Registration] = []
        self._cyclic_inbox: list[Registration] = []
        # Keys drained and waiting for agreement, with the sync point at which
        # each was drained (its age, for view).
        self._pend = _NO_KEYS
        self._pend_seq = _NO_KEYS
        # Set when an explicit destroy or detach may have left a dead key in the
        # inbox or the pending keys: the next drain filters them.
        self._stale = False
        self._seq = 0
        self._lock = threading.RLock()
        self._destroying = False
        self._broken: str | None = None
        self._comm_freed = False
        self._forked = False
        # Totals over the manager's life.
        self.created = 0
        self.destroyed = 0
        self.cyclic = 0
        self.sync_seconds = 0.0
        self._user_comm = MPI.Intracomm(comm)
        # Adapter hooks (PETSc's own garbage cleanup, say); see add_sync_hook.
        self._sync_hooks: list[Callable[[Manager], None]] = []
        self._vote: Callable[[Manager], tuple[int, int]] | None = None
        # The hook vote's MAX over every rank at the last sync point (taken
        # after its destroys, if it ran any), and how many destroys it agreed
        # on (the same on every rank).
        self.votes: tuple[int, int] = (0, 0)
        self.last_agreed = 0
        # Communicators derived from this one with cgc.dup/cgc.split (see _comms),
        # in creation order, which is the same on every rank.
        self._children: list[_Child] = []
        # (type, name, key, origin) of the cyclic finalizations drained at the
        # last sync point, for strict mode's diagnostics.
        self.last_cyclic: list[tuple[str, str, int, traceback.StackSummary | None]] = []
        self._view_hooks: list[Callable[[Manager], Iterable[tuple[str, str]]]] = []

    # -- description ---------------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The user's communicator this manager was made for (not its private duplicate)."""
        return self._user_comm

    @property
    def comm_freed(self) -> bool:
        """True once the user's communicator was freed (the manager still works)."""
        return self._comm_freed

    def add_sync_hook(
        self,
        hook: Callable[[Manager], None],
        vote: Callable[[Manager], tuple[int, int]] | None = None,
    ) -> None:
        """Run ``hook(manager)`` at every sync point on this communicator.

        Collective: add it on every rank, since it runs on every rank at each
        sync point, after the agreed destroys and before any
        :class:`DestroyError` is raised, so it may make collective calls on
        :attr:`comm` (PETSc's garbage cleanup does). Adding the same hook again
        does nothing. A hook that raises does so on its rank only: keep hooks
        to calls that succeed or fail on every rank alike.

        ``vote(manager)`` (local, no MPI) returns two ints that ride in the
        sync point's own header allreduce; their MAX over every rank is in
        :attr:`votes` when the hook runs, so a hook can decide, the same way on
        every rank, whether it has work, without a collective of its own. One
        voting hook per manager.
        """
        if vote is not None:
            if self._vote is not None and self._vote is not vote:
                raise CollectiveGCError(f"the {self._describe()} already has a voting sync hook")
            self._vote = vote
        if hook not in self._sync_hooks:
            self._sync_hooks.append(hook)

    def add_view_hook(self, hook: Callable[[Manager], Iterable[tuple[str, str]]]) -> None:
        """Let :func:`collective_gc.view` show pending entries we do not manage.

        ``hook(manager)`` returns ``(type name, description)`` pairs for this
        rank (PETSc's own garbage, say). Local; must not make MPI calls.
        """
        if hook not in self._view_hooks:
            self._view_hooks.append(hook)

    @property
    def size(self) -> int:
        """Size of the communicator."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def sync_count(self) -> int:
        """How many sync points have completed on this communicator."""
        return self._seq

    @property
    def next_key(self) -> int:
        """The key the next registration will get."""
        return self._next_key

    def _describe(self) -> str:
        return f"communicator of size {self._size} (rank {self._rank})"

    def __repr__(self) -> str:
        state = " broken" if self._broken else ""
        return (
            f"<collective_gc.Manager{state} of a {self._describe()}: "
            f"{len(self._regs)} registered, {self._pend.size + len(self._inbox)} pending, "
            f"{self.destroyed} destroyed, {self._seq} sync points>"
        )

    # -- registration --------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if not (self._forked or self._destroying or self._broken is not None):
            return
        if self._forked:
            raise CollectiveGCError(
                f"cannot {what} in a forked child: the {self._describe()} and its "
                "registrations belong to the parent process"
            )
        if self._destroying:
            raise CollectiveGCError(
                f"cannot {what} from inside a destroy running at sync point "
                f"{self._seq} on the {self._describe()}; do it after the sync point"
            )
        if self._broken is not None:
            raise CollectiveGCError(
                f"cannot {what}: the {self._describe()} is unusable since {self._broken}"
            )

    def register(
        self,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
    ) -> Registration:
        """Collective. See :func:`collective_gc.register`."""
        if self._forked or self._destroying or self._broken is not None:
            self._check_usable("register an object")
        check_destroy(obj, destroy, args, kwargs)
        for ref in weakref.getweakrefs(obj):
            if isinstance(ref, Registration) and ref._owner is self and ref._state == ALIVE:
                raise RegistrationError(
                    f"this {type(obj).__name__!r} object is already registered on the "
                    f"{self._describe()} as key {ref.key} ({ref.name!r}); register one "
                    "destroy that releases all it owns, or detach the first registration"
                )
        reg = make_registration(
            obj, self, self._inbox.append, self._next_key, destroy, args, kwargs, name
        )
        self._next_key += 1
        self._regs[reg.key] = reg
        self.created += 1
        return reg

    def _retire(self, reg: Registration, state: int) -> None:
        # State first: a finalizer that runs after it pushes nothing; one that
        # ran before it left the object dead, which marks the queue stale.
        reg._state = state
        self._regs.pop(reg.key, None)
        if reg() is None:
            self._stale = True

    def _destroy_now(self, reg: Registration) -> None:
        with self._lock:
            if reg._state >= DESTROYED:
                return
            self._check_usable(f"destroy key {reg.key} ({reg.name!r})")
            self._retire(reg, DESTROYED)
            self.destroyed += 1
            reg._run()

    def _detach(self, reg: Registration) -> bool:
        with self._lock:
            if reg._state >= DESTROYED:
                return False
            self._retire(reg, DETACHED)
            reg._destroy, reg._args = None, ()
            return True

    def _votes_now(self) -> tuple[int, int]:
        # No vote once the user's communicator is freed (collectively, so on
        # every rank alike): a hook looking at it then would read a dead handle.
        if self._vote is None or self._comm_freed:
            return (0, 0)
        return self._vote(self)

    def _note_cyclic(self, reg: Registration) -> None:
        # Called by the finalizer inside the cyclic collector: append only.
        self._cyclic_inbox.append(reg)

    # -- the queue -------------------------------------------------------------

    def _drain(self) -> int:
        """Take the inbox into the pending keys; count and note cyclic finalizations."""
        cyc = self._cyclic_inbox
        cyclic = 0
        if cyc:
            nc = len(cyc)
            batch_c = cyc[:nc]
            del cyc[:nc]  # one C call: appends racing with it land after the slice
            for reg in batch_c:
                if reg._state == ALIVE:
                    cyclic += 1
                    self.last_cyclic.append((reg._typename, reg.name, reg.key, reg.origin))
            self.cyclic += cyclic
        inbox = self._inbox
        n = len(inbox)
        if n or self._stale:
            batch = inbox[:n]
            del inbox[:n]
            if self._stale:
                # Rare: explicit destroys or detaches of dead objects since the
                # last drain. Drop their keys, wherever they are.
                self._stale = False
                batch = [r for r in batch if r._state == ALIVE]
                regs = self._regs
                keep = np.fromiter((k in regs for k in self._pend.tolist()), bool, self._pend.size)
                self._pend, self._pend_seq = self._pend[keep], self._pend_seq[keep]
            if batch:
                new = np.fromiter(map(_KEY_OF, batch), np.int64, len(batch))
                self._pend = np.concatenate((self._pend, new))
                self._pend_seq = np.concatenate((self._pend_seq, np.full(new.size, self._seq)))
        return cyclic

    def pending(self) -> list[Registration]:
        """What this rank has queued, oldest key first. Local."""
        with self._lock:
            self._drain()
            regs = self._regs
            out = []
            for key, seq in sorted(zip(self._pend.tolist(), self._pend_seq.tolist())):
                reg = regs.get(key)
                if reg is not None:
                    reg.queued_at = seq
                    out.append(reg)
            return out

    def alive(self) -> list[Registration]:
        """Registrations whose objects are still alive on this rank. Local."""
        with self._lock:
            self._drain()
            return sorted((r for r in self._regs.values() if r() is not None), key=_KEY_OF)

    # -- sync points -----------------------------------------------------------

    def _what(self, stage: str) -> Callable[[], str]:
        # Formatted only on timeout, while the caller's frames are still on the
        # stack; extracting a stack at every sync point would cost more than
        # the agreement itself.
        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self._rank}: sync point {self._seq} on the {self._describe()} did "
                f"not complete {stage} before its deadline; called from:\n{where}"
            )

        return describe

    def sync(
        self,
        *,
        deadline: float | None = None,
        policy: Sequence[int] = (),
        on_header: Callable[[Sequence[int]], None] | None = None,
        collected: int | None = None,
        t0: float | None = None,
    ) -> CollectStats:
        """Collective. Agree on the keys pending on every rank and destroy them.

        ``policy`` fills the header's policy slots (from ``H_POLICY`` on) and
        ``on_header`` sees the reduced header before anything is destroyed (it
        may raise, and then does so on every rank alike); both are for
        :mod:`._scope`. ``collected``/``t0`` only feed the returned stats.
        """
        if t0 is None:
            t0 = time.perf_counter()
        with self._lock:
            if self._forked or self._destroying or self._broken is not None:
                self._check_usable("run a sync point")
            # Derived communicators first: their resources are newer, and may
            # have to go before one of ours (the communicator itself) can.
            child_failures = self._sync_children(deadline) if self._children else []
            if self.last_cyclic:
                self.last_cyclic = []
            if self._inbox or self._cyclic_inbox or self._stale:
                cyclic = self._drain()
            else:
                cyclic = 0
            try:
                return self._sync_locked(
                    deadline, policy, on_header, collected, t0, cyclic, child_failures
                )
            except CollectiveTimeoutError as exc:
                # An abandoned collective could match a later one: never again.
                self._broken = f"sync point {self._seq} timed out ({exc})"
                raise
            except CollectiveMismatchError:
                # Every rank saw the same reduced header, so every rank gets here.
                self._broken = f"the ranks disagreed at sync point {self._seq}"
                raise

    def _sync_locked(
        self,
        deadline: float | None,
        policy: Sequence[int],
        on_header: Callable[[Sequence[int]], None] | None,
        collected: int | None,
        t0: float,
        cyclic: int,
        child_failures: list[tuple[int, str, BaseException]],
    ) -> CollectStats:
        """The body of :meth:`sync` after the drain, under the manager's lock."""
        votes = self._votes_now()
        agreed, any_errors = self._agree(
            deadline, policy, on_header, cyclic, len(child_failures), votes
        )
        seq = self._seq
        self._seq += 1
        failures = self._destroy_agreed(agreed) if agreed.size else []
        self.last_agreed = int(agreed.size)
        failures.extend(child_failures)
        any_failed = bool(failures)
        # Whether anything ran depends only on agreed values, so every rank
        # takes the same branch: then one more small allreduce says whether
        # a destroy failed anywhere and refreshes the hook's vote (the
        # destroys may have changed it: PETSc garbage, say).
        if agreed.size or any_errors:
            votes = self._votes_now()
            if self._size > 1:
                post = _agree.allreduce(
                    self._comm,
                    array.array("q", (len(failures), *votes)),
                    MPI.MAX,
                    deadline,
                    self._what("its error check"),
                )
                any_failed = post[0] > 0
                votes = (post[1], post[2])
            self.votes = votes
        if self._sync_hooks and not self._comm_freed:
            for hook in self._sync_hooks:
                hook(self)
        if self._children:
            self._children = [c for c in self._children if not c.released]
        if any_failed:
            self._raise_failures(failures, seq, deadline)
        seconds = time.perf_counter() - t0
        self.sync_seconds += seconds
        # tuple.__new__: NamedTuple's own __new__ is a Python function.
        return _new_tuple(
            CollectStats,
            (agreed.size, self._pend.size + len(self._inbox), cyclic, seconds, seq, collected),
        )

    def _agree(
        self,
        deadline: float | None,
        policy: Sequence[int],
        on_header: Callable[[Sequence[int]], None] | None,
        cyclic: int,
        child_errors: int,
        votes: tuple[int, int],
    ) -> tuple[np.ndarray[Any, Any], bool]:
        """Collective. The keys to destroy now, ascending, and whether any rank
        saw a destroy fail on a derived communicator."""
        pend = self._pend
        if self._size == 1:
            self.votes = votes
            if on_header is not None:
                local = [0] * _agree.HEADER_LEN
                local[H_CYCLIC] = cyclic
                local[H_CHILD_ERRORS] = child_errors
                local[H_POLICY : H_POLICY + len(policy)] = policy
                on_header(local)
            return np.sort(pend), child_errors > 0
        n = pend.size
        if n:
            lo, neg_hi = int(pend.min()), -int(pend.max())
        else:
            lo, neg_hi = NO_KEY, 1
        seq, nk = self._seq, self._next_key
        gen = policy[0] if policy else 0
        head = array.array(
            "q", (n, seq, -seq, nk, -nk, lo, neg_hi, cyclic, child_errors, gen, *votes)
        )
        if deadline is None:
            # The common case, inline and in place: this allreduce is most of
            # an empty sync point's cost.
            self._comm.Allreduce(_IN_PLACE, head, _MAX)
            red = head
        else:
            red = _agree.allreduce(self._comm, head, MPI.MAX, deadline, self._what("its header"))
        if red[H_SEQ] != -red[H_NEG_SEQ] or red[H_NEXT] != -red[H_NEG_NEXT]:
            raise self._mismatch(red)
        self.votes = (red[H_VOTE], red[H_VOTE + 1])
        if on_header is not None:
            on_header(red)
        any_errors = red[H_CHILD_ERRORS] > 0
        if red[H_COUNT] == 0:
            return _NO_KEYS, any_errors
        common = _agree.intersect(
            self._comm,
            np.sort(pend),
            red[H_LO],
            -red[H_NEG_HI],
            red[H_COUNT],
            deadline,
            self._what("the key agreement"),
        )
        return common, any_errors

    def _sync_children(self, deadline: float | None) -> list[tuple[int, str, BaseException]]:
        failures: list[tuple[int, str, BaseException]] = []
        for child in list(self._children):
            failures.extend(child.visit(deadline))
            if child.released:
                self._children.remove(child)
        return failures

    def _mismatch(self, red: Sequence[int]) -> CollectiveMismatchError:
        parts = []
        if red[H_SEQ] != -red[H_NEG_SEQ]:
            parts.append(
                f"sync-point numbers range from {-red[H_NEG_SEQ]} to {red[H_SEQ]} across "
                f"the ranks (this rank: {self._seq}); a rank skipped a sync point"
            )
        if red[H_NEXT] != -red[H_NEG_NEXT]:
            parts.append(
                f"registration counts range from {-red[H_NEG_NEXT]} to {red[H_NEXT]} "
                f"(this rank: {self._next_key}); the ranks did not register the same "
                "objects (register is collective)"
            )
        return CollectiveMismatchError(
            f"rank {self._rank}: the ranks of the {self._describe()} disagree at sync "
            f"point {self._seq}: " + "; ".join(parts) + ". Nothing was destroyed."
        )

    def _destroy_agreed(self, agreed: np.ndarray[Any, Any]) -> list[tuple[int, str, BaseException]]:
        # Newest first: a resource made from another one (a KSP from a Mat, a
        # sub-communicator from a communicator) is released before its source.
        #
        # The cost per key is the point of this function (a sync point after
        # dropping 1e4 PETSc Vecs is mostly this loop), so every pass over the
        # batch runs in C: map() over dict.pop, attrgetter, setattr, then the
        # destroys themselves (see _run_each and set_batch). Every agreed
        # destroy runs even if some raise; the errors are raised afterwards.
        failures: list[tuple[int, str, BaseException]] = []
        # Every registration out of the dict and marked destroyed before any
        # destroy runs (a destroy that reaches for another registration of the
        # batch finds it destroyed), its call taken out (a registration someone
        # still holds lets go of the destroyed objects), registrations
        # destroyed explicitly meanwhile skipped; and the runs of calls to a
        # batched destroy found.
        batched, runs = _BATCHES
        regs, fns, argss, segments = _take_batch(
            self._regs, agreed[::-1].tolist(), DESTROYED, batched
        )
        if segments is None:  # out of memory finding the batches: one by one then
            segments = [(0, len(fns), -1)]
        n = len(regs)
        self._destroying = True
        try:
            for start, end, index in segments:
                if len(segments) == 1:
                    fchunk, achunk = fns, argss
                else:
                    fchunk, achunk = fns[start:end], argss[start:end]
                errors = _run_each(fchunk, achunk) if index < 0 else runs[index](achunk)
                for i, exc in errors:
                    failures.append((regs[start + i].key, regs[start + i].name, exc))
                del fchunk, achunk
            del fns, argss  # the destroyed objects go here, unless someone else holds them
        finally:
            self._destroying = False
            self.destroyed += n
            del regs
            pend = self._pend
            if agreed.size == pend.size:
                self._pend = self._pend_seq = _NO_KEYS
            else:
                keep = ~np.isin(pend, agreed, assume_unique=True)
                self._pend, self._pend_seq = pend[keep], self._pend_seq[keep]
            if not self._regs:
                # A dict never shrinks: give back a large backlog's memory.
                self._regs = {}
        for _, _, exc in failures:
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt, SystemExit: after every destroy ran
        return failures

    def _raise_failures(
        self,
        failures: list[tuple[int, str, BaseException]],
        seq: int,
        deadline: float | None,
    ) -> None:
        """Collective when some rank had a failure (agreed by the caller): raise on all."""
        mine = [(self._rank, k, n, f"{type(e).__name__}: {e}") for k, n, e in failures]
        if self._size > 1:
            everyone = _agree.allgather(self._comm, mine, deadline, self._what("its error report"))
            mine = [f for per_rank in everyone for f in per_rank]
        lines = "\n".join(f"  rank {r}, key {k} ({n!r}): {msg}" for r, k, n, msg in mine)
        raise DestroyError(
            f"{len(mine)} destroy(s) raised at sync point {seq} on the "
            f"{self._describe()}; every other agreed destroy ran:\n{lines}",
            mine,
            [e for _, _, e in failures],
        )

    # -- exit and fork ---------------------------------------------------------

    def _exit_sync(self, deadline: float) -> None:
        if self._forked:
            return
        if self._broken is not None:
            self._drain()
            if self._pend.size:
                warnings.warn(
                    f"collective_gc: rank {self._rank}: {self._pend.size} pending "
                    f"destroy(s) on the {self._describe()} were leaked at exit: the "
                    f"manager is unusable since {self._broken}",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            return
        try:
            self.sync(deadline=deadline)
        except CollectiveTimeoutError:
            warnings.warn(
                f"collective_gc: rank {self._rank}: the final agreement on the "
                f"{self._describe()} timed out at exit; {self._pend.size} pending "
                "destroy(s) were leaked (did another rank exit early or hang?)",
                ExitLeakWarning,
                stacklevel=1,
            )
        except CollectiveGCError as exc:
            warnings.warn(f"collective_gc: at exit: {exc}", ExitLeakWarning, stacklevel=1)

    def _after_fork(self) -> None:
        self._forked = True
        for reg in list(self._regs.values()):
            reg._state = DETACHED
        self._regs.clear()
        self._inbox.clear()
        self._cyclic_inbox.clear()
        self._pend = self._pend_seq = _NO_KEYS

    def _on_comm_freed(self) -> None:
        # Called from an MPI attribute delete callback: record only, no MPI.
        self._comm_freed = True


# -- the registry of managers ------------------------------------------------

_MANAGERS: list[Manager] = []
_KEYVAL: list[int] = []
# A weak reference to the communicator object of the last lookup, and its
# manager: a cache for the common case of many registrations on one communicator.
_LAST: list[Any] = [None, None]


def _delete_attr(comm: MPI.Comm, keyval: int, mgr: Manager) -> None:
    mgr._on_comm_freed()


def _keyval() -> int:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_delete_attr))
    return _KEYVAL[0]


def _check_comm(comm: object) -> MPI.Intracomm:
    """Refuse what is not a usable intracommunicator, with a clear error."""
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError("the communicator is MPI.COMM_NULL (freed, or this rank is not in it)")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"expected an mpi4py intracommunicator, got {type(comm).__name__!r} object"
            + (" (use comm=None for a rank-local registration)" if comm is None else "")
        )
    if MPI.Is_finalized():
        raise CollectiveGCError("MPI is already finalized")
    return comm


def manager(comm: MPI.Comm) -> Manager:
    """The manager of ``comm``: the same object each time for the same communicator.

    Collective the first time it is called for a communicator (it duplicates the
    communicator for its own traffic); :func:`register` and :func:`collect`
    call it for you.
    """
    last = _LAST
    if last[0] is not None and last[0]() is comm and not last[1]._comm_freed:
        # The same Python object as last time, and its handle was not freed
        # (freeing runs our attribute delete callback): the same manager.
        return last[1]  # type: ignore[no-any-return]
    c = _check_comm(comm)
    kv = _keyval()
    mgr = c.Get_attr(kv)
    if mgr is None:
        mgr = Manager(c)
        c.Set_attr(kv, mgr)
        _MANAGERS.append(mgr)
    # A weak reference: holding the user's communicator object would keep a
    # managed one (cgc.dup) alive for ever.
    last[0], last[1] = weakref.ref(comm), mgr
    assert isinstance(mgr, Manager)
    return mgr


def managers() -> list[Manager]:
    """Every manager made so far in this process, oldest first."""
    return list(_MANAGERS)


def register(
    obj: object,
    destroy: Callable[..., object],
    *args: Any,
    comm: MPI.Comm | None,
    name: str | None = None,
    **kwargs: Any,
) -> Registration:
    """Collective over ``comm``: manage ``obj``; when it dies, queue ``destroy(*args, **kwargs)``.

    Every rank registers the same objects in the same order, so the
    registration gets the same key on every rank; a rank that registers in a
    different order makes the next sync point raise
    :class:`CollectiveMismatchError` on every rank.

    When ``obj`` dies (by refcounting or in the cyclic collector, on any
    thread) the destroy is only queued: it runs at the next sync point on
    ``comm`` (:func:`collect`, a scope's sync) at which every rank has queued
    it, on the thread calling that sync point, newest key first.

    ``comm=None`` makes a rank-local registration, for resources that are safe
    to release from another thread: the destroy runs on a background reaper
    thread soon after ``obj`` dies, exactly once, with no agreement.

    The registration holds only a weak reference to ``obj``, and must not hold
    a strong one: a ``destroy`` or argument that is ``obj``, a bound method of
    it, or a partial or closure over it, is refused with
    :class:`RegistrationError` (as is an object that cannot be weakly
    referenced, a destroy that is not callable, or an object already
    registered on the same communicator). The keyword arguments ``comm`` and
    ``name`` belong to ``register`` and cannot be passed on to the destroy.
    """
    if comm is None:
        return _reaper.register(obj, destroy, args, kwargs, name)
    return manager(comm).register(obj, destroy, args, kwargs, name)


def collect(
    comm: MPI.Comm, *, generation: int | None = 2, timeout: float | None = None
) -> CollectStats:
    """Collective sync point: collect garbage locally, then destroy what all ranks queued.

    Runs ``gc.collect(generation)`` on this rank (``None`` skips it), then agrees
    with the other ranks of ``comm`` on the keys every rank has queued and runs
    those destroys, newest first, in the same order on every rank. Keys queued
    on only some ranks stay queued for a later sync point.

    Every rank of ``comm`` must call it: a rank that skips it leaves the others
    waiting in the agreement (for ever, or until ``timeout`` seconds pass, when
    :class:`CollectiveTimeoutError` is raised and the manager becomes
    unusable). If any destroy raises, on any rank, every agreed destroy still
    runs and then :class:`DestroyError` is raised on every rank.
    """
    t0 = time.perf_counter()
    mgr = manager(comm)
    collected = None if generation is None else gc.collect(generation)
    deadline = None if timeout is None else time.monotonic() + timeout
    return mgr.sync(deadline=deadline, collected=collected, t0=t0)


def pending(comm: MPI.Comm | None) -> list[Registration]:
    """The destroy requests this rank has queued on ``comm``, oldest first. Local."""
    if comm is None:
        return []
    return manager(comm).pending()


def _exit_timeout() -> float:
    try:
        return float(os.environ.get("COLLECTIVE_GC_EXIT_TIMEOUT", "10"))
    except ValueError:
        return 10.0


def _at_exit() -> None:
    # Runs before mpi4py and petsc4py finalize (they use Py_AtExit, which runs
    # after every atexit handler).
    if _FLAGS[1]:
        return  # already shut down
    if os.getpid() != _PID:
        # A forked child never runs the parent's destroys or sync points.
        _FLAGS[1] = 1
        _reaper.shutdown()
        return
    try:
        if getattr(sys, "last_value", None) is not None and _MANAGERS:
            # Dying of an uncaught exception, which may have happened on this
            # rank only: the others may never reach an exit agreement, and
            # under `python -m mpi4py` the job is about to be aborted. Waiting
            # for them would only delay that; leak instead, and say so.
            left = sum(m._pend.size + len(m._inbox) for m in _MANAGERS)
            if left:
                warnings.warn(
                    f"collective_gc: exiting on an uncaught exception: {left} pending "
                    "collective destroy(s) not run",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            return
        if MPI.Is_initialized() and not MPI.Is_finalized() and _MANAGERS:
            gc.collect()
            deadline = time.monotonic() + _exit_timeout()
            # Newest first: sub-communicators before the communicators they came from.
            for mgr in reversed(_MANAGERS):
                mgr._exit_sync(deadline)
    finally:
        _FLAGS[1] = 1  # finalizers from now on do nothing
        _reaper.shutdown()


def _after_fork_in_child() -> None:
    _FLAGS[0] = 0
    _LAST[0] = _LAST[1] = None
    for mgr in _MANAGERS:
        mgr._after_fork()
    _reaper.after_fork()


_PID = os.getpid()
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
