"""The one C/Python decision of a process.

``collective_gc._speedups`` holds the typed state of collective_gc in C
(collective_gc._state: a family's state, the registrations' fields, the
collector's and the protected regions' state), with the per-object steps and
a sync point's steady state, reaching MPI through mpi4py's C API. Whether a
process uses it is decided here, once, at import (as CPython's ``heapq``
takes ``_heapq``'s functions when it is there): it is loaded unless it was
not built (no MPI compiler wrapper, or no mpi4py headers, at install), its
MPI library is not the one mpi4py uses, or ``COLLECTIVE_GC_PURE_PYTHON=1``
blocks it. collective_gc._state binds its types from this one decision, so
a process never mixes the two and nothing switches them later. ``make
test`` runs the whole suite a second time with the extension blocked, as
CPython's test_heapq runs without ``_heapq``.
"""

from __future__ import annotations

import os

__all__ = ["PURE_PYTHON", "SPEEDUPS", "speedups"]

PURE_PYTHON = os.environ.get("COLLECTIVE_GC_PURE_PYTHON", "") not in ("", "0")

try:
    if PURE_PYTHON:
        raise ImportError("blocked by COLLECTIVE_GC_PURE_PYTHON=1")
    from . import _speedups as SPEEDUPS
except ImportError:  # not built, or built against another MPI: the Python twins do it all
    SPEEDUPS = None  # type: ignore[assignment]


def speedups() -> str:
    """``"c+mpi"`` where this process runs the extension (built with MPI's
    compiler wrapper and mpi4py's C API), ``"python"`` where it runs none of
    it (not built, or blocked by ``COLLECTIVE_GC_PURE_PYTHON=1``). A read:
    the decision is taken once, at import."""
    return "python" if SPEEDUPS is None else "c+mpi"
