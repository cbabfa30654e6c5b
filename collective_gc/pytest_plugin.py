"""pytest plugin: a leak check, a strict-mode marker and ``parallel_assert``.

Registered through the ``pytest11`` entry point, so it is active in every
pytest run once collective_gc is installed; with no option and no marker it
only registers its markers and options (and imports neither mpi4py nor
collective_gc). It works serially, under
``mpiexec -n 4 python -m mpi4py -m pytest --with-mpi`` beside pytest-mpi, and
beside Firedrake's mpi-pytest in both its modes; it imports neither.

- ``--cgc-leak-check`` (or ``COLLECTIVE_GC_LEAK_CHECK=1`` in the environment,
  or ``cgc_leak_check = true`` in the ini file; in that order): after
  each test, a final collective sync on every manager the test registered
  objects on; the test fails, on every rank together, if objects it
  registered are still alive or queued. ``@pytest.mark.cgc_leak_check`` turns
  the check on for one test, ``@pytest.mark.cgc_leak_check(False)`` off.
- ``@pytest.mark.cgc_strict``: the test fails if a managed object is finalized
  by the cyclic collector while it runs (as in
  ``collective_scope(strict=True)``).
- :func:`parallel_assert`: every rank learns whether the condition held on all
  of them, and they raise :class:`AssertionError` together.

Both checks run in the teardown of an autouse fixture, so they run on every
rank whether the test passed or not (a check that one rank skipped would
leave the others waiting), after the test's other function-scoped fixtures
were torn down, and they report as an error at teardown. What a fixture's
teardown lets go of (``Manager.close()``, ``detach()``) is noted before it
runs, so the checks still see it.
"""

from __future__ import annotations

import array
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from ._errors import CollectiveGCError, CollectiveTimeoutError

if TYPE_CHECKING:
    from mpi4py import MPI

    from ._manager import Manager
    from ._registration import Registration

__all__ = ["parallel_assert"]

_DEFAULT_TIMEOUT = 60.0
_HERE = os.path.dirname(os.path.abspath(__file__))
# At most this many rounds of collect-and-sync per leak check: a destroy that
# drops more managed objects queues them for the next round.
_ROUNDS = 3


# -- parallel_assert ------------------------------------------------------------


def _not_in_time() -> str:
    return "not every rank arrived before the deadline"


def _reduce(comm: MPI.Comm, values: list[int], op: MPI.Op, deadline: Any) -> list[int]:
    """Collective. Non-blocking allreduce of ints against ``deadline`` (an
    ``_transport.Deadline``, or None): the agreement's own transport (a
    non-blocking collective never matches a blocking one, so every rank
    issues the same kind; what a late rank may still write into is kept).
    Raises CollectiveTimeoutError."""
    from . import _transport

    return _transport.allreduce(comm, array.array("q", values), op, deadline, _not_in_time).tolist()


def _holds(condition: object) -> tuple[bool, str]:
    # Evaluate on this rank; an exception is a local failure, never a skipped
    # collective (which would leave the other ranks waiting).
    try:
        value = condition() if callable(condition) else condition
        return bool(value), ""
    except Exception as exc:  # noqa: BLE001 - any exception is this rank's failure
        return False, f"evaluating the condition raised {_raised(exc)}"


def _raised(exc: BaseException) -> str:
    # Never raises itself (an exception's str() may): the collective must follow.
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (whose str() raised)"


def parallel_assert(
    condition: object,
    msg: str | Callable[[], str] = "",
    comm: MPI.Comm | None = None,
    *,
    timeout: float | None = None,
) -> None:
    """Collective over ``comm`` (default ``MPI.COMM_WORLD``): assert on every rank together.

    Every rank passes its own ``condition`` (a value, or a callable evaluated
    here; an exception it raises counts as a failure on that rank). If it is
    false on any rank, :class:`AssertionError` is raised on *every* rank,
    naming the ranks where it failed and their messages (``msg``: a string,
    or a callable evaluated only on failing ranks). So a condition that fails
    on one rank never leaves the others waiting in the next collective.

    Every rank of ``comm`` must call it, in the same order relative to other
    collectives on ``comm`` (it is one non-blocking allreduce, plus an
    allgather when something failed). A rank that skips it leaves the others
    waiting for ever, or, with ``timeout`` seconds, until they raise
    :class:`AssertionError` saying so; after such a timeout the abandoned
    allreduce still waits to be matched, so ``comm`` must not be used for
    collectives again unless the late ranks do call ``parallel_assert``.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    from mpi4py import MPI

    c = MPI.COMM_WORLD if comm is None else comm
    ok, detail = _holds(condition)
    if not ok and not detail:
        try:
            detail = msg() if callable(msg) else msg
            detail = detail if isinstance(detail, str) else repr(detail)  # gathered: a str
        except Exception as exc:  # noqa: BLE001 - reported, never skips the collective
            detail = f"formatting the message raised {_raised(exc)}"
    size, rank = c.Get_size(), c.Get_rank()
    if size == 1:
        if not ok:
            raise AssertionError(_assert_message([(rank, detail)], size))
        return
    from . import _transport

    deadline = None if timeout is None else _transport.Deadline(time.monotonic() + timeout)
    try:
        agreed = _reduce(c, [int(ok)], MPI.MIN, deadline)
    except CollectiveTimeoutError:
        raise AssertionError(
            f"rank {rank}: parallel_assert did not hear from every rank of a communicator "
            f"of size {size} within {timeout} s (did a rank fail before reaching it, or "
            f"skip it?); here the condition {'held' if ok else 'failed: ' + detail}"
        ) from None
    if agreed[0]:
        return
    # Every rank got here together, so this blocking gather cannot wait for long.
    failed = [(r, d) for r, d in enumerate(c.allgather(None if ok else detail)) if d is not None]
    raise AssertionError(_assert_message(failed, size))


def _assert_message(failed: list[tuple[int, str]], size: int) -> str:
    ranks = ", ".join(str(r) for r, _ in failed)
    texts = {d for _, d in failed}
    head = f"parallel assertion failed on rank(s) {ranks} of {size}"
    if len(texts) == 1:
        (text,) = texts
        return f"{head}: {text}" if text else head
    return head + ":\n" + "\n".join(f"  rank {r}: {d}" for r, d in failed)


# -- options and markers ----------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("collective_gc", "collective_gc checks")
    group.addoption(
        "--cgc-leak-check",
        action="store_true",
        default=None,
        help="after each test, sync the collective_gc managers it used and fail it "
        "if objects it registered are still alive or queued (env: COLLECTIVE_GC_LEAK_CHECK=1; "
        "ini: cgc_leak_check)",
    )
    group.addoption(
        "--cgc-timeout",
        type=float,
        default=None,
        help="seconds the checks' own collectives may wait for the other ranks "
        f"(env: COLLECTIVE_GC_TIMEOUT; ini: cgc_timeout; default {_DEFAULT_TIMEOUT:g})",
    )
    parser.addini(
        "cgc_leak_check", "collective_gc leak check for every test", type="bool", default=False
    )
    parser.addini(
        "cgc_timeout", "deadline of the collective_gc checks' collectives, seconds", default=""
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cgc_leak_check(enabled=True): run (or, with False, skip) collective_gc's leak "
        "check after this test, whatever --cgc-leak-check says",
    )
    config.addinivalue_line(
        "markers",
        "cgc_strict: fail this test if a collective_gc-managed object is finalized by "
        "the cyclic collector while it runs",
    )
    leak, timeout = _settings(config)
    config.stash[_STATE] = _State(leak_default=leak, timeout=timeout)


# The environment's names for the two settings. mpi-pytest's forking mode
# re-runs each parallel test as `mpiexec ... pytest --runxfail -s -q file::test`:
# the children find the same ini file and inherit the environment, but never
# see the parent's command line.
LEAK_CHECK_ENV = "COLLECTIVE_GC_LEAK_CHECK"
TIMEOUT_ENV = "COLLECTIVE_GC_TIMEOUT"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _settings(config: pytest.Config) -> tuple[bool, float]:
    """The leak check default and the timeout: command line, else environment, else ini."""
    leak: bool | None = config.getoption("cgc_leak_check")
    timeout: float | None = config.getoption("cgc_timeout")
    from_command_line = (leak is not None, timeout is not None)
    if leak is None and LEAK_CHECK_ENV in os.environ:
        raw = os.environ[LEAK_CHECK_ENV].strip().lower()
        if raw not in _TRUE + _FALSE:
            raise pytest.UsageError(
                f"{LEAK_CHECK_ENV}={os.environ[LEAK_CHECK_ENV]!r}: expected one of "
                f"{', '.join(_TRUE + _FALSE[:-1])} (or empty)"
            )
        leak = raw in _TRUE
    if timeout is None and os.environ.get(TIMEOUT_ENV, "").strip():
        try:
            timeout = float(os.environ[TIMEOUT_ENV])
        except ValueError:
            raise pytest.UsageError(
                f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r}: expected a number of seconds"
            ) from None
    if leak is None:
        leak = bool(config.getini("cgc_leak_check"))
    if timeout is None:
        raw = str(config.getini("cgc_timeout")).strip()
        timeout = float(raw) if raw else _DEFAULT_TIMEOUT
    if config.pluginmanager.has_plugin("mpi-pytest"):
        # Hand the command-line values to mpi-pytest's forked children (see
        # above); values from the environment or the ini reach them already.
        if from_command_line[0]:
            os.environ[LEAK_CHECK_ENV] = "1" if leak else "0"
        if from_command_line[1]:
            os.environ[TIMEOUT_ENV] = repr(float(timeout))
    return bool(leak), float(timeout)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None and state.notice is not None:
        state.notice.close(False)  # local: no receive of ours is posted at MPI_Finalize
        state.notice = None
    if state is not None and state.comm is not None and state.broken is None:
        # Collective, and every rank gets here (unless one aborted, when the
        # job is over anyway).
        state.comm.Free()
        state.comm = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The call report is logged before the teardown, where the leak check runs.
    if report.when == "call" and report.failed:
        _FAILED_CALLS.add(report.nodeid)


# -- the per-test checks ----------------------------------------------------------


@dataclass
class _State:
    leak_default: bool
    timeout: float
    # A private duplicate of COMM_WORLD for the checks' own agreement, made at
    # the first check (at the same test on every rank), so it never matches a
    # test's own collectives on COMM_WORLD.
    comm: Any = None
    # A family state of comm's own, for its watch: a rank that gives up at its
    # deadline tells the others, so a late rank fails at once instead of
    # carrying on alone.
    notice: Any = None
    broken: str | None = None

    def deadline(self, at: float) -> Any:
        """An ``_transport.Deadline`` at ``at`` for the checks' collectives on ``comm``."""
        from . import _transport

        dl = _transport.Deadline(at)
        dl.watch = self.notice
        return dl


def _watch_of(comm: Any) -> Any:
    """A family state over ``comm`` used only for its watch (local)."""
    from ._registration import GC, Registration
    from ._state import FamilyState
    from ._syncpoint import CollectStats

    watch = FamilyState(comm.Get_rank(), comm.Get_size(), GC, Registration, CollectStats)
    watch.open(comm, False)
    return watch


_STATE = pytest.StashKey[_State]()
# One rank's findings: strict rows, leak rows (rank, text), sync errors, and
# whether the test's call failed on this rank.
_Report = tuple[list[tuple[str, str]], list[tuple[str, str]], list[str], bool]
_FAILED_CALLS: set[str] = set()


@dataclass
class _Watch:
    """What one checked test started from, on this rank."""

    leak: bool
    strict: bool
    # next_key of each manager when the test started: keys from there on were
    # registered by the test (managers made during it start from 0).
    keys: dict[Manager, int] = field(default_factory=dict)
    local: set[int] = field(default_factory=set)
    # Keys of the cyclic deaths left in each manager's inbox before the test.
    before: dict[Manager, set[int]] = field(default_factory=dict)
    # Read at the end of the call, before the test's fixtures are torn down
    # (see _before_teardown): the managers then in use, and the registrations
    # the test left alive or queued, with that state. A fixture's teardown may
    # let go of both (Manager.close(), detach()); the checks, which run after
    # it, still see them.
    # The cyclic-death count of each family in use when the test began.
    cyclic_of: dict[Any, int] = field(default_factory=dict)
    held: list[Manager] = field(default_factory=list)
    left: list[tuple[Registration, str, int]] = field(default_factory=list)


def _wants(item: pytest.Item, state: _State) -> tuple[bool, bool]:
    marker = item.get_closest_marker("cgc_leak_check")
    leak = state.leak_default
    if marker is not None:
        leak = bool(marker.kwargs.get("enabled", marker.args[0] if marker.args else True))
    return leak, item.get_closest_marker("cgc_strict") is not None


@pytest.fixture(autouse=True)
def _cgc_checks(request: pytest.FixtureRequest) -> Iterator[None]:
    """collective_gc's leak check and strict mode around one test (see the module docs)."""
    state = request.config.stash.get(_STATE, None)
    leak, strict = (False, False) if state is None else _wants(request.node, state)
    if not (leak or strict) or state is None or state.broken is not None:
        yield
        return
    watch = _begin(leak, strict)
    request.node.stash[_WATCHED] = watch
    try:
        yield
    finally:
        del request.node.stash[_WATCHED]
        _drop_fixture_values(request.node)
        _end(watch, state, request.node)


_WATCHED = pytest.StashKey[_Watch]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Before any fixture of the test is torn down (the checks themselves run
    # after all of them): see _before_teardown.
    watch = item.stash.get(_WATCHED, None)
    if watch is not None:
        _before_teardown(watch)
    yield


def _before_teardown(watch: _Watch) -> None:
    """What the test left, read before its fixtures are torn down. Local.

    A fixture that closes its communicator's manager (the testing guide's)
    or detaches what the test left, to keep tests apart, lets go of the
    registrations still there: closed, the manager leaves ``managers()``;
    detached, the registrations leave their manager. The checks run after
    that teardown (so that what a fixture holds until then is not a leak),
    and would see none of it: here they keep the managers (their cyclic
    deaths stay readable once closed) and the test's live registrations
    (one the teardown detached without its destroy is a leak)."""
    from ._lookup import managers

    if watch.strict:
        # Cycles the test left die now, while their managers are open: their
        # deaths are seen as cyclic (closed first, a manager detaches them).
        gc.collect()
    watch.held = managers()
    if watch.leak:
        for mgr in watch.held:
            start = watch.keys.get(mgr, 0)
            if mgr.next_key > start:
                watch.left += [
                    (r, r.state, mgr.size) for r in mgr.alive() + mgr.pending() if r.key >= start
                ]


def _drop_fixture_values(item: pytest.Item) -> None:
    # pytest lets go of the fixture values it passed to the test only after
    # every teardown hook has run; by now every function-scoped fixture has
    # been torn down (ours is the first set up, so the last torn down), and
    # their values would look leaked. Wider-scoped values stay: their
    # fixtures are still live. Private attribute: if it is gone, keep all.
    funcargs = getattr(item, "funcargs", None)
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", None)
    if not isinstance(funcargs, dict) or not isinstance(defs, dict):
        return
    for name, fixturedefs in defs.items():
        if name in funcargs and fixturedefs and getattr(fixturedefs[-1], "scope", "") == "function":
            del funcargs[name]


def _begin(leak: bool, strict: bool) -> _Watch:
    from . import _registration, local
    from ._lookup import managers
    from ._manager import family

    watch = _Watch(leak, strict)
    if strict:
        # Cycles left by earlier tests die now, not during this one; drain so
        # that their counts are in the baseline.
        gc.collect()
        for mgr in managers():
            watch.before[mgr] = {r.key for r in mgr.cyclic_pending()}
            fam = family(mgr)
            if fam is not None:
                # The count and the log of cyclic deaths are the family's: a
                # manager made during the test that joins this family (a
                # fresh Dup of a communicator in use) starts from here.
                watch.cyclic_of.setdefault(fam, mgr.cyclic)
        # Name where each object was registered in the failure message.
        _registration.track_origins(True)  # (taken back at its end: _end_strict)
    if leak:
        watch.keys = {mgr: mgr.next_key for mgr in managers()}
        watch.local = set(local.live())
    return watch


def _checks_comm(state: _State, deadline: float) -> Any:
    """The checks' private duplicate of COMM_WORLD, made at the first check
    (at the same test on every rank) against the checks' deadline; None when
    serial or when it could not be made."""
    from mpi4py import MPI

    from . import _transport

    world = MPI.COMM_WORLD
    if state.comm is None and state.broken is None and world.Get_size() > 1:
        try:
            comm = _transport.dup(world, _transport.Deadline(deadline), _not_in_time)
        except CollectiveTimeoutError:
            state.broken = "making its own communicator timed out"
            return None
        state.comm = comm
        state.notice = _watch_of(comm)
    return state.comm


def _end(watch: _Watch, state: _State, item: pytest.Item) -> None:
    from mpi4py import MPI

    deadline = time.monotonic() + state.timeout
    strict_rows = _end_strict(watch) if watch.strict else []
    leak_rows: list[tuple[str, str]] = []
    errors: list[str] = []
    world = MPI.COMM_WORLD
    comm = _checks_comm(state, deadline)
    if watch.leak and state.broken is None:
        used, errors = _agree_used(watch, state, comm, deadline)
        if state.broken is None:
            errors += _final_syncs(used, state, deadline)
            leak_rows = _leaks(watch)
    failed_here = item.nodeid in _FAILED_CALLS
    _FAILED_CALLS.discard(item.nodeid)
    mine: _Report = (strict_rows, leak_rows, errors, failed_here)
    everyone = [mine]
    if comm is not None and state.broken is None:
        flags = [int(bool(strict_rows or leak_rows or errors)), int(failed_here)]
        try:
            agreed = _reduce(comm, flags, MPI.MAX, state.deadline(deadline))
        except CollectiveTimeoutError as exc:
            state.broken = f"its agreement: {exc}"
        else:
            if agreed[0]:
                # Something to report somewhere: every rank is here, gather it all.
                from . import _transport

                try:
                    everyone = _transport.allgather(
                        comm, mine, state.deadline(deadline), _not_in_time
                    )
                except CollectiveTimeoutError as exc:
                    state.broken = f"gathering its report: {exc}"
    if state.broken is not None:
        pytest.fail(
            f"collective_gc checks: rank {world.Get_rank()} stopped waiting for the other "
            f"ranks at the end of this test, within its {state.timeout:g} s ({state.broken}): "
            "did a rank stop, or hang in the test? The checks are off for the rest of the "
            "session",
            pytrace=False,
        )
    _raise(everyone, item)


def _identity(mgr: Manager) -> tuple[tuple[int, ...], int] | None:
    """The same on every rank for the same communicator: its ranks in
    COMM_WORLD, and its position among the managers of that group. Local."""
    from mpi4py import MPI

    from ._lookup import managers

    def group_of(m: Manager) -> tuple[int, ...] | None:
        if m.comm_freed or m.broken is not None:
            return None
        group, world = m.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(m.size)), world)
        finally:
            group.Free()
            world.Free()
        return tuple(int(r) for r in ranks)

    mine = group_of(mgr)
    if mine is None:
        return None
    ordinal = 0
    for other in managers():
        if other is mgr:
            break
        if other.size == mgr.size and group_of(other) == mine:
            ordinal += 1
    return mine, ordinal


def _agree_used(
    watch: _Watch, state: _State, comm: Any, deadline: float
) -> tuple[list[Manager], list[str]]:
    """Collective over COMM_WORLD: which managers to sync for this test.

    Those the test registered objects on (their next key moved), once the
    ranks agree that every rank of each such communicator registered the same
    number of objects on it; a communicator where they did not is reported
    (what was registered where) and left alone: syncing it would wait for
    ranks that will never come.
    """
    from . import _transport
    from ._lookup import managers

    used = [m for m in managers() if m.next_key > watch.keys.get(m, 0) and m.broken is None]
    if comm is None:
        return used, []
    rank = comm.Get_rank()
    manifest = []
    for mgr in used:
        ident = _identity(mgr)
        if ident is not None:
            start = watch.keys.get(mgr, 0)
            names = sorted({r.name for r in mgr.alive() + mgr.pending() if r.key >= start})
            manifest.append((ident, mgr.next_key - start, names[:3]))
    try:
        everyone = _transport.allgather(comm, manifest, state.deadline(deadline), _not_in_time)
    except CollectiveTimeoutError as exc:
        state.broken = f"the leak check's agreement: {exc}"
        return [], []
    counts: dict[tuple[tuple[int, ...], int], dict[int, tuple[int, list[str]]]] = {}
    for r, rows in enumerate(everyone):
        for ident, count, names in rows:
            counts.setdefault(ident, {})[r] = (count, names)
    bad: set[tuple[tuple[int, ...], int]] = set()
    errors = []
    for ident, per_rank in counts.items():
        members = ident[0]
        if set(per_rank) == set(members) and len({c for c, _ in per_rank.values()}) == 1:
            continue
        bad.add(ident)
        if rank != min(per_rank):
            continue  # one rank words it; every rank fails the test alike
        said = "; ".join(
            f"rank {r} registered {c} ({', '.join(map(repr, n))})"
            for r, (c, n) in sorted(per_rank.items())
        )
        silent = sorted(set(members) - set(per_rank))
        if silent:
            said += f"; rank(s) {', '.join(map(str, silent))} registered none"
        errors.append(
            f"the ranks of a communicator of size {len(members)} (COMM_WORLD ranks "
            f"{', '.join(map(str, members))}) registered different numbers of objects on "
            f"it during this test (register is collective): {said}. Its final sync point "
            "was skipped; its next one will raise CollectiveMismatchError"
        )
    keep = [m for m in used if _identity(m) not in bad]
    return keep, errors


def _end_strict(watch: _Watch) -> list[tuple[str, str]]:
    from . import _registration
    from ._lookup import managers

    try:
        gc.collect()  # cycles the test left behind die here, inside the watch
    finally:
        _registration.track_origins(False)
    from mpi4py import MPI

    from ._manager import family

    rank = MPI.COMM_WORLD.Get_rank()
    rows: list[tuple[str, str]] = []
    # The managers in use now and those held at the end of the call (a
    # fixture may have closed them since), once each; the deaths sync points
    # saw are read once per family (its log is shared by its members).
    seen_families: set[Any] = set()
    for mgr in list(dict.fromkeys([*managers(), *watch.held])):
        fam = family(mgr)
        # Keys are the family's: what any of its members had queued at the start.
        before = {k for m, keys in watch.before.items() if family(m) is fam for k in keys}
        deaths = []
        if fam is not None and fam not in seen_families:
            seen_families.add(fam)
            # Those sync points saw during the test...
            deaths = mgr.cyclic_deaths(since=watch.cyclic_of.get(fam, 0))
        # ...then those still queued on this communicator.
        deaths += [(r.typename, r.name, r.key, r.origin) for r in mgr.cyclic_pending()]
        for typename, name, key, origin in deaths:
            if key in before:
                continue  # died before the test began
            where = ""
            if origin is not None:
                # The user's frames, not the registering adapter's.
                frames = [f for f in origin if not f.filename.startswith(_HERE)][-2:]
                where = " registered at " + "; ".join(f"{f.filename}:{f.lineno}" for f in frames)
            text = f"{typename} {name!r} (key {key}) on a communicator of size {mgr.size}"
            rows.append((str(rank), text + where))
    return rows


def _final_syncs(used: list[Manager], state: _State, deadline: float) -> list[str]:
    """Collective over COMM_WORLD (through the plugin's duplicate): sync the
    managers the test registered objects on (agreed by :func:`_agree_used`),
    until no more destroys run.

    Managers are visited in creation order, which is the same on every rank
    that shares them, so no two ranks wait for each other in opposite orders.
    """
    from mpi4py import MPI

    from . import local

    errors: list[str] = []
    for round_ in range(_ROUNDS):
        if round_ == 0:
            # Once: a full collection costs tens of ms in a test process (more on
            # oversubscribed ranks), and what later rounds find was dropped by
            # destroys, by refcount.
            gc.collect()
        local.flush(max(0.0, deadline - time.monotonic()))
        destroyed = 0
        for mgr in used:
            if mgr.broken is not None:
                continue
            try:
                stats = mgr.sync(deadline=deadline, final=True)
                # A derived family's visit may have dropped more (agreed alike).
                destroyed += stats.destroyed + stats.visits
            except CollectiveGCError as exc:
                errors.append(f"rank {mgr.rank} of a communicator of size {mgr.size}: {exc}")
        if state.comm is None:
            if not destroyed or errors:
                break
            continue
        # Another round only if some rank destroyed something (its destroys
        # may have dropped more managed objects) and nothing went wrong.
        try:
            agreed = _reduce(
                state.comm,
                [int(destroyed > 0), int(bool(errors))],
                MPI.MAX,
                state.deadline(deadline),
            )
        except CollectiveTimeoutError as exc:
            state.broken = f"the leak check's sync rounds: {exc}"
            break
        if not agreed[0] or agreed[1]:
            break
    local.flush(max(0.0, deadline - time.monotonic()))
    return errors


def _leaks(watch: _Watch) -> list[tuple[str, str]]:
    from mpi4py import MPI

    from . import local
    from ._lookup import managers

    rank = MPI.COMM_WORLD.Get_rank()
    rows: list[tuple[str, str]] = []
    for mgr in managers():
        start = watch.keys.get(mgr, 0)
        if mgr.next_key <= start:
            continue
        found = [r for r in mgr.alive() + mgr.pending() if r.key >= start]
        for reg in found:
            rows.append((str(rank), _describe(reg, f"a communicator of size {mgr.size}")))
        if found:
            # Why they live, where an adapter can tell (an owner kept alive
            # by its own resource, say).
            rows.extend((str(rank), f"  why: {why}") for why in mgr.leak_reasons())
    for reg, was, size in watch.left:
        if reg.state == "detached":
            # Alive or queued at the end of the test, let go of by its
            # teardown (a fixture's Manager.close() or detach()) without its
            # destroy: a leak the teardown only hid.
            rows.append(
                (
                    str(rank),
                    f"{reg.typename} {reg.name!r} (key {reg.key}), {was}, on a communicator "
                    f"of size {size}, detached by the test's teardown without its destroy "
                    "(a fixture's Manager.close() or detach())",
                )
            )
    live = local.live()
    for key in sorted(set(live) - watch.local):
        rows.append((str(rank), _describe(live[key], "the rank-local reaper (comm=None)")))
    return rows


def _describe(reg: Registration, where: str) -> str:
    state = "queued" if reg.state == "queued" else "alive"
    return f"{reg.typename} {reg.name!r} (key {reg.key}), {state}, on {where}"


def _group(rows: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    # The same object is usually reported by every rank: one line, its ranks.
    out: dict[str, list[str]] = {}
    for rank, text in rows:
        out.setdefault(text, []).append(rank)
    return out


def _lines(groups: dict[str, list[str]], limit: int = 20) -> str:
    # A test that leaks in a loop would otherwise print thousands of lines.
    lines = [f"  rank(s) {', '.join(ranks)}: {text}" for text, ranks in groups.items()]
    if len(lines) > limit:
        lines[limit:] = [f"  ... and {len(lines) - limit} more"]
    return "\n".join(lines)


def _raise(everyone: list[_Report], item: pytest.Item) -> None:
    strict = _group(row for per in everyone for row in per[0])
    errors = [e for per in everyone for e in per[2]]
    # A test that already failed keeps its locals alive in the traceback: its
    # leak report would be noise, so only its other problems are reported.
    failed = any(per[3] for per in everyone)
    leaks = {} if failed else _group(row for per in everyone for row in per[1])
    parts = []
    if strict:
        parts.append(
            f"{sum(len(r) for r in strict.values())} managed object(s) were finalized by "
            "the cyclic collector during this test (cgc_strict); when they die depends "
            "on each rank's allocations. "
            "Break their reference cycles (collective_gc.find_cycles(obj) shows them):\n"
            + _lines(strict)
        )
    if leaks:
        parts.append(
            f"{sum(len(r) for r in leaks.values())} managed object(s) registered during this "
            "test are still alive or queued after its final sync point (a reference kept in "
            "a global, a cache or a wider fixture? an object dropped on some ranks only?):\n"
            + _lines(leaks)
        )
    if errors:
        parts.append("the final sync points raised:\n" + "\n".join(f"  {e}" for e in errors))
    if parts:
        pytest.fail(
            f"collective_gc checks failed for {item.nodeid}:\n" + "\n".join(parts), pytrace=False
        )
