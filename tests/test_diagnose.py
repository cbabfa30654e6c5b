"""find_cycles and view."""

from __future__ import annotations

import contextlib
import gc
import io

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import Obj, noop


class KSPWrapper:
    def __init__(self, owner: object) -> None:
        self.owner = owner


class Solver:
    __slots__ = ("ksp", "cache", "__weakref__")


def test_find_cycles_readable_paths() -> None:
    s = Solver()
    s.ksp = KSPWrapper(s)
    s.cache = {"last": [s]}
    cycles = cgc.find_cycles(s)
    assert "Solver.ksp -> KSPWrapper.owner -> Solver" in cycles
    assert "Solver.cache -> dict['last'] -> list[0] -> Solver" in cycles
    assert cgc.find_cycles(KSPWrapper(None)) == []
    # A closure cycle.
    o = Obj()
    o.cb = lambda: o
    assert any("Obj.cb" in c for c in cgc.find_cycles(o))


def test_find_cycles_returns_at_most_limit_paths() -> None:
    """Its docstring's promise. Before the search was shared with the PETSc
    adapter, it stopped only after the object on which it reached
    ``limit``, so one object with many references back gave them all."""
    o = Obj()
    o.back = [o] * 20  # twenty cycles closed by the same list
    assert len(cgc.find_cycles(o)) == 10
    assert cgc.find_cycles(o, limit=3) == ["Obj.back -> list[0] -> Obj"] + [
        f"Obj.back -> list[{i}] -> Obj" for i in (1, 2)
    ]
    assert cgc.find_cycles(o, limit=0) == []


@pytest.mark.parametrize("comm", [MPI.COMM_SELF, MPI.COMM_WORLD], ids=["self", "world"])
def test_view_lists_queued_on_every_rank(comm: MPI.Intracomm) -> None:
    c = comm.Dup()
    try:
        o = Obj()
        cgc.register(o, print, comm=c, name="solver-ksp")
        keep = Obj()
        cgc.register(keep, print, comm=c, name="alive")
        del o
        buf = io.StringIO()
        text = cgc.view(c, file=buf)
        lines = [line for line in text.splitlines() if "solver-ksp" in line]
        assert len(lines) == c.Get_size()  # one row per rank
        assert "alive" not in text
        assert (buf.getvalue() == text) == (c.Get_rank() == 0)
        cgc.collect(c)
        cgc.manager(c).alive()[0].detach()
    finally:
        c.Free()


class BrokenView(cgc.Participant):
    """A participant whose rows for the view raise on rank 0 only."""

    def view_rows(self, mgr: cgc.Manager) -> list[tuple[str, str]]:
        if mgr.rank == 0:
            raise RuntimeError("these rows broke")
        return [("fine", "a row")]


def test_view_rows_that_raise_on_one_rank_are_a_row_everywhere(comm: MPI.Intracomm) -> None:
    # view gathers every rank's rows: a participant whose rows raised on one
    # rank would have left the others waiting in the gather.
    own = comm.Dup()  # the participant leaves with it
    mgr = cgc.manager(own)
    try:
        mgr.add_participant(BrokenView())
        text = cgc.view(own, file=None, timeout=30)
        assert "<view>" in text and "RuntimeError: these rows broke" in text
        assert ("a row" in text) == (comm.Get_size() > 1)
    finally:
        mgr.close(timeout=30)
        own.Free()
    assert BrokenView not in {type(p) for p in cgc.manager(comm).participants}


def test_diagnostics_do_not_silence_strict_mode(comm: MPI.Intracomm) -> None:
    """Issue 11, defects 8 and 9."""
    with cgc.collective_scope(comm, strict=True) as scope:
        o = Obj()
        o.peer = o
        cgc.register(o, noop, comm=comm, name="cyclic-one")
        del o
        gc.collect()
        assert [r.name for r in cgc.pending(comm)] == ["cyclic-one"]
        assert "cyclic-one" in cgc.view(comm, file=None)
        assert cgc.pending(comm)[0].state == "queued"
        with pytest.raises(cgc.CyclicFinalizationError, match="cyclic-one"):
            scope.sync()


def test_view_writes_to_the_current_stdout(comm: MPI.Intracomm) -> None:
    """Issue 11, defect 19."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        text = cgc.view(comm)
    if comm.Get_rank() == 0:
        assert buf.getvalue() == text and "queued on a communicator" in text
    else:
        assert buf.getvalue() == ""
