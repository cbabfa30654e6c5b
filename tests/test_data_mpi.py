"""Every rank feeds itself with its own loader: 4 ranks x 2 workers under mpiexec.

Run with ``mpiexec -n 4 python -m mpi4py -m pytest --with-mpi``; skipped
serially. Each rank's workers must leave the job alone (never initialize MPI)
while the ranks run a collective per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from data_scripts.fns import batch
from mpi4py import MPI

from collective_gc.data import ProcessPrefetch, shard_indices


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_each_rank_loads_its_shard_with_an_allreduce_per_element(
    comm: MPI.Intracomm, mode: Any
) -> None:
    n = 16 * comm.Get_size()
    mine = shard_indices(n, comm, mode=mode)
    assert len(mine) == 16
    total = np.zeros(1)
    with ProcessPrefetch(batch, mine, num_workers=2, buffer_size=4) as loader:
        for i, element in zip(mine, loader):
            assert element["i"] == i and (element["x"] == i).all()
            part = np.array([element["x"][0, 0]], dtype=np.float64)
            summed = np.empty(1)
            comm.Allreduce(part, summed)
            total += summed
    assert total[0] == sum(range(n))
    assert loader.closed


@pytest.mark.mpi(min_size=4)
def test_workers_of_every_rank_stay_out_of_the_job(comm: MPI.Intracomm) -> None:
    from data_scripts.probe import report

    with ProcessPrefetch(report, range(4), num_workers=2) as loader:
        reports = list(loader)
    ok = all(not r["mpi_initialized"] and not r["env"] for r in reports)
    assert all(comm.allgather(ok))
    assert comm.Get_size() == MPI.COMM_WORLD.Get_size()  # nobody joined the job
