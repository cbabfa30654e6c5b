"""A sync point on every Krylov iteration: what the scope's back-off saves.

The loop body is what one iteration of a Krylov solve costs a Python
program: a little numpy work (a dot product and an axpy over 2,000 doubles)
and one allreduce of the dot product (an inner product's collective). Inside
``collective_scope(comm)``, interleaved blocks of ITERS iterations:

(a) the body undecorated: the floor;
(b) the body as a ``@cgc.sync_point``: an agreement at every iteration;
(c) the same with the back-off on, ``collective_scope(comm, seconds=0.01)``
    (the ranks agree about every 10 ms at most);
(d) and with ``collective_scope(comm, every=100)``.

Every variant also registers and drops one object every 10 iterations (in
the floor they wait for the scope's exit), so the back-off has work to
defer; the rows after the ratios say how many iterations after its death
each was destroyed (the latest, rank 0). Medians of
REPEATS blocks and of the per-block ratios, slowest rank.

Run: mpiexec -n 4 python -m mpi4py bench/bench_backoff.py  (make bench runs it
at 4 ranks and at 2; ``--no-save`` prints without writing bench/results)
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import save, say, timed  # noqa: E402

world = MPI.COMM_WORLD
REPEATS = 9
ITERS = 2000
N = 2000
EVERY = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--every=")), "100"))


class Owner:
    pass


def body(comm: MPI.Comm, x: np.ndarray, y: np.ndarray, buf: np.ndarray) -> None:
    buf[0] = x @ y
    comm.Allreduce(MPI.IN_PLACE, buf)
    y += 1e-9 * buf[0] * x


def run(comm: MPI.Comm, mode: str, log: list[tuple[int, int]] | None = None) -> None:
    x, y, buf = np.ones(N), np.ones(N), np.zeros(1)
    kwargs: dict[str, Any] = {}
    if mode == "seconds":
        kwargs["seconds"] = 0.01
    elif mode == "every":
        kwargs["every"] = EVERY

    @cgc.sync_point(comm=comm)
    def step() -> None:
        body(comm, x, y, buf)

    with cgc.collective_scope(comm, gc="off", exit_collect=None, **kwargs):
        done: list[int] = []
        for i in range(ITERS):
            if i % 10 == 0:  # in the floor too: the program's own work
                o = Owner()
                cgc.register(o, done.append, i, comm=comm)
                del o
            if mode == "floor":
                body(comm, x, y, buf)
                continue
            step()
            if log is not None and done:
                log.extend((born, i) for born in done)
                done.clear()


def main() -> None:
    args = sys.argv[1:]
    size = world.Get_size()
    comm = world.Dup()
    modes = ("floor", "every_call", "seconds", "every")
    for mode in modes:  # warm
        run(comm, mode)
    say(
        world,
        f"bench_backoff: {size} ranks, {ITERS} iterations a block (dot + axpy over {N} "
        f"doubles + one Allreduce), median of {REPEATS} blocks, slowest rank",
    )
    times: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(REPEATS):
        block = {m: timed(comm, lambda m=m: run(comm, m), 1) for m in modes}
        for m in modes:
            times[m].append(block[m])
            ratios[m].append(block[m] / block["floor"])
    rows = []
    for m in modes:
        us = statistics.median(times[m]) / ITERS * 1e6
        ratio = statistics.median(ratios[m])
        rows.append({"mode": m, "us_per_iter": us, "ratio": ratio})
    say(world, "  " + ", ".join(f"{r['mode']} {r['us_per_iter']:.1f} us" for r in rows))
    say(
        world,
        "  against the undecorated loop: "
        + ", ".join(f"{r['mode']} {r['ratio']:.2f}" for r in rows[1:]),
    )
    for m in ("seconds", "every"):
        log: list[tuple[int, int]] = []
        run(comm, m, log)
        late = max((i - born for born, i in log), default=-1)
        say(
            world,
            f"  {m}: {len(log)} of {ITERS // 10} objects destroyed in the loop, "
            f"the latest {late} iterations after its death",
        )
    if "--no-save" not in args:
        save("backoff" if size != 2 else "backoff_2ranks", rows, world)
    comm.Free()


if __name__ == "__main__":
    main()
