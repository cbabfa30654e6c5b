"""collective_gc.mpi: managed MPI windows and files, and the null-first rule.

``MPI.Win.Create`` fails in a singleton (non-mpiexec) process here, so window
tests need ranks; file tests run on COMM_SELF too.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import mpi as cmpi

from _util import GcDisabled, same_on_all, windows_or_skip


class Owner:
    """A wrapper that owns MPI handles (``me`` makes it a self-cycle)."""

    win: Any
    fh: Any
    me: Any


def shared_dir(comm: MPI.Comm) -> str:
    """A new directory, the same on every rank of comm (one per rank on COMM_SELF)."""
    path = tempfile.mkdtemp(prefix="cgc-mpi-") if comm.Get_rank() == 0 else None
    return comm.bcast(path, root=0)  # type: ignore[no-any-return]


def open_file(comm: MPI.Comm, path: str) -> MPI.File:
    return MPI.File.Open(comm, path, MPI.MODE_CREATE | MPI.MODE_RDWR)


class FileTests:
    COMM: MPI.Intracomm

    def test_file_closed_at_sync_after_cyclic_death(self, comm: MPI.Intracomm) -> None:
        path = os.path.join(shared_dir(comm), "data.bin")
        rank = comm.Get_rank()
        with GcDisabled():
            owner = Owner()
            owner.fh = open_file(comm, path)
            owner.me = owner
            fh = owner.fh
            cmpi.manage(owner, owner.fh, comm=comm, name="output")
            fh.Write_at_all(8 * rank, np.array([rank], dtype=np.int64))
            del owner
            gc.collect()  # dies in the cyclic collector: only queued
            assert fh != MPI.FILE_NULL
            assert cgc.collect(comm).destroyed == 1
        assert fh == MPI.FILE_NULL  # nulled by the managed close
        comm.Barrier()
        data = np.fromfile(path, dtype=np.int64)
        assert data.tolist() == list(range(comm.Get_size()))

    def test_close_twice_is_harmless(self, comm: MPI.Intracomm) -> None:
        path = os.path.join(shared_dir(comm), "twice.bin")
        owner = Owner()
        owner.fh = open_file(comm, path)
        fh = owner.fh
        cmpi.manage(owner, owner.fh, comm=comm)
        cmpi.close_file(fh)  # the user closes it early, on every rank
        cmpi.close_file(fh)  # and again: nothing happens
        assert fh == MPI.FILE_NULL
        del owner
        assert cgc.collect(comm).destroyed == 1  # the managed close skips it

    def test_refusals(self, comm: MPI.Intracomm) -> None:
        with pytest.raises(cgc.RegistrationError, match="at least one"):
            cmpi.manage(Owner(), comm=comm)
        with pytest.raises(cgc.RegistrationError, match="MPI.Win and MPI.File"):
            cmpi.manage(Owner(), comm, comm=comm)  # type: ignore[arg-type]
        with pytest.raises(cgc.RegistrationError, match="null"):
            cmpi.manage(Owner(), MPI.File(), comm=comm)
        fh = open_file(comm, os.path.join(shared_dir(comm), "refused.bin"))
        try:
            for bad in (None, MPI.COMM_NULL):
                with pytest.raises(cgc.RegistrationError, match="intracommunicator the File"):
                    cmpi.manage(Owner(), fh, comm=bad)  # type: ignore[arg-type]
        finally:
            fh.Close()
        assert cgc.manager(comm).next_key == 0

    def test_communicators_come_from_the_core(self) -> None:
        assert cmpi.dup is cgc.dup and cmpi.split is cgc.split


class TestFilesSelf(FileTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi(min_size=2)
class TestFilesWorld(FileTests):
    COMM = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_windows_in_cycles_freed_once_in_one_order(comm: MPI.Intracomm) -> None:
    windows_or_skip(comm)
    rank = comm.Get_rank()
    rng = random.Random(rank)
    old = gc.get_threshold()
    gc.set_threshold(40 + 250 * rank, 2 + rank, 4)  # per-rank automatic-GC timing
    wins: list[MPI.Win] = []
    order: list[int] = []
    n = 120
    try:
        for step in range(n):
            owner = Owner()
            owner.win = MPI.Win.Create(None, 1, MPI.INFO_NULL, comm)
            owner.me = owner
            wins.append(owner.win)
            cmpi.manage(owner, owner.win, comm=comm, name=f"win{step}")
            del owner
            [{} for _ in range(rng.randrange(0, 300))]  # per-rank allocation noise
            if step % 10 == 9:
                stats = cgc.collect(comm, generation=None)  # agree only
                order.append(stats.destroyed)
        stats = cgc.collect(comm)
    finally:
        gc.set_threshold(*old)
    assert stats.pending == 0
    assert all(w == MPI.WIN_NULL for w in wins)  # every window freed (a second free would fail)
    assert cgc.manager(comm).destroyed == n
    assert same_on_all(comm, order)  # the same destroys at the same sync points


@pytest.mark.mpi(min_size=2)
def test_window_free_is_null_first_and_idempotent(comm: MPI.Intracomm) -> None:
    windows_or_skip(comm)
    win = MPI.Win.Create(None, 1, MPI.INFO_NULL, comm)
    alias = MPI.Win(win)  # a second Python object for the same handle
    cmpi.free_win(win)
    assert win == MPI.WIN_NULL
    cmpi.free_win(win)  # nothing happens
    # The explicit Free by the user before the managed one: skipped.
    owner = Owner()
    owner.win = MPI.Win.Create(None, 1, MPI.INFO_NULL, comm)
    w = owner.win
    cmpi.manage(owner, owner.win, comm=comm)
    w.Free()
    del owner
    assert cgc.collect(comm).destroyed == 1
    del alias  # mpi4py never frees on dealloc, so the stale alias is harmless


@pytest.mark.mpi(min_size=2)
def test_several_handles_released_last_first(comm: MPI.Intracomm) -> None:
    path = os.path.join(shared_dir(comm), "multi.bin")
    owner = Owner()
    owner.fh = open_file(comm, path)
    owner.win = MPI.Win.Allocate(8, 8, MPI.INFO_NULL, comm)
    handles = (owner.fh, owner.win)
    cmpi.manage(owner, owner.fh, owner.win, comm=comm, name="pair")
    del owner
    assert cgc.collect(comm).destroyed == 1
    assert handles[0] == MPI.FILE_NULL and handles[1] == MPI.WIN_NULL


# Windows go on one sub-communicator only: Open MPI 4.1's osc/rdma here fails
# now and then to create windows at the same time on the disjoint
# sub-communicators of one Split (see docs/petsc.md).


@pytest.mark.mpi(min_size=2)
def test_window_of_another_group_refused(comm: MPI.Intracomm) -> None:
    windows_or_skip(comm)
    inside = comm.Get_rank() < 2
    sub = comm.Split(0 if inside else MPI.UNDEFINED)
    if inside:
        win = MPI.Win.Create(None, 1, MPI.INFO_NULL, sub)
        with pytest.raises(cgc.RegistrationError, match="not the group"):
            cmpi.manage(Owner(), win, comm=comm)  # local check: no agreement needed
        win.Free()
        sub.Free()
    assert cgc.manager(comm).next_key == 0


@pytest.mark.mpi(min_size=2)
def test_windows_on_a_managed_split(comm: MPI.Intracomm) -> None:
    windows_or_skip(comm)
    # Ranks 0 and 1 form the sub-communicator; the others get COMM_NULL and
    # skip it at the parent's sync points.
    sub = cmpi.split(comm, 0 if comm.Get_rank() < 2 else MPI.UNDEFINED)
    wins = []
    if sub != MPI.COMM_NULL:
        for i in range(5):
            owner = Owner()
            owner.win = MPI.Win.Create(None, 1, MPI.INFO_NULL, sub)
            owner.me = owner
            wins.append(owner.win)
            cmpi.manage(owner, owner.win, comm=sub, name=f"subwin{i}")
        del owner
    cgc.collect(comm)  # the parent's sync point visits the sub-communicator
    assert all(w == MPI.WIN_NULL for w in wins)
    del sub
    cgc.collect(comm)
