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

from . import _gcpolicy, _interrupts, _registration
from ._agree import FIELD_GC, FLAG_CYCLIC
from ._api import check_timeout, collect
from ._errors import (
    CollectiveGCError,
    CyclicFinalizationError,
    CyclicFinalizationWarning,
)
from ._exit import exit_timeout
from ._lookup import lookup, manager
from ._manager import Manager, open_family, quick_sync, set_timeout_source
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
    """A scope's participant at one of its sync points: notes the agreed
    flags (what its identity says also tells a scope's exit from its other
    sync points: see _Exit)."""

    # With its byte and the sync point's flags all 0 its finish would only
    # note them: the steady state may skip it (the scope resets what it notes first).
    quiet_finish = True

    def __init__(self) -> None:
        self.flags = 0

    def reset(self) -> None:
        """Forget what the last sync point noted (one object serves the
        scope's every sync point)."""
        self.flags = 0

    def may_raise(self, flags: int) -> bool:
        return False

    def finish(self, mgr: Manager, flags: int) -> None:
        self.flags = flags


class _Watch(Participant):
    """While a strict scope is open, a participant of its family: every
    sync point of the family, on any of its communicators (a library's
    ``Dup`` of the scope's, a ``@sync_point(comm=d)`` on it), notes the
    cyclic deaths it drained, for the scope to report at its next sync point
    or its exit. With ``strict=True`` every rank's, gathered inside that sync
    point (the agreed flags tell every rank to), so that every rank holds
    the same list and raises alike; an interrupt the sync point holds cannot
    make one rank skip a collective the others make. Issue 39, item 3: such
    a sync point used to drain the death unseen."""

    quiet_finish = True  # it acts only on the sync point's own flags (FLAG_CYCLIC)

    def __init__(self, gather: bool, timeout: float | None) -> None:
        self.gather = gather
        self.timeout = timeout
        self.rows: list[tuple[int, str, str, int, str]] = []

    def may_raise(self, flags: int) -> bool:
        return False

    def identity(self) -> str:
        # Whether it gathers (strict=True) changes its collectives.
        return super().identity() + ("/gather" if self.gather else "/warn")

    def finish(self, mgr: Manager, flags: int) -> None:
        if not flags & FLAG_CYCLIC:
            return
        mine = [(mgr.rank, t, n, k, _origin(o)) for t, n, k, o in mgr.last_cyclic]
        if self.gather:
            gathered = mgr.allgather(mine, self.timeout)
            self.rows.extend(row for per in gathered for row in per)
        else:
            self.rows.extend(mine)

    def take(self) -> list[tuple[int, str, str, int, str]]:
        """What it noted since the last take (it leaves it)."""
        rows, self.rows = self.rows, []
        return rows


class _Exit(_Seen):
    """The participant of a scope's exit sync point: it says so in its
    identity, so that a rank whose scope ended while the others are still at
    one of its sync points is named as such by the mismatch."""

    def identity(self) -> str:
        return super().identity() + "/" + SCOPE_EXIT


class _Pace:
    """How many of a scope's sync points to let pass after an agreement
    (``seconds=``): see NOTE [ A scope's back-off ]. This rank's part:
    how many calls of ``sync`` it expects in ``seconds``, from its own clock
    (durations only: no rank compares clock readings with another's)."""

    __slots__ = ("seconds", "calls", "since")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0  # sync calls since the last agreement, this one included
        self.since = time.perf_counter()  # when the last agreement ended

    def code(self) -> int:
        """This rank's vote: bit i set if it expects fewer than 4 ** (i + 1)
        calls in ``seconds`` (a thermometer: the OR over the ranks is the code
        of the fewest any rank expects)."""
        elapsed = time.perf_counter() - self.since
        expected = self.seconds * self.calls / elapsed if elapsed > 0 else _PACE_MAX
        code = 0
        for i in range(_PACE_BITS):
            if expected < 1 << 2 * (i + 1):
                code |= 1 << i
        return code

    @staticmethod
    def skips(code: int) -> int:
        """The sync points every rank lets pass, from the agreed code: one
        fewer than the power of 4 at or below the fewest calls expected."""
        if code == 0:
            return _PACE_MAX - 1
        return (1 << 2 * ((code & -code).bit_length() - 1)) - 1

    def agreed(self) -> None:
        self.calls = 0
        self.since = time.perf_counter()


_PACE_BITS = 5  # bits 3-7 of the scope's field (the generation takes 0-2)
_PACE_MAX = 1 << 2 * _PACE_BITS  # at most 4 ** 5 = 1024 calls between agreements


class _Policy(_Seen):
    """A scope's policy at one sync point, voted in one field: for a managed
    scope, each rank votes for the generation its automatic collector would
    collect now, and all collect the oldest any of them wants, at the same
    point, after the destroys (what that collection finds is queued for the
    next sync point); with ``seconds=``, how often to agree (:class:`_Pace`)."""

    field = FIELD_GC

    def __init__(self, managed: bool = True, pace: _Pace | None = None) -> None:
        super().__init__()
        self.collected = False
        self.managed = managed
        self.pace = pace
        self.skips = 0

    def reset(self) -> None:
        super().reset()
        self.collected = False
        self.skips = 0 if self.pace is None else _PACE_MAX - 1

    def vote(self, mgr: Manager) -> int:
        # A thermometer code (generation g as g + 1 low bits), so that the OR
        # over the ranks is the code of the oldest generation anyone wants.
        mine = (1 << (_gcpolicy.wanted_generation() + 1)) - 1 if self.managed else 0
        if self.pace is not None:
            mine |= self.pace.code() << 3
        return mine

    # Its may_raise stays _Seen's False, a collection included: the collector
    # reports what a finalizer raises as unraisable, and inside the sync
    # point (a protected region) no signal's handler runs. What else could
    # (a MemoryError) is kept for the family's next agreement, as any quiet
    # finish's failure is: no word of its own after the finishes.
    def finish(self, mgr: Manager, flags: int) -> None:
        super().finish(mgr, flags)
        votes = self.votes(flags)
        if self.pace is not None:
            self.skips = _Pace.skips(votes >> 3)
        generation = (votes & 7).bit_length() - 1
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
            only queues), unless a ``"managed"`` or ``"off"`` scope is open
            in this process too, on any thread: the collector is one per
            process, and theirs win. ``"off"``: no collection but explicit
            ones. The collector's previous state is restored on exit,
            exceptions included.
        strict: ``False`` counts cyclic finalizations of managed objects
            (:attr:`cyclic`); ``"warn"`` also warns
            (:class:`CyclicFinalizationWarning`) on the ranks where they
            happened; ``True`` raises :class:`CyclicFinalizationError` at the
            sync point that sees one, on every rank together, after that sync
            point's destroys ran (nothing is lost).
        timeout: seconds each sync point may wait for the other ranks before
            raising :class:`CollectiveTimeoutError` (the manager is then
            unusable); also entering, where it makes the communicator's
            family (its first collective: a duplicate of it, once).
        track_origins: record where each object is registered inside the scope,
            for strict mode's messages (costs a stack extraction per registration).
        exit_collect: the generation every rank collects before the exit sync
            (default 2, a full collection, so that nothing dropped inside the
            scope stays queued; its cost grows with the heap, so a scope around
            each of many short solves may prefer 0, or None for no collection).
        every: a back-off: only every ``every``-th call of :meth:`sync` (a
            ``@sync_point`` inside the scope calls it) is a sync point; the
            others return at once (``CollectStats.sync == -1``). Decided from
            the call count, the same on every rank.
        seconds: a back-off: the ranks agree about every ``seconds`` at most.
            Each agreement carries how many calls to let pass before the next:
            each rank says how many it expects in ``seconds`` at the pace it
            measured since the last one, and all take the fewest, rounded down
            to a power of 4 (1 to 1024). Objects that die meanwhile are
            destroyed at the next agreement: within about ``seconds`` while
            the pace holds. Not with ``every``, nor with ``strict`` (which
            checks every sync point); the exit sync point is never skipped.

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
        every: int | None = None,
        seconds: float | None = None,
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
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"every must be a positive int or None, not {every!r}")
        if seconds is not None and (
            not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf")
        ):
            raise ValueError(f"seconds must be a positive number or None, not {seconds!r}")
        if every is not None and seconds is not None:
            raise ValueError("give every= or seconds=, not both")
        if strict and (every is not None or seconds is not None):
            raise ValueError(
                "a strict scope checks every sync point for cyclic deaths: it takes no "
                "back-off (every=, seconds=)"
            )
        self.every = every
        self.seconds_between = seconds
        pace = None if seconds is None else _Pace(float(seconds))
        self.manager: Manager = manager(comm)
        # Its sync points' own participant; and while it is open, in strict
        # mode, its family's (see _Watch: strict=True gathers every rank's
        # cyclic deaths, "warn" notes this rank's).
        self._seen = _Policy(gc == "managed", pace) if gc == "managed" or pace else _Seen()
        self._pace = pace
        self._skip = 0  # calls of sync still to let pass (the back-off)
        self.skipped = 0
        self._watch = _Watch(strict is True, timeout) if strict else None
        self.syncs = 0
        self.destroyed = 0
        self.cyclic = 0
        self.collections = 0
        self.seconds = 0.0
        self._state = "new"
        # What entering did, each undone once by _put_back.
        self._in_policy = self._in_family = self._tracking = False
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
        stack = _stack()
        self._owner_stack = stack
        # One protected region: a signal's handler runs once the scope is
        # open, not half-way through opening it (adding the watch is
        # collective), and if the handler raises there, __exit__ will never
        # be called: what was done is put back, as when a step raises.
        entered = None
        try:
            try:
                entered = _interrupts.enter()  # (if it raises, nothing entered)
                stack.append(self)
                self._state = "open"
                _gcpolicy.POLICY.enter(self.gc)
                self._in_policy = True
                # The family, made now if it was not: entering is collective.
                # The exit sync after an error on one rank then never is a
                # first collective on the user's communicator (a duplication
                # that rank alone would post and abandon at its deadline, for
                # the others' next collective there to match): its agreement
                # is the family's, whose watch tells the others. And a
                # library's communicator made inside is the family's child
                # from the start. (Once per communicator.)
                open_family(self.manager)
                if self._watch is not None:
                    # Collective, as entering is: the same participants on every rank.
                    # (Marked first: added and then raising, it is still
                    # removed; removing one that is not there does nothing.)
                    self._in_family = True
                    self.manager.add_participant(self._watch)
                if self.track_origins:
                    _registration.track_origins(True)
                    self._tracking = True
            finally:
                if entered is not None:
                    _interrupts.leave(entered)
        except BaseException:
            self._put_back()
            raise
        return self

    def _put_back(self) -> None:
        """Undo, once, what entering did. Local: every rank leaves alike,
        but where one rank alone was interrupted as it entered, or had its
        scope exited by its cyclic collector; then its strict watch is gone
        there only, and the family's next sync point reports that the ranks'
        participants differ."""
        stack = self._owner_stack
        if stack is not None and self in stack:
            stack.remove(self)
        self._state = "exited"
        if self._tracking:
            self._tracking = False
            _registration.track_origins(False)
        if self._in_policy:
            self._in_policy = False
            _gcpolicy.POLICY.leave(self.gc)
        if self._in_family:
            self._in_family = False
            assert self._watch is not None
            self.manager.remove_participant(self._watch)

    @_interrupts.protect_entry
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # One protected region, entered first (a signal before that is
        # deferred to its end too: see protect_entry), the exit collection
        # included: it runs on every rank before the exit sync point (and
        # may be long), so a signal there would leave this rank's exit sync
        # point unmade while the others wait in it, and one raised before
        # the scope is put back would leave it open for ever (Python calls
        # __exit__ once); held, it is raised once the scope is closed.
        entered = None
        misuse = None
        try:
            try:
                entered = _interrupts.enter()  # (if it raises, nothing entered)
                misuse = self._misuse()
                if misuse is None:
                    if exc is None:
                        self._sync(collect=True, deadline_s=self.timeout)
                    else:
                        self._sync_after_error(exc)
            finally:
                # Whichever way we leave, the state this scope changed is put
                # back (trio's CancelScope._close does the same on misuse).
                if self._state == "open":
                    self._put_back()
        finally:
            if entered is not None:
                _interrupts.leave(entered)
        if misuse is not None:
            raise CollectiveGCError(misuse)

    def _misuse(self) -> str | None:
        """Why this exit may not run its exit sync point (it still closes
        the scope), or None; raises if the scope is not open."""
        if self._state != "open":
            raise CollectiveGCError(f"attempted to exit {self!r}, which is not open")
        stack = self._owner_stack
        assert stack is not None
        if threading.get_ident() != self._thread:
            return (
                f"attempted to exit {self!r} from a thread other than the one that "
                "entered it; it is closed now, without its exit sync point"
            )
        if _registration.GC.collecting == self._thread:
            # A generator (or coroutine) left suspended inside the scope, in a
            # reference cycle, closed by the cyclic collector: its exit sync
            # point would be MPI inside the collector, which runs at a
            # different moment on each rank. (Raised in the collector, the
            # error is printed as unraisable.)
            return (
                f"{self!r} was exited by the cyclic garbage collector (a generator "
                "holding it open was collected), which runs at a different moment on "
                "each rank; it is closed now, without its exit sync point (what that "
                "would have destroyed waits for the next sync point). Close such a "
                "generator explicitly, on every rank (gen.close(), contextlib.closing)"
            )
        if not stack or stack[-1] is not self:
            inner = stack[-1] if stack else None
            return (
                f"attempted to exit {self!r} while an inner scope, {inner!r}, is still "
                "open; scopes must be exited innermost first. It is closed now, "
                "without its exit sync point"
            )
        return None

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
        if self._pace is not None:
            self._pace.calls += 1
        if self._skip:
            # NOTE [ A scope's back-off ]: every rank makes the same calls of
            # sync (they are collective), so a count of calls that every rank
            # took from the same agreement, or from every=, lets pass the
            # same ones everywhere, with no message and no clock compared.
            self._skip -= 1
            self.skipped += 1
            return _LET_PASS
        stats = self._sync(collect=False, deadline_s=self.timeout)
        if self.every is not None:
            self._skip = self.every - 1
        elif self._pace is not None:
            assert isinstance(self._seen, _Policy)
            self._skip = self._seen.skips  # agreed: the same on every rank
            self._pace.agreed()
        return stats

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
            seen = _Exit()
        else:
            seen = self._seen  # the same participant at each of its sync points
            seen.reset()
        try:
            if not collect:
                stats = quick_sync(
                    self.manager,
                    t0,
                    None,
                    seen,
                    None if deadline_s is None else time.monotonic() + deadline_s,
                )
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
            # What the strict watch noted belongs to this sync point, even if
            # it raised here (an interrupt it held, say): the other ranks
            # report it now, so no later sync point of this rank may.
            rows = [] if self._watch is None else self._watch.take()
        self.syncs += 1
        self.destroyed += stats.destroyed
        self.cyclic += stats.cyclic
        self.seconds += stats.seconds
        if self._unseen and self.strict:
            _warn_unseen(self, self._unseen)
            self._unseen = 0
        if rows:
            self._report_cyclic(rows)
        return stats

    def _report_cyclic(self, rows: list[tuple[int, str, str, int, str]]) -> None:
        rank = self.manager.rank
        seq = self.manager.sync_count - 1
        if self.strict == "warn":
            # This rank's, noted by any sync point of the family since the last.
            warnings.warn(
                CyclicFinalizationWarning(_describe_cyclic(rank, rows, seq)), stacklevel=4
            )
            return
        # strict=True: every rank saw (through the header) that some rank had
        # one, so every rank raises, with the whole list its sync point gathered.
        lines = "\n".join(
            f"  rank {r}: {t} {n!r} (key {k})" + (f", registered at\n{o}" if o else "")
            for r, t, n, k, o in rows
        )
        # A row is one rank's finalization: an object registered on a
        # communicator of 4 ranks and finalized cyclically on each of them is
        # 4 rows and one object (one key: keys are the family's, the same on
        # every rank).
        objects = len({k for _, _, _, k, _ in rows})
        ranks = sorted({r for r, _, _, _, _ in rows})
        raise CyclicFinalizationError(
            f"{objects} managed object(s) were finalized by the cyclic collector on "
            f"{len(ranks)} of {self.manager.size} rank(s) ({ranks}; {len(rows)} "
            f"finalization(s), one per object per rank, below) before sync point {seq} of "
            f"{self!r} (strict mode); their destroys ran, but when they die depends on each "
            "rank's allocations. Break the reference cycles (cgc.find_cycles(obj) on a live "
            "instance shows them):\n" + lines
        )


# What a sync call the back-off lets pass returns.
_LET_PASS = CollectStats(destroyed=0, pending=-1, cyclic=0, seconds=0.0, sync=-1)


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


def _describe_cyclic(rank: int, mine: list[tuple[int, str, str, int, str]], seq: int) -> str:
    parts = [
        f"{t} {n!r} (key {k})" + (f" registered at\n{o}" if o else "") for _, t, n, k, o in mine
    ]
    return (
        f"rank {rank}: {len(mine)} managed object(s) finalized by the cyclic collector on this "
        f"rank before sync point {seq}: " + "; ".join(parts)
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
    required and :func:`collective_gc.collect` runs on it.

    ``comm`` may be a communicator or a callable that gets the function's
    arguments and returns one (``comm=lambda self, *args: self.comm``): the
    arguments the function takes by position are passed to it by position
    however the call spelled them (``solve(b=b, x=x)`` too), keyword-only ones
    by keyword where the callable takes them (by name or ``**kwargs``) and not
    at all where it does not. The communicator is found before the function
    runs: if the callable raises, or returns something that is not a
    communicator, or there is neither a communicator nor an open scope, the
    call raises (:class:`CollectiveGCError` for the last) without running the
    function, so that no rank does the function's collective work and then
    skips its sync point.
    If the function raises, no sync point runs.
    """
    import inspect
    import sys

    def signature(of: Callable[..., Any]) -> inspect.Signature | None:
        try:
            return inspect.signature(of)
        except (TypeError, ValueError):  # a builtin without one
            return None

    def takes(of: inspect.Signature | None) -> Callable[[str], bool]:
        # Which keyword arguments the comm callable can be given.
        if of is None or any(p.kind is p.VAR_KEYWORD for p in of.parameters.values()):
            return lambda name: True
        names = {
            p.name
            for p in of.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        return names.__contains__

    def decorate(f: F) -> F:
        # Both signatures are read at the first keyword call, never before:
        # the common call, positional only, pays nothing for them.
        fitted: list[tuple[inspect.Signature | None, Callable[[str], bool]]] = []

        def comm_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> MPI.Comm | None:
            if not callable(comm):
                return comm
            if kwargs:
                if not fitted:
                    fitted.append((signature(f), takes(signature(comm))))
                of_f, accepts = fitted[0]
                if of_f is not None:
                    try:
                        bound = of_f.bind(*args, **kwargs)
                    except TypeError:
                        pass  # the call does not fit f: f raises that itself, below
                    else:
                        args, kwargs = bound.args, bound.kwargs
                kwargs = {k: v for k, v in kwargs.items() if accepts(k)}
            try:
                c = comm(*args, **kwargs)
            except Exception as exc:
                exc.add_note(
                    f"collective_gc: raised by the comm= callable of @sync_point on "
                    f"{_name(f)}, which runs before {f.__qualname__} does: {f.__qualname__} "
                    "was not called"
                )
                raise
            if c is not None and not isinstance(c, MPI.Comm):
                raise TypeError(
                    f"the comm= callable of @sync_point on {_name(f)} returned {c!r}, not an "
                    f"MPI communicator; {f.__qualname__} was not called"
                )
            return c

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c = comm_for(args, kwargs)
            if c is None and not _stack():
                raise _no_scope(f, sys._getframe(1), ran=False)
            result = f(*args, **kwargs)
            # The common case first: the innermost scope is on this very
            # communicator object (what a loop under a back-off calls most).
            stack = _stack()
            top = stack[-1] if stack else None
            scope = top if top is not None and top.comm is c else current_scope(c)
            if scope is not None:
                scope.sync()
            elif c is not None:
                collect(c)
            else:  # f itself closed the scope it was called in
                raise _no_scope(f, sys._getframe(1), ran=True)
            return result

        return wrapper  # type: ignore[return-value]

    def _name(f: Callable[..., Any], qualname: str | None = None) -> str:
        module = getattr(f, "__module__", None)
        name = qualname or str(getattr(f, "__qualname__", repr(f)))
        return name if module in (None, "__main__") else f"{module}.{name}"

    def _no_scope(f: Callable[..., Any], caller: Any, *, ran: bool) -> CollectiveGCError:
        # What the user called: the decorated function, or, for a private one
        # wrapped by a public function of its own module (collective_gc.petsc's
        # solve around _solve), that public function, whose comm= is the fix.
        wrapped_by = None
        if f.__name__.startswith("_") and caller.f_globals.get("__name__") == f.__module__:
            code = caller.f_code
            if not code.co_name.startswith("_"):
                wrapped_by = _name(f, code.co_qualname)
        if wrapped_by is not None:
            what = f"{wrapped_by}() ends in a sync point"
            fix = (
                f"pass it the communicator to sync on ({wrapped_by}(..., comm=comm)), or call "
                "it inside `with collective_gc.collective_scope(comm):`"
            )
        else:
            what = f"{_name(f)}() is a sync point (@collective_gc.sync_point)"
            fix = (
                "give the decorator the communicator to sync on "
                "(@collective_gc.sync_point(comm=comm), or "
                "comm=lambda self, *args: self.comm for a method), or call "
                f"{f.__qualname__} inside `with collective_gc.collective_scope(comm):`"
            )
        called = wrapped_by or _name(f)
        when = (
            f"{called} ran, but the scope it was called in was closed inside it"
            if ran
            else f"Nothing ran: the call was refused before {called} started"
        )
        return CollectiveGCError(
            f"{what}, but no collective_scope is open in this thread and no comm was "
            f"given: {fix}. {when}."
        )

    if fn is not None:
        return decorate(fn)
    return decorate
