"""Thousands of collective resources in reference cycles, freed without deadlock.

Each step makes an MPI window and a duplicated communicator inside objects
that sit in reference cycles (as a library's caches do), with a different
automatic-GC threshold and different allocation noise on each rank. Freeing a
window or a communicator is collective: done from ``__del__`` this hangs at
once (see examples/naive_deadlock.py). Registered with collective_gc, the
cyclic collector only queues them, and the sync points free them on every
rank in one agreed order.

Run: mpiexec -n 4 python examples/demo.py [steps]      (make demo)
"""

from __future__ import annotations

import gc
import random
import sys
import time

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
sync_every = 20


def free_comm(c: MPI.Comm) -> None:
    c.Free()


def free_win(w: MPI.Win) -> None:
    w.Free()


class Workspace:
    """Owns a duplicated communicator; referenced back by its window holder."""

    def __init__(self, parent: MPI.Intracomm) -> None:
        self.comm = parent.Dup()
        cgc.register(self, free_comm, self.comm, comm=parent, name="workspace-comm")


class WindowCache:
    """Owns an MPI window on the workspace's communicator, in a cycle with it."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        ws.cache = self  # the cycle: only the cyclic collector frees these two
        self.win = MPI.Win.Create(None, 1, MPI.INFO_NULL, ws.comm)
        # Managed on the parent communicator (same group): it is newer than the
        # workspace, so it is freed first, before its communicator.
        cgc.register(self, free_win, self.win, comm=comm, name="window")


def main() -> None:
    rng = random.Random(rank)
    gc.set_threshold(100 + 400 * rank, 5 + 3 * rank, 10)  # different GC timing per rank
    noise: list[object] = []
    t0 = time.perf_counter()
    sync_time = 0.0
    cyclic = 0
    for step in range(1, steps + 1):
        WindowCache(Workspace(comm))
        noise.extend({} for _ in range(rng.randrange(200)))
        if len(noise) > 5000:
            noise.clear()
        if step % sync_every == 0:
            stats = cgc.collect(comm, generation=None)  # agree and free; no forced collection
            sync_time += stats.seconds
            cyclic += stats.cyclic
        if step % (steps // 10 or 1) == 0 and rank == 0:
            mgr = cgc.manager(comm)
            print(
                f"step {step:5d}/{steps}: created {mgr.next_key}, destroyed {mgr.destroyed}, "
                f"pending {len(cgc.pending(comm))}",
                flush=True,
            )
    stats = cgc.collect(comm)  # the last sync collects on every rank
    sync_time += stats.seconds
    cyclic += stats.cyclic
    mgr = cgc.manager(comm)
    totals = comm.gather((mgr.next_key, mgr.destroyed, len(cgc.pending(comm)), sync_time, cyclic))
    if rank == 0:
        assert totals is not None
        print(f"\n{comm.Get_size()} ranks, {steps} steps, {time.perf_counter() - t0:.2f} s")
        print("rank  created  destroyed  pending  sync time (s)  cyclic finalizations")
        for r, (c, d, p, s, y) in enumerate(totals):
            print(f"{r:4d}  {c:7d}  {d:9d}  {p:7d}  {s:13.3f}  {y:20d}")


if __name__ == "__main__":
    main()
