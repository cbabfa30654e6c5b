"""collective_scope: sync points around a solver loop, GC policy, strict mode.

A scope is where a user says "these ranks run this loop together": inside it
the automatic cyclic collector can be replaced by collections that happen at
the same sync point on every rank (``gc="managed"``), cyclic finalization of a
managed object can be forbidden (``strict=True``), and every sync point can
carry a deadline (``timeout``).
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, TypeVar, Union

from mpi4py import MPI

from . import _gcpolicy, _registration
from ._agree import FIELD_GC, FLAG_CYCLIC
from ._api import check_timeout, collect
from ._errors import (
    CollectiveGCError,
    CyclicFinalizationError,
    CyclicFinalizationWarning,
)
from ._exit import exit_timeout
from ._lookup import lookup, manager
from ._manager import Manager, quick_sync, set_timeout_source
from ._syncpoint import SCOPE_EXIT, CollectStats, Participant

__all__ = ["collective_scope", "sync_point", "current_scope"]

GcMode = Literal["managed", "auto", "off"]
Strict = Union[bool, Literal["warn"]]  # noqa: UP007 (a runtime alias: | needs 3.10 types)

_local = threading.local()


def _stack() -> list[collective_scope]:
    try:
        return _local.stack  # type: ignore[no-any-return]
    except AttributeError:
        _local.stack = []
        return _local.stack  # type: ignore[no-any-return]


def current_scope(comm: MPI.Comm | None = None) -> collective_scope | None:
    """The innermost open scope of this thread (on ``comm``, if given), or None.

    Local: no communication (a communicator with no manager has no scope).
    """
    stack = _stack()
    if not stack:
        return None
    mgr = None if comm is None else lookup(comm)
    if comm is not None and mgr is None:
        return None
    for scope in reversed(stack):
        if mgr is None or scope.manager is mgr:
            return scope
    return None


def _innermost_timeout() -> float | None:
    stack = _stack()
    return stack[-1].timeout if stack else None


set_timeout_source(_innermost_timeout)


class _Seen(Participant):
    """Notes the agreed flags. In strict mode, when they say that a managed
    object died in the cyclic collector, it also gathers every rank's list of
    those, inside the sync point, for the scope to raise once it returns: an
    interrupt the sync point holds then cannot make one rank skip a
    collective the others make."""

    # With the agreed flags all 0 its finish would only note them: the
    # steady state may skip it (the scope resets what it notes first).
    quiet_finish = True

    def __init__(self, gather_cyclic: bool = False, timeout: float | None = None) -> None:
        self.flags = 0
        self.gather_cyclic = gather_cyclic
        self.timeout = timeout
        self.cyclic_rows: list[tuple[int, str, str, int, str]] = []

    def reset(self) -> None:
        """Forget what the last sync point noted (one object serves the
        scope's every sync point)."""
        self.flags = 0
        if self.cyclic_rows:
            self.cyclic_rows = []

    def may_raise(self, flags: int) -> bool:
        return False

    def identity(self) -> str:
        # Whether it gathers (strict=True) changes its collectives.
        return super().identity() + ("/strict" if self.gather_cyclic else "")

    def finish(self, mgr: Manager, flags: int) -> None:
        self.flags = flags
        if self.gather_cyclic and flags & FLAG_CYCLIC:
            rows = [(mgr.rank, t, n, k, _origin(o)) for t, n, k, o in mgr.last_cyclic]
            gathered = mgr.allgather(rows, self.timeout)
            self.cyclic_rows = [row for per in gathered for row in per]


class _Exit(_Seen):
    """The participant of a scope's exit sync point: it says so in its
    identity, so that a rank whose scope ended while the others are still at
    one of its sync points is named as such by the mismatch."""

    def identity(self) -> str:
        return super().identity() + "/" + SCOPE_EXIT


class _Policy(_Seen):
    """A managed scope's GC policy at one sync point: each rank votes for the
    generation its automatic collector would collect now; all collect the
    oldest any of them wants, at the same point, after the destroys (what that
    collection finds is queued for the next sync point)."""

    field = FIELD_GC

    def __init__(self, gather_cyclic: bool = False, timeout: float | None = None) -> None:
        super().__init__(gather_cyclic, timeout)
        self.collected = False

    def reset(self) -> None:
        super().reset()
        self.collected = False

    def vote(self, mgr: Manager) -> int:
        # A thermometer code (generation g as g + 1 low bits), so that the OR
        # over the ranks is the code of the oldest generation anyone wants.
        return (1 << (_gcpolicy.wanted_generation() + 1)) - 1

    def may_raise(self, flags: int) -> bool:
        # Only a collection runs code that may raise (an interrupt in a finalizer).
        return self.votes(flags) != 0

    def finish(self, mgr: Manager, flags: int) -> None:
        super().finish(mgr, flags)
        generation = self.votes(flags).bit_length() - 1
        if generation >= 0:
            # Agreed: the same on every rank, so the frozen long-lived heap
            # may stay frozen (see _gcpolicy).
            _gcpolicy.collect(generation, agreed=True)
            self.collected = True


class collective_scope:
    """Collective sync points around a block: ``with collective_scope(comm) as scope:``.

    Collective over ``comm``: every rank enters and leaves the scope, and calls
    :meth:`sync` the same number of times, in the same order relative to
    other collectives. A rank that skips one leaves the others waiting (for
    ever, or until ``timeout``), or, if it reaches a later sync point instead,
    makes that one raise :class:`CollectiveMismatchError` on every rank.

    Args:
        comm: the communicator whose manager the scope drives.
        gc: ``"managed"`` (default): Python's automatic cyclic collector is off
            inside the scope; at each sync point the ranks agree whether to
            collect, and which generation (the oldest any rank's allocation
            counts call for), so collections happen at the same point on
            every rank. ``"auto"``: the collector stays on (safe: finalization
            only queues). ``"off"``: no collection but explicit ones. The
            collector's previous state is restored on exit, exceptions included.
        strict: ``False`` counts cyclic finalizations of managed objects
            (:attr:`cyclic`); ``"warn"`` also warns
            (:class:`CyclicFinalizationWarning`) on the ranks where they
            happened; ``True`` raises :class:`CyclicFinalizationError` at the
            sync point that sees one, on every rank together, after that sync
            point's destroys ran (nothing is lost).
        timeout: seconds each sync point may wait for the other ranks before
            raising :class:`CollectiveTimeoutError` (the manager is then unusable).
        track_origins: record where each object is registered inside the scope,
            for strict mode's messages (costs a stack extraction per registration).
        exit_collect: the generation every rank collects before the exit sync
            (default 2, a full collection, so that nothing dropped inside the
            scope stays queued; its cost grows with the heap, so a scope around
            each of many short solves may prefer 0, or None for no collection).

    The scope syncs at exit, after the ``exit_collect`` collection on every
    rank (``gc="off"``: none). If the body raised, that exit sync gets a
    deadline (``timeout``, or ``COLLECTIVE_GC_EXIT_TIMEOUT`` seconds, default
    10) since the exception may have happened on some ranks only: past it the
    original exception propagates, with a note, instead of hanging (run under
    ``python -m mpi4py`` to then abort the job). A scope is single-use.
    Scopes nest; they must be exited innermost first.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        *,
        gc: GcMode = "managed",
        strict: Strict = False,
        timeout: float | None = None,
        track_origins: bool = False,
        exit_collect: int | None = 2,
    ) -> None:
        if gc not in ("managed", "auto", "off"):
            raise ValueError(f"gc must be 'managed', 'auto' or 'off', not {gc!r}")
        if strict not in (False, True, "warn"):
            raise ValueError(f"strict must be False, True or 'warn', not {strict!r}")
        timeout = check_timeout(timeout)
        self.comm = comm
        self.gc = gc
        self.strict = strict
        self.timeout = timeout
        self.track_origins = track_origins
        if exit_collect not in (None, 0, 1, 2):
            raise ValueError(f"exit_collect must be 0, 1, 2 or None, not {exit_collect!r}")
        self.exit_collect = exit_collect
        self.manager: Manager = manager(comm)
        # Its sync points' own participant (strict=True gathers: "warn" only
        # warns, on each rank alone).
        gather = strict is True
        self._seen = _Policy(gather, timeout) if gc == "managed" else _Seen(gather, timeout)
        self.syncs = 0
        self.destroyed = 0
        self.cyclic = 0
        self.collections = 0
        self.seconds = 0.0
        self._state = "new"
        self._origins_were = False
        self._thread = 0
        self._owner_stack: list[collective_scope] | None = None
        # Collections that ran without the collector hook strict mode sees
        # cyclic deaths by (the program emptied gc.callbacks), not yet said.
        self._unseen = 0

    def __repr__(self) -> str:
        return (
            f"<collective_scope {self._state} on a {self.manager.describe()}: gc={self.gc!r}, "
            f"strict={self.strict!r}, {self.syncs} syncs, {self.destroyed} destroyed, "
            f"{self.cyclic} cyclic>"
        )

    # -- entering and leaving ----------------------------------------------

    def __enter__(self) -> collective_scope:
        if self._state != "new":
            raise CollectiveGCError(
                f"{self!r} was already entered; a scope is single-use, make a new one"
            )
        self._thread = threading.get_ident()
        self._unseen = _registration.gc_hook_back()
        self._origins_were = _registration.track_origins()
        stack = _stack()
        self._owner_stack = stack
        # Stack first, then the collector: if an interrupt lands in between,
        # __exit__ is never called, so undo here whatever was done.
        stack.append(self)
        self._state = "open"
        try:
            _gcpolicy.POLICY.enter(self.gc)
        except BaseException:
            stack.remove(self)
            self._state = "exited"
            raise
        if self.track_origins:
            _registration.track_origins(True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "open":
            raise CollectiveGCError(f"attempted to exit {self!r}, which is not open")
        stack = self._owner_stack
        assert stack is not None
        misuse = None
        if threading.get_ident() != self._thread:
            misuse = (
                f"attempted to exit {self!r} from a thread other than the one that "
                "entered it; it is closed now, without its exit sync point"
            )
        elif not stack or stack[-1] is not self:
            inner = stack[-1] if stack else None
            misuse = (
                f"attempted to exit {self!r} while an inner scope, {inner!r}, is still "
                "open; scopes must be exited innermost first. It is closed now, "
                "without its exit sync point"
            )
        try:
            if misuse is None:
                if exc is None:
                    self._sync(collect=True, deadline_s=self.timeout)
                else:
                    self._sync_after_error(exc)
        finally:
            # Whichever way we leave, the state this scope changed is put back
            # (trio's CancelScope._close does the same on misuse).
            if self in stack:
                stack.remove(self)
            self._state = "exited"
            _registration.track_origins(self._origins_were)
            _gcpolicy.POLICY.leave(self.gc)
        if misuse is not None:
            raise CollectiveGCError(misuse)

    def _sync_after_error(self, exc: BaseException) -> None:
        if self.manager.broken is not None:
            return
        try:
            self._sync(collect=True, deadline_s=self.timeout or exit_timeout())
        except CollectiveGCError as sync_exc:
            # The body's exception is the one that matters; say why the
            # scope could not clean up, and let it propagate.
            exc.add_note(f"collective_gc: the exit sync of {self!r} failed: {sync_exc}")

    # -- sync points -----------------------------------------------------------

    def sync(self) -> CollectStats:
        """Collective: a sync point on the scope's communicator (see the class docs)."""
        if self._state != "open":
            raise CollectiveGCError(f"cannot sync {self!r}: it is not open")
        return self._sync(collect=False, deadline_s=self.timeout)

    def _sync(self, *, collect: bool, deadline_s: float | None) -> CollectStats:
        t0 = time.perf_counter()
        self._unseen += _registration.gc_hook_back()
        collected = None
        if collect and self.gc != "off" and self.exit_collect is not None:
            # The exit sync: the same collection on every rank first.
            collected = _gcpolicy.collect(self.exit_collect)
            self.collections += 1
        seen: _Seen
        if collect:
            seen = _Exit(self.strict is True, self.timeout)
        else:
            seen = self._seen  # the same participant at each of its sync points
            seen.reset()
        try:
            if deadline_s is None and not collect:
                stats = quick_sync(self.manager, t0, None, seen)
            else:
                # The exit sync point reports its own failures before the
                # scope ends (final): nothing is left for a later one to say.
                stats = self.manager.sync(
                    deadline=None if deadline_s is None else time.monotonic() + deadline_s,
                    participants=(seen,),
                    collected=collected,
                    t0=t0,
                    final=collect,
                )
        finally:
            if isinstance(seen, _Policy) and seen.collected:
                self.collections += 1
        self.syncs += 1
        self.destroyed += stats.destroyed
        self.cyclic += stats.cyclic
        self.seconds += stats.seconds
        if self._unseen and self.strict:
            _warn_unseen(self, self._unseen)
            self._unseen = 0
        if seen.flags & FLAG_CYCLIC and self.strict:
            self._report_cyclic(seen.cyclic_rows)
        return stats

    def _report_cyclic(self, rows: list[tuple[int, str, str, int, str]]) -> None:
        rank = self.manager.rank
        seq = self.manager.sync_count - 1
        if self.strict == "warn":
            mine = list(self.manager.last_cyclic)
            if mine:
                warnings.warn(
                    CyclicFinalizationWarning(_describe_cyclic(rank, mine, seq)),
                    stacklevel=4,
                )
            return
        # strict=True: every rank saw (through the header) that some rank had
        # one, so every rank raises, with the whole list its sync point gathered.
        lines = "\n".join(
            f"  rank {r}: {t} {n!r} (key {k})" + (f", registered at\n{o}" if o else "")
            for r, t, n, k, o in rows
        )
        raise CyclicFinalizationError(
            f"{len(rows)} managed object(s) were finalized by the cyclic collector before sync "
            f"point {seq} of {self!r} (strict mode); their destroys ran, "
            "but when they die depends on each rank's allocations. Break the reference "
            "cycles (cgc.find_cycles(obj) on a live instance shows them):\n" + lines
        )


def _warn_unseen(scope: collective_scope, count: int) -> None:
    # Local, after the sync point: a warning made an error then raises on
    # this rank alone, with no collective left half-done.
    warnings.warn(
        f"collective_gc: rank {scope.manager.rank}: collective_gc's hook was not in "
        f"gc.callbacks (the program cleared or replaced that list) while {count} "
        f"collection(s) ran, up to sync point {scope.manager.sync_count - 1} of {scope!r}: "
        "managed objects they finalized were not seen as cyclic, so strict mode could not "
        "report them. The hook is back in gc.callbacks; add to that list rather than "
        "replace it.",
        RuntimeWarning,
        stacklevel=4,
    )


def _origin(origin: traceback.StackSummary | None) -> str:
    if origin is None:
        return ""
    return "".join(traceback.format_list(origin[-3:])).rstrip()


def _describe_cyclic(
    rank: int, mine: list[tuple[str, str, int, traceback.StackSummary | None]], seq: int
) -> str:
    parts = [
        f"{t} {n!r} (key {k})" + (f" registered at\n{_origin(o)}" if o else "")
        for t, n, k, o in mine
    ]
    return (
        f"rank {rank}: {len(mine)} managed object(s) finalized by the cyclic collector before "
        f"sync point {seq}: " + "; ".join(parts)
    )


F = TypeVar("F", bound=Callable[..., Any])


def sync_point(
    fn: F | None = None, *, comm: MPI.Comm | Callable[..., MPI.Comm] | None = None
) -> Any:
    """Collective decorator: make a function (a solve) a sync point after it returns.

    Every rank must call the decorated function the same number of times (each
    call ends in a collective sync point; a rank that skips one hangs the others
    or makes the next sync point raise :class:`CollectiveMismatchError`).
    After it returns, the innermost open :class:`collective_scope` of this
    thread (on ``comm``, if given) syncs; with no such scope, ``comm`` is
    required and :func:`collective_gc.collect` runs on it. ``comm`` may be a
    communicator or a callable that gets the function's arguments and returns
    one (``comm=lambda self, *a: self.comm``).
    If the function raises, no sync point runs.
    """

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = f(*args, **kwargs)
            c = comm(*args, **kwargs) if callable(comm) else comm
            scope = current_scope(c)
            if scope is not None:
                scope.sync()
            elif c is not None:
                collect(c)
            else:
                raise CollectiveGCError(
                    f"{f.__qualname__} is a sync point, but no collective_scope is open in "
                    "this thread and no comm was given to @sync_point"
                )
            return result

        return wrapper  # type: ignore[return-value]

    if fn is not None:
        return decorate(fn)
    return decorate
