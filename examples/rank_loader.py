"""Every rank feeds itself from its own shard, through worker processes.

    mpiexec -n 4 python -m mpi4py examples/rank_loader.py [--batches 512] [--workers 2]

Each rank takes its share of the batch indices (``shard_indices``), loads them
with a ``ProcessPrefetch`` (workers that never touch MPI and die with the
rank), and runs one allreduce per batch, the shape of a data-parallel training
step, inside a ``collective_scope``. Rank 0 prints each rank's throughput.

``mpi4py`` is imported at the top, as in any MPI script: the workers re-import
this file to find ``load_batch`` and still never initialize MPI. What only the
ranks should run stays under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import collective_gc as cgc
from collective_gc.data import ProcessPrefetch, shard_indices


def load_batch(index: int) -> dict[str, Any]:
    """Stands in for reading and decoding batch ``index`` (64 samples of 1024 features)."""
    rng = np.random.default_rng(index)
    return {
        "x": rng.standard_normal((64, 1024), dtype=np.float32),
        "y": rng.integers(0, 10, size=64),
        "index": index,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    shard = shard_indices(args.batches, comm)
    # One collective per batch: every rank must run the same number of steps.
    steps = comm.allreduce(len(shard), op=MPI.MIN)
    weights = np.zeros(1024, dtype=np.float32)

    with cgc.collective_scope(comm):
        with ProcessPrefetch(load_batch, shard[:steps], num_workers=args.workers) as loader:
            t0 = 0.0
            for step, batch in enumerate(loader):
                if step == 1:  # time from the second batch on: worker start-up excluded
                    t0 = time.perf_counter()
                grad = batch["x"].mean(axis=0)  # the "model"
                comm.Allreduce(MPI.IN_PLACE, grad)
                weights -= 0.01 * grad / comm.Get_size()
        elapsed = time.perf_counter() - t0
        steps -= 1

    rates = comm.gather((comm.Get_rank(), steps, elapsed))
    if comm.Get_rank() == 0:
        assert rates is not None
        for rank, n, seconds in rates:
            print(
                f"rank {rank}: {n} batches in {seconds:.2f} s, "
                f"{n / seconds:,.0f} batches/s ({n * 64 * 1024 * 4 / seconds / 1e6:,.0f} MB/s)"
            )
        print(f"final |w| = {float(np.linalg.norm(weights)):.4f}")


if __name__ == "__main__":
    main()
