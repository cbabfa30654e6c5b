"""The one C/Python decision of a process.

``collective_gc._speedups`` has C versions of the steps that run once per
managed object (registration, the finalizer, a sync point's pass over its
agreed registrations) and, where it was built with the MPI compiler wrapper
and mpi4py's C API, the steady state of a sync point in one call. Whether a
process uses it is decided here, once, at import (as CPython's ``heapq`` takes
``_heapq``'s functions when it is there): it is loaded unless it was not built
or ``COLLECTIVE_GC_PURE_PYTHON=1`` blocks it. Every module that has a C twin
binds it at import from this one decision (``SPEEDUPS`` or ``STEADY``), so a
process never mixes the two and nothing switches them later: a registration
made with one finalizer and a sync point taking it with the other's
assumptions would be tested nowhere. ``make test`` runs the whole suite a
second time with the extension blocked, as CPython's test_heapq runs without
``_heapq``.
"""

from __future__ import annotations

import os
import types

__all__ = ["PURE_PYTHON", "SPEEDUPS", "STEADY", "speedups"]

PURE_PYTHON = os.environ.get("COLLECTIVE_GC_PURE_PYTHON", "") not in ("", "0")


def _load() -> types.ModuleType | None:
    if PURE_PYTHON:
        return None
    try:
        from . import _speedups
    except ImportError:  # built without a C compiler: the Python versions do it all
        return None
    return _speedups


# The extension, or None.
SPEEDUPS = _load()


def _steady() -> types.ModuleType | None:
    if SPEEDUPS is None or not getattr(SPEEDUPS, "HAVE_MPI", False):
        return None
    # mpi4py's C API imported, and the MPI library it uses the one the
    # extension was built against (else its handles would be another MPI's).
    return SPEEDUPS if SPEEDUPS.mpi_ready() else None


# The same module where it was built with MPI (its steady state of a sync
# point, through mpi4py's C API, against the MPI library mpi4py uses), else
# None: sync points then run from Python, the reference.
STEADY = _steady()


def speedups() -> str:
    """``"c+mpi"`` where this process runs the extension's sync-point steady
    state too, ``"c"`` where it runs only its per-object steps, ``"python"``
    where it runs none of it (not built, or blocked by
    ``COLLECTIVE_GC_PURE_PYTHON=1``). A read: the decision is taken once, at
    import."""
    if SPEEDUPS is None:
        return "python"
    return "c+mpi" if STEADY is not None else "c"
