"""A rank that reaches the checks after the others gave up on it (run alone
by tests/test_plugin.py, with a short ``--cgc-timeout``)."""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

import collective_gc as cgc


class Obj:
    pass


def noop() -> None:
    pass


def test_before_it() -> None:
    pass  # its checks make their own communicator, and its watch


@pytest.mark.mpi(min_size=2)
def test_last_rank_is_late() -> None:
    comm = MPI.COMM_WORLD
    o = Obj()
    cgc.register(o, noop, comm=comm)  # something for the leak check to sync
    del o
    if comm.Get_rank() == comm.Get_size() - 1:
        time.sleep(4.0)  # past the others' deadline


def test_after_it() -> None:
    # The test's own collective, on COMM_WORLD (not the checks' duplicate): the
    # others wait here for the late rank, so that none of them exits (with a
    # failure, which under `python -m mpi4py` aborts the job) before it reported.
    MPI.COMM_WORLD.Barrier()
