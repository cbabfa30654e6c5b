"""Running the agreed destroys of a sync point.

:func:`run` takes the agreed registrations out of their registry in one pass
(:func:`collective_gc._registration.take_batch_py`, or its C twin), then calls
their destroys newest first, every one whatever raises, a run of consecutive
calls to a *batched* destroy at a time (:func:`set_batch`: PETSc objects are
destroyed from C in one call). An interrupt landing between two runs does
not stop them: it is raised once the sync point is done. :func:`raise_failures`
turns what raised on any rank into the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import DestroyError
from ._registration import DESTROYED, SPEEDUPS, take_batch_py
from ._registry import Registry

__all__ = [
    "Failure",
    "set_batch",
    "run",
    "run_each_py",
    "rows_of",
    "raise_failures",
]

# (key, name, exception) of a destroy that raised; key -1 when unknown.
#
# A function that catches exceptions and keeps them past its return (in a
# list of failures) unbinds that list before it returns. A caught exception's
# traceback holds the frame that caught it and, through f_back, every frame
# above it; a frame that still held the exception would close a reference
# cycle that only the cyclic collector frees, and with it everything those
# frames hold (a failed destroy's arguments, a batch of destroyed objects).
# Our users run with that collector off.
Failure = tuple[int, str, BaseException]

Batch = Callable[[list[tuple[Any, ...]]], list[tuple[int, BaseException]]]

# Destroy functions that run a whole run of their calls at once, matched by
# identity (a destroy need not be hashable, nor compare sanely): two parallel
# tuples, replaced together in one store, as the C pass takes the first.
_BATCHES: tuple[tuple[Callable[..., object], ...], tuple[Batch, ...]] = ((), ())


def set_batch(destroy: Callable[..., object], batch: Batch | None) -> None:
    """Let sync points run consecutive destroys by ``destroy`` as one batch. Local.

    ``batch(argss)`` gets the argument tuples of consecutive calls to
    ``destroy``, in the agreed order, and must do what calling
    ``destroy(*args)`` for each would do, in that order, trying every one even
    if some raise; it returns ``(index, exception)`` for those that raised. It
    may replace entries of ``argss`` it is done with (so the destroyed objects
    are freed early). ``None`` removes it.
    """
    global _BATCHES
    pairs = [(f, b) for f, b in zip(*_BATCHES) if f is not destroy]
    if batch is not None:
        pairs.append((destroy, batch))
    _BATCHES = (tuple(f for f, _ in pairs), tuple(b for _, b in pairs))


def run_each_py(
    fns: list[Callable[..., object]], argss: list[tuple[Any, ...]]
) -> list[tuple[int, BaseException]]:
    """What ``_speedups.run_each`` does: ``fns[i](*argss[i])`` for each i, in
    order, every call made even if some raise; (index, exception) of those."""
    errors: list[tuple[int, BaseException]] = []
    for i, (fn, args) in enumerate(zip(fns, argss)):
        try:
            fn(*args)
        except BaseException as exc:  # every call is made; the caller raises after
            errors.append((i, exc))
    try:
        return errors
    finally:
        del errors  # see Failure


# The take and run passes, bound once from the one decision (_registration's
# SPEEDUPS): C where the extension is loaded, else their Python twins.
_take, _run_each = (
    (take_batch_py, run_each_py) if SPEEDUPS is None else (SPEEDUPS.take_batch, SPEEDUPS.run_each)
)


def run(
    registry: Registry, keys: np.ndarray[Any, Any]
) -> tuple[int, list[Failure], BaseException | None]:
    """Destroy the registrations of the agreed ``keys`` (ascending), newest first.

    Newest first: a resource made from another (a KSP from a Mat, a
    sub-communicator from a communicator) goes before its source. Every
    registration is out of the registry and marked destroyed before any
    destroy runs (a destroy reaching for another registration of the batch
    finds it destroyed), and the keys leave the pending keys (nothing a
    destroy queues can be mistaken for them). Returns how many ran, the
    failures, and an interrupt that landed between two runs of destroys.

    Every agreed destroy runs whatever lands in between: the other ranks run
    them all, so a rank that stopped half-way would hold objects the others
    destroyed. An interrupt (KeyboardInterrupt, SystemExit) that lands in
    this function's own steps is returned, for the caller to raise once the
    sync point's collectives are done; anything else that does is a failure
    of the sync point, reported on every rank like a destroy's.
    """
    take, run_each = _take, _run_each
    batched, runners = _BATCHES
    with registry.lock:
        regs, fns, argss, segments = take(registry.live, keys[::-1].tolist(), DESTROYED, batched)
    if segments is None:  # out of memory finding the runs: one by one then
        segments = [(0, len(fns), -1)]
    # The loops test a plain name, not a call: a pending signal is raised at
    # calls and loop back-jumps, and one raised at the outer loop's test
    # (outside the try) would leave the sync point half-way on this rank.
    nruns = len(segments)
    # What each run's runner returned, appended in one step (read at the end),
    # and what raised in this function's own steps.
    ran: list[tuple[int, int, list[tuple[int, BaseException]]]] = []
    errors: list[tuple[int, BaseException]] = []
    own: list[Failure] = []
    interrupt: BaseException | None = None
    removed = False
    pos = 0  # the next run to begin; it counts as begun before it is called
    strikes = 0  # exceptions in a row at one step: past a few, the step is given up
    while not removed or pos < nruns:
        try:
            if not removed:
                registry.remove_pending(keys)  # idempotent: may be made again
                removed = True
                strikes = 0
            while pos < nruns:
                start, end, index = segments[pos]
                if nruns == 1:
                    fchunk, achunk = fns, argss
                else:
                    fchunk, achunk = fns[start:end], argss[start:end]
                # Nothing that can raise from here to the runner's call, which
                # lets nothing out (it makes every call whatever raises).
                pos += 1
                strikes = 0
                try:
                    errors = run_each(fchunk, achunk) if index < 0 else runners[index](achunk)
                except BaseException as runner_exc:
                    # The runner itself failed (out of memory recording a
                    # failure), after trying every call: which one is unknown.
                    errors = [(-1, runner_exc)]
                ran.append((start, end, errors))
                del fchunk, achunk
        except BaseException as exc:  # landed between two runs: the rest still run
            if not isinstance(exc, Exception):
                interrupt = interrupt or exc
            elif strikes == 0:
                own.append((-1, "the sync point's own steps between its destroys", exc))
            strikes += 1
            if strikes >= 3:  # the same step keeps failing (out of memory): give it up
                strikes = 0
                if not removed:
                    removed = True  # the keys stay pending here; their registrations are gone
                else:
                    start, end, _ = segments[pos]
                    pos += 1
                    own.append((-1, f"{end - start} destroys that could not be begun", exc))
    count = len(regs)
    for _ in range(3):
        try:
            failures = own + [
                (regs[start + i].key, regs[start + i].name, exc)
                if i >= 0
                else (-1, f"one of {end - start} destroys", exc)
                for start, end, errors in ran
                for i, exc in errors
            ]
            break
        except BaseException as exc:  # as above: the failures must still be reported
            if not isinstance(exc, Exception):
                interrupt = interrupt or exc
            failures = own + [(-1, "the report of this sync point's failures", exc)]
    del regs, fns, argss  # the destroyed objects go here, unless someone else holds them
    try:
        return count, failures, interrupt
    finally:
        del ran, errors, own, failures, interrupt  # see Failure


def raise_failures(
    rows: list[tuple[int, int, str, str]],
    local: list[BaseException],
    where: str,
    rank: int,
    broken: str | None,
    interrupt: BaseException | None,
) -> None:
    """Raise what the failures of a sync point call for, on this rank.

    ``rows`` are (rank, key, name, message) from every rank, ``local`` this
    rank's exceptions. A rank with an ``interrupt`` to raise (a
    KeyboardInterrupt or SystemExit of a destroy, or of the report itself)
    re-raises it, with a note; every other rank raises :class:`DestroyError`.
    """
    lines = "\n".join(f"  rank {r}, key {k} ({n!r}): {msg}" for r, k, n, msg in rows)
    text = (
        f"{len(rows)} destroy(s) or participant finish(es) raised at {where}; every other "
        f"agreed destroy ran:\n{lines}"
    )
    if broken is not None:
        text += f"\nThis communicator is unusable from now on: {broken}"
    if interrupt is not None:
        interrupt.add_note(
            f"collective_gc: raised by a destroy or a participant's finish on rank {rank}; "
            "every agreed destroy ran, "
            "and the other ranks raised DestroyError. " + text
        )
        try:
            raise interrupt
        finally:
            interrupt = None
            del local  # it holds the interrupt, whose traceback holds this frame
    error = DestroyError(text, rows, local)
    cause = local[0] if local else None
    try:
        raise error from cause
    finally:
        error = cause = None  # type: ignore[assignment]


def rows_of(
    failures: list[Failure], rank: int, interrupts: list[BaseException]
) -> list[tuple[int, int, str, str]]:
    """This rank's failures as picklable rows for :func:`raise_failures`. An
    interrupt raised by an exception's ``str()`` is appended to ``interrupts``
    (for the caller to raise once the report is done), never lost."""
    return [(rank, k, n, _message(e, interrupts)) for k, n, e in failures]


def _message(exc: BaseException, interrupts: list[BaseException]) -> str:
    # The other ranks wait for these rows: an exception whose str() raises
    # still gets one, whatever it raises.
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception as err:  # noqa: BLE001
        return f"{type(exc).__name__}: <str() raised {type(err).__name__}>"
    except BaseException as err:
        interrupts.append(err)
        return f"{type(exc).__name__}: <str() raised {type(err).__name__}>"
