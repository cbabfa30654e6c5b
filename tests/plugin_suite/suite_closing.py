"""The testing guide's fixture (docs/guides/testing.rst, "Families and test
isolation"): a duplicate per test, closed and freed at teardown. The checks
run after it, so they must still see what its ``close()`` let go of: each
test but the last must fail under them, as with a plain COMM_WORLD.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from _resources import Resource
from mpi4py import MPI

import collective_gc as cgc

_KEEP: list[object] = []


@pytest.fixture
def comm() -> Iterator[MPI.Intracomm]:
    c = MPI.COMM_WORLD.Dup()
    yield c
    cgc.manager(c).close()  # collective, on every rank: the test's last sync points
    c.Free()


def test_closing_leak(comm: MPI.Intracomm) -> None:
    _KEEP.append(Resource(comm, "closed-leak"))  # a reference kept in a global


@pytest.mark.cgc_leak_check
def test_closing_marked_leak(comm: MPI.Intracomm) -> None:
    _KEEP.append(Resource(comm, "closed-marked-leak"))


@pytest.mark.cgc_strict
def test_closing_strict_cycle(comm: MPI.Intracomm) -> None:
    a = Resource(comm, "closed-cycle")
    a.peer = a  # dies in the cyclic collector
    del a
    gc.collect()


@pytest.mark.cgc_strict
def test_closing_strict_cycle_left_to_the_end(comm: MPI.Intracomm) -> None:
    a = Resource(comm, "closed-cycle-at-the-end")
    a.peer = a  # left for a collection after the test
    del a


def test_closing_clean(comm: MPI.Intracomm) -> None:
    Resource(comm, "dropped")  # dies at once; the fixture's close destroys it
    cgc.collect(comm)
