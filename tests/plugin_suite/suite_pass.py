"""Tests that pass with the leak check and strict mode on, serially and on 4 ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _resources import Resource
from mpi4py import MPI

import collective_gc as cgc
from collective_gc.pytest_plugin import parallel_assert

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def shared() -> Iterator[Resource]:
    # Alive across tests: a wider fixture's objects are not a test's leak.
    res = Resource(WORLD, "module-resource")
    yield res


@pytest.fixture
def per_test() -> Iterator[Resource]:
    # Dropped in its own teardown, before the leak check runs.
    res = Resource(WORLD, "function-resource")
    yield res
    del res


def test_dropped_objects_and_cycles(shared: Resource, per_test: Resource) -> None:
    for i in range(5):
        Resource(WORLD, f"plain-{i}")  # dies at once, by refcount
    a, b = Resource(WORLD, "cycle-a"), Resource(WORLD, "cycle-b")
    a.peer, b.peer = b, a  # left to the final sync's collection (no strict mode)


def test_module_fixture_again(shared: Resource) -> None:
    assert shared.reg.alive


def test_split_communicators() -> None:
    # 4 ranks split 2+2: each half registers on its own sub-communicator, so
    # the ranks hold managers of different communicators at the check.
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    sub = cgc.split(WORLD, rank % 2 if size > 1 else 0)
    for i in range(3):
        Resource(sub, f"half-{rank % 2}-{i}")
    kept = Resource(sub, "kept-until-the-end")
    del kept, sub


def test_self_and_rank_local() -> None:
    Resource(MPI.COMM_SELF, "self-resource")
    done: list[int] = []

    class Segment:
        pass

    seg = Segment()
    cgc.register(seg, done.append, 1, comm=None, name="segment")
    del seg


def test_explicit_destroy() -> None:
    res = Resource(WORLD, "explicit")
    res.reg.destroy()
    keep_alive_in_test = res  # alive, but its destroy already ran
    assert not keep_alive_in_test.reg.alive


@pytest.mark.cgc_strict
def test_strict_without_cycles() -> None:
    for i in range(3):
        Resource(WORLD, f"strict-plain-{i}")
    cgc.collect(WORLD)


@pytest.mark.mpi(min_size=2)
def test_parallel_assert_beside_pytest_mpi() -> None:
    rank = WORLD.Get_rank()
    parallel_assert(rank < WORLD.Get_size(), "rank out of range")
    parallel_assert(lambda: rank >= 0, lambda: f"negative rank {rank}")


_COMMS: list[MPI.Intracomm] = []


@pytest.mark.mpi(min_size=2)
def test_lookups_in_different_orders() -> None:
    # Lookups are local: rank 0 meets b's manager first. The final syncs must
    # still visit a and b in the same order on every rank.
    a, b = WORLD.Dup(), WORLD.Dup()
    _COMMS.extend((a, b))
    if WORLD.Get_rank() == 0:
        cgc.manager(b)
    Resource(a, "on-a")
    Resource(b, "on-b")
