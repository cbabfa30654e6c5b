"""Tests that must fail, each for one reason, and passing tests between them.

The collective_gc checks are what make test_leaks, test_marked_leak and
test_strict_cycle fail; parallel_assert makes test_assert_on_last_rank fail on
every rank although its condition is false on the last rank only.
"""

from __future__ import annotations

import gc

import pytest
from _resources import Resource
from mpi4py import MPI

import collective_gc as cgc
from collective_gc.pytest_plugin import parallel_assert

WORLD = MPI.COMM_WORLD
_KEEP: list[object] = []


@pytest.mark.mpi(min_size=2)
def test_registered_on_one_rank_only() -> None:
    # Not a duplicate of WORLD: a communicator congruent with WORLD would
    # share WORLD's agreement (collective_gc's families), and one rank's stray
    # registration would make WORLD unusable for every later test too. The
    # same processes in another order are a communicator of its own.
    comm = WORLD.Split(0, WORLD.Get_size() - WORLD.Get_rank())
    _KEEP.append(comm)  # never freed: its manager's keys now differ between ranks
    _KEEP.append(Resource(comm, "everywhere"))
    if comm.Get_rank() == 0:
        _KEEP.append(Resource(comm, "rank-0-only"))  # a registration on one rank only


def test_leaks() -> None:
    _KEEP.append(Resource(WORLD, "leaky-solver"))  # a reference kept in a global


@pytest.mark.cgc_leak_check
def test_marked_leak() -> None:
    _KEEP.append(Resource(WORLD, "marked-leak"))


@pytest.mark.cgc_leak_check(False)
def test_opted_out() -> None:
    _KEEP.append(Resource(WORLD, "allowed-leak"))


@pytest.mark.cgc_strict
def test_strict_cycle() -> None:
    a = Resource(WORLD, "cyclic-solver")
    a.peer = a  # dies in the cyclic collector
    del a
    gc.collect()


def test_assert_on_last_rank() -> None:
    rank = WORLD.Get_rank()
    parallel_assert(rank != WORLD.Get_size() - 1, f"bad value {rank * 10} on rank {rank}")


def test_still_in_step_after_failures() -> None:
    # Every rank reaches this collective: no failure above left one behind.
    assert WORLD.allreduce(1) == WORLD.Get_size()
    assert cgc.collect(WORLD).pending == 0
