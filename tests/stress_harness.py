"""Randomized collective-GC stress: many seeds, 4 ranks, real collective resources.

Per seed, on a fresh duplicate of COMM_WORLD:

- every rank builds the same managed objects in the same order (a shared RNG):
  checking resources (their destroy verifies, with a collective, that every
  rank destroys the same key at the same position), MPI windows, duplicated
  communicators, PETSc Vecs, and resources made from another one (a window on
  a managed communicator, which holds its source alive);
- random reference graphs between them: cycles of random sizes and
  cross-references;
- per rank: its own gc thresholds, allocation noise, drop order, drops from
  worker threads; shared: when sync points happen and which objects are
  destroyed explicitly;
- at the end: every object destroyed exactly once, the same keys in the same
  order on every rank, nothing pending, no hang (a watchdog ends the job if a
  seed overruns its deadline).

``--naive`` runs the same graphs with the destroys called from ``__del__``:
that is the deadlock the library exists to remove, and the watchdog (or
mpiexec's --timeout) catches it.

Run: mpiexec -n 4 python -m mpi4py tests/stress_harness.py --seeds 200   (make stress)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc

import collective_gc as cgc


@dataclass
class Outcome:
    seed: int
    objects: int = 0
    destroys: int = 0
    double: int = 0
    leaks: int = 0
    hangs: int = 0
    order_ok: bool = True
    errors: list[str] = field(default_factory=list)


class Holder:
    """A user object owning one collective resource, with arbitrary references."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.refs: list[Any] = []
        self.res: Any = None
        self.source: Holder | None = None  # the resource this one was made from


class NaiveHolder(Holder):
    """The naive pattern: the collective destroy runs in ``__del__``."""

    destroy: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self.destroy is not None:
            self.destroy()


class Watchdog:
    """Ends this rank (and so the job) if a seed overruns its deadline."""

    def __init__(self, seconds: float, rank: int) -> None:
        self.seconds = seconds
        self.rank = rank
        self.deadline = float("inf")
        self.seed = -1
        t = threading.Thread(target=self._run, daemon=True, name="stress-watchdog")
        t.start()

    def arm(self, seed: int) -> None:
        self.seed = seed
        self.deadline = time.monotonic() + self.seconds

    def disarm(self) -> None:
        self.deadline = float("inf")

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            if time.monotonic() > self.deadline:
                sys.stderr.write(
                    f"HANG: rank {self.rank} seed {self.seed} overran {self.seconds} s\n"
                )
                sys.stderr.flush()
                os._exit(3)


ALL_KINDS = ("check", "check", "win", "comm", "vec", "derived")


def run_seed(
    world: MPI.Intracomm,
    seed: int,
    n: int = 80,
    naive: bool = False,
    kinds: tuple[str, ...] = ALL_KINDS,
) -> Outcome:
    """Collective over ``world``: one randomized round; see the module docstring.

    ``kinds`` picks the resources (windows need mpiexec: a singleton Open MPI
    process here cannot create one).
    """
    comm = world.Dup()
    rank = comm.Get_rank()
    shared = random.Random(seed)
    mine = random.Random(seed * 7919 + rank)
    out = Outcome(seed)
    counts: dict[int, int] = {}
    order: list[int] = []

    def note(i: int) -> None:
        counts[i] = counts.get(i, 0) + 1
        order.append(i)

    def check_destroy(i: int) -> None:
        note(i)
        if not naive:  # in naive mode this collective is exactly what deadlocks
            got = comm.allgather((len(order), i))
            if any(g != got[0] for g in got):
                out.order_ok = False
                out.errors.append(f"rank {rank}: destroy order differs at {got}")

    def free_win(i: int, win: MPI.Win) -> None:
        note(i)
        win.Free()

    def free_comm(i: int, c: MPI.Comm) -> None:
        note(i)
        c.Free()

    def destroy_vec(i: int, v: PETSc.Vec) -> None:
        note(i)
        v.destroy()

    old_threshold = gc.get_threshold()
    gc.set_threshold(mine.randrange(20, 2000), mine.randrange(2, 20), mine.randrange(2, 20))
    holders: list[Holder | None] = []
    regs: list[cgc.Registration | None] = []
    cls = NaiveHolder if naive else Holder
    try:
        for i in range(n):
            h = cls(i)
            kind = shared.choice(kinds)
            src = None
            if kind == "derived":
                sources = [s for s in holders if s is not None and isinstance(s.res, MPI.Intracomm)]
                if not sources:
                    kind = "check"
            if kind == "check":
                fn, args = check_destroy, (i,)
            elif kind == "win":
                h.res = MPI.Win.Create(None, 1, MPI.INFO_NULL, comm)
                fn, args = free_win, (i, h.res)
            elif kind == "comm":
                h.res = comm.Dup()
                fn, args = free_comm, (i, h.res)
            elif kind == "vec":
                h.res = PETSc.Vec().createMPI(4, comm=comm)
                fn, args = destroy_vec, (i, h.res)
            else:
                src = sources[shared.randrange(len(sources))]
                h.source = src  # holds its source alive, as a KSP holds its Mat
                h.res = MPI.Win.Create(None, 1, MPI.INFO_NULL, src.res)
                fn, args = free_win, (i, h.res)
            if naive:
                h.destroy = lambda fn=fn, args=args: fn(*args)  # type: ignore[attr-defined]
                regs.append(None)
            else:
                regs.append(cgc.register(h, fn, *args, comm=comm, name=f"{kind}{i}"))
            holders.append(h)
        out.objects = n
        # Locals must not keep holders alive: only the list and the graph do.
        h = src = None  # type: ignore[assignment]
        sources = []
        # Random graphs: cycles of random sizes, and cross-references.
        for _ in range(n // 3):
            size = shared.randrange(1, 6)
            members = [holders[shared.randrange(n)] for _ in range(size)]
            for a, b in zip(members, members[1:] + members[:1]):
                a.refs.append(b)  # type: ignore[union-attr]
        for _ in range(n // 4):
            a, b = holders[shared.randrange(n)], holders[shared.randrange(n)]
            a.refs.append(b)  # type: ignore[union-attr]
        members = []
        a = b = None
        # Drop everything over a number of steps.
        drop_order = list(range(n))
        mine.shuffle(drop_order)
        noise: list[object] = []
        steps = 12
        per_step = -(-n // steps)
        for step in range(steps):
            batch = drop_order[step * per_step : (step + 1) * per_step]
            if mine.random() < 0.3:
                # Drop this batch from a worker thread.
                def drop(idx: list[int] = batch) -> None:
                    for j in idx:
                        holders[j] = None

                t = threading.Thread(target=drop)
                t.start()
                t.join()
            else:
                for j in batch:
                    holders[j] = None
            noise.extend({} for _ in range(mine.randrange(0, 400)))
            if len(noise) > 3000:
                noise.clear()
            # Explicit destroys, decided by the shared RNG: every rank, same object.
            if not naive and shared.random() < 0.3:
                j = shared.randrange(n)
                reg = regs[j]
                if reg is not None:
                    reg.destroy()
            if not naive and shared.random() < 0.6:
                cgc.collect(comm, generation=None, timeout=20)
        del noise
        if naive:
            gc.collect()
        else:
            cgc.collect(comm, timeout=20)
            cgc.collect(comm, timeout=20)  # objects freed by the first one's destroys
    except cgc.CollectiveTimeoutError as exc:
        out.hangs += 1
        out.errors.append(str(exc))
    finally:
        gc.set_threshold(*old_threshold)
    out.destroys = sum(counts.values())
    out.double = sum(1 for c in counts.values() if c > 1)
    out.leaks = n - len(counts)
    if not naive:
        pending = cgc.pending(comm)
        out.leaks += len(pending)
        logs = comm.allgather(order)
        if any(log != logs[0] for log in logs):
            out.order_ok = False
            out.errors.append(f"rank {rank}: destroy logs differ between ranks")
        if out.hangs == 0:
            comm.Free()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--objects", type=int, default=80)
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds per seed")
    parser.add_argument("--naive", action="store_true", help="destroy from __del__ (deadlocks)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    dog = Watchdog(args.deadline, rank)
    totals = Outcome(-1)
    t0 = time.perf_counter()
    bad = 0
    for seed in range(args.first, args.first + args.seeds):
        dog.arm(seed)
        res = run_seed(world, seed, args.objects, args.naive)
        dog.disarm()
        totals.objects += res.objects
        totals.destroys += res.destroys
        totals.double += res.double
        totals.leaks += res.leaks
        totals.hangs += res.hangs
        flags = world.allreduce(
            int(bool(res.errors or res.double or res.leaks or res.hangs)), op=MPI.SUM
        )
        if flags:
            bad += 1
            for e in res.errors:
                print(f"seed {seed}: {e}", file=sys.stderr, flush=True)
        if rank == 0 and (seed + 1 - args.first) % 20 == 0:
            print(
                f"  {seed + 1 - args.first}/{args.seeds} seeds, {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
    sums = world.allreduce(
        (totals.objects, totals.destroys, totals.double, totals.leaks, totals.hangs),
        op=_tuple_sum(),
    )
    if rank == 0:
        print(
            f"stress{' (naive)' if args.naive else ''}: {world.Get_size()} ranks, "
            f"seeds {args.seeds}, "
            f"objects {sums[0] // world.Get_size()} per rank, destroys {sums[1]} (all ranks), "
            f"hangs {sums[4]}, double destroys {sums[2]}, leaks {sums[3]}, bad seeds {bad}, "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return 1 if bad else 0


def _tuple_sum() -> MPI.Op:
    return MPI.Op.Create(lambda a, b, dt: tuple(x + y for x, y in zip(a, b)), commute=True)


if __name__ == "__main__":
    sys.exit(main())
