"""Lifecycle: close, exit, fork and freed communicators; whole jobs (marker ``launcher``) for
what happens at exit, after MPI_Finalize and on signals.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import gc
import warnings

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import (
    Obj,
    noop,
)


def test_close_after_a_failed_last_sync_point_then_reuse(comm: MPI.Intracomm) -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    rank = comm.Get_rank()
    ran: list[str] = []

    def fails(tag: str) -> None:
        ran.append(tag)
        raise ValueError(tag)

    mgr = cgc.manager(comm)
    a, b, c = Obj(), Obj(), Obj()
    cgc.register(a, fails, "a", comm=comm)
    rb = cgc.register(b, ran.append, "b", comm=comm)
    rc = cgc.register(c, ran.append, "c", comm=comm)
    del a
    if rank == 0:
        del b  # queued on rank 0 only
    with pytest.raises(cgc.DestroyError):
        mgr.close(timeout=30)
    assert mgr.broken is None  # the close did not happen: its sync point raised
    with pytest.warns(cgc.ExitLeakWarning):
        mgr.close(timeout=30)
    solo = comm.Get_size() == 1
    assert ran == (["b", "a"] if solo else ["a"])
    assert not rb.alive and not rc.alive
    assert rb.state == ("destroyed" if solo else "detached") and rc.state == "detached"
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.collect(comm, timeout=30)
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.register(Obj(), noop, comm=comm)
    del c
    if rank != 0:
        del b
    gc.collect()
    assert ran == (["b", "a"] if solo else ["a"])  # detached: b's and c's finalizers did nothing
    assert mgr.pending() == []


def test_finalizers_after_close_or_after_the_manager_is_forgotten_do_nothing() -> None:
    """Found by the hostile tests of core v2 (issue 14)."""
    comm = MPI.COMM_SELF.Dup()
    try:
        mgr = cgc.manager(comm)
        ran: list[int] = []
        objs = [Obj() for _ in range(100)]
        regs = [cgc.register(o, ran.append, i, comm=comm) for i, o in enumerate(objs)]
        with pytest.warns(cgc.ExitLeakWarning, match="100 registration"):
            mgr.close()
        del objs
        gc.collect()
        assert ran == [] and all(r.state == "detached" for r in regs)
        assert mgr.pending() == [] and mgr.registered == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.close()
    finally:
        comm.Free()
