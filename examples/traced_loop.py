"""Where does the time in sync points go? A time-stepping loop with one overloaded rank.

Each step makes, in reference cycles as a library's caches do, an MPI window
for a one-sided sum (freeing it synchronizes every rank) and a managed
duplicate of the communicator, sums the step before's result over the ranks,
computes on this rank's part of the data, and ends at a sync point
(``scope.sync()``) that frees the step's objects once every rank has dropped
them. The partition is uneven, as a mesh partitioner may leave it: the last
rank owns ``--imbalance`` (default 40%) more data than the others, so it
reaches the sync point after the computation last, and the others wait for
it there.

Nothing in the program asks for the trace: the environment does.

Run:
    COLLECTIVE_GC_TRACE=trace/ mpiexec -n 4 python examples/traced_loop.py
    python -m collective_gc.trace trace/ --plot trace.png

The summary shows the last rank last at nearly every sync point and the
others spending most of their sync time waiting for it: that time is the
imbalance's, not collective_gc's (docs/guides/tracing.rst).
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import mpi as cmpi

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


class Halo:
    """A window for a one-sided sum at rank 0 and a communicator of its own;
    refers back to its step (a cycle)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.comm = cgc.dup(comm)
        self.buf = np.zeros(1)
        self.win = MPI.Win.Create(self.buf, self.buf.itemsize, MPI.INFO_NULL, comm)
        cmpi.manage(self, self.win, comm=comm, name="Halo")

    def total(self, value: float) -> float:
        """Collective: a one-sided sum at rank 0, then broadcast."""
        self.win.Fence()
        self.win.Accumulate(np.array([value]), 0, op=MPI.SUM)
        self.win.Fence()
        return float(self.comm.bcast(self.buf[0], root=0))


class Step:
    """One step's state: this rank's part of the field, and its halo."""

    def __init__(self, n: int, t: int) -> None:
        self.x = np.linspace(0.0, 1.0, n) + t
        self.halo = Halo(self)

    def advance(self) -> float:
        """This rank's work: a few sweeps over its part (the uneven part)."""
        for _ in range(4):
            self.x = np.sin(self.x) + 0.5 * np.cos(self.x)
        return float(self.x.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cells", type=int, default=40_000, help="cells a rank owns")
    parser.add_argument("--imbalance", type=float, default=0.4, help="the last rank's extra")
    args = parser.parse_args()
    n = int(args.cells * (1 + args.imbalance)) if rank == size - 1 else args.cells
    total = value = 0.0
    with cgc.collective_scope(comm) as scope:
        for t in range(args.steps):
            step = Step(n, t)
            total += step.halo.total(value)  # last step's value, summed over the ranks
            value = step.advance()  # the uneven work, between two collectives
            del step  # a cycle: it dies at the next collection, at the sync point
            scope.sync()
    left = comm.allreduce(len(cgc.pending(comm)))
    if rank == 0:
        print(f"{args.steps} steps on {size} ranks, sum {total:.6g}, {left} destroys pending")
        if left:
            raise SystemExit("NOT CLEAN: destroys left pending")


if __name__ == "__main__":
    main()
