"""shard_indices: every index on exactly one rank, balanced; serially and under mpiexec."""

from __future__ import annotations

from typing import Any

import pytest

from collective_gc.data import shard_indices


class FakeComm:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


@pytest.mark.parametrize("n", [0, 1, 7, 8, 100, 101])
@pytest.mark.parametrize("size", [1, 3, 4])
@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_shards_partition_the_range(n: int, size: int, mode: Any) -> None:
    shards = [shard_indices(n, FakeComm(r, size), mode=mode) for r in range(size)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    if mode == "contiguous":
        assert all(s.step == 1 for s in shards)
        assert [s.start for s in shards] == sorted(s.start for s in shards)
    else:
        assert all(s.step == size for s in shards)


def test_shard_errors_and_world() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = shard_indices(10, comm)
    everyone = comm.allgather(list(mine))
    assert sorted(i for s in everyone for i in s) == list(range(10))
    with pytest.raises(ValueError, match="mode"):
        shard_indices(10, comm, mode="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        shard_indices(-1, comm)
