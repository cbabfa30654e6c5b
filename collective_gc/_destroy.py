"""Running the agreed destroys of a sync point: the batched destroys, and the report.

:func:`run` hands the agreed keys to the family's state
(:meth:`~collective_gc._state.FamilyState.destroy`, in C where the extension
is built), which takes the registrations out in one pass and calls their
destroys newest first, every one whatever raises, a run of consecutive calls
to a *batched* destroy at a time (:func:`set_batch`: PETSc objects are
destroyed from C in one call). An interrupt landing between two runs does
not stop them: it is raised once the sync point is done. :func:`raise_failures`
turns what raised on any rank into the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import DestroyError
from ._state import FamilyState

__all__ = [
    "Failure",
    "set_batch",
    "run",
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
BATCHES: tuple[tuple[Callable[..., object], ...], tuple[Batch, ...]] = ((), ())


def set_batch(destroy: Callable[..., object], batch: Batch | None) -> None:
    """Let sync points run consecutive destroys by ``destroy`` as one batch. Local.

    ``batch(argss)`` gets the argument tuples of consecutive calls to
    ``destroy``, in the agreed order, and must do what calling
    ``destroy(*args)`` for each would do, in that order, trying every one even
    if some raise; it returns ``(index, exception)`` for those that raised. It
    may replace entries of ``argss`` it is done with (so the destroyed objects
    are freed early). ``None`` removes it.
    """
    global BATCHES
    pairs = [(f, b) for f, b in zip(*BATCHES) if f is not destroy]
    if batch is not None:
        pairs.append((destroy, batch))
    BATCHES = (tuple(f for f, _ in pairs), tuple(b for _, b in pairs))


def run(
    state: FamilyState, keys: np.ndarray[Any, Any]
) -> tuple[int, list[Failure], BaseException | None]:
    """Destroy the registrations of the agreed ``keys`` (ascending), newest
    first (a resource made from another, a KSP from a Mat, goes before its
    source): how many ran, the failures, and an interrupt that landed
    between two runs of destroys (for the caller to raise once the sync
    point's collectives are done). See FamilyState.destroy."""
    batched, runners = BATCHES
    return state.destroy(keys.tobytes(), batched, runners)


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
