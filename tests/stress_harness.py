"""Randomized collective-GC stress: many seeds, 4 ranks, real collective resources.

Per seed, on a fresh duplicate of COMM_WORLD:

- every rank builds the same managed objects in the same order (a shared RNG):
  checking resources (their destroy verifies, with a collective, that every
  rank destroys the same key at the same position), MPI windows, duplicated
  communicators, PETSc Vecs (when petsc4py is installed: it is optional here),
  and resources made from another one (a window on
  a managed communicator, which holds its source alive);
- random reference graphs between them: cycles of random sizes and
  cross-references;
- per rank: its own gc thresholds, allocation noise, drop order, drops from
  worker threads; shared: when sync points happen and which objects are
  destroyed explicitly;
- at the end: every object destroyed exactly once, the same keys in the same
  order on every rank, nothing pending, no hang (a watchdog ends the job if a
  seed overruns its deadline).

Then the fault episodes the seed draws from :mod:`stress.episodes` (issue 11):
registrations and drops from several threads on COMM_SELF and rank-local
(diagnostics among them, on some seeds with the PETSc adapter's hooks installed),
KeyboardInterrupt and SystemExit raised inside destroys on one rank, destroys
that detach, register, drop and call diagnostics, late ranks against
deadlines, communicators freed with destroys pending, diagnostics before a
strict scope's sync point, and (expected to be refused) two threads
registering at once on a communicator of size > 1, and (issue 25) a SIGALRM
handler raising KeyboardInterrupt, SystemExit or RuntimeError every 50-400 us
during loops of sync points, on one rank or on COMM_SELF, and (issue 25,
defect 4) many registrations of which a few live long, their keys spread
far wider than the agreement's window, each rank dropping at its own times.
Per seed it reports hangs,
double destroys, destroys of live objects, lost destroys and ranks that
disagree on how a sync point ended (plus duplicate keys and errors a correct
library would not raise); see :mod:`stress.ledger`. ``--only EPISODE,...``
runs chosen episodes on every seed, ``--report FILE`` writes a JSON line per
seed.

``--naive`` runs the same graphs with the destroys called from ``__del__``:
that is the deadlock the library exists to remove, and the watchdog (or
mpiexec's --timeout) catches it.

Run: mpiexec -n 4 python -m mpi4py tests/stress_harness.py --seeds 200   (make stress)
Against code that may hang or crash, ``python tests/stress/resume.py`` restarts
the job after each seed that killed it.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI
from stress.episodes import EPISODES, run_faults
from stress.ledger import CLASSES, CheckpointTimeout, Defect, Ledger, exchange

import collective_gc as cgc

try:  # optional: pip-only stacks have no petsc4py
    from petsc4py import PETSc
except ImportError:
    PETSc = None


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
    """Ends this rank (and so the job) if a phase of a seed overruns its deadline.

    The last net: sync points and checkpoints have deadlines of their own, but
    a call without one (a blocking collective inside the library) can still
    hang. It prints ``HANG: ... seed N`` (the resume driver reads it) and
    every thread's stack, then exits, which makes mpiexec end the job.
    """

    def __init__(self, seconds: float, rank: int) -> None:
        self.seconds = seconds
        self.rank = rank
        self.deadline = float("inf")
        self.seed = -1
        self.phase = ""
        t = threading.Thread(target=self._run, daemon=True, name="stress-watchdog")
        t.start()

    def arm(self, seed: int, phase: str = "", seconds: float | None = None) -> None:
        self.seed = seed
        self.phase = phase
        self.deadline = time.monotonic() + (self.seconds if seconds is None else seconds)

    def disarm(self) -> None:
        self.deadline = float("inf")

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            if time.monotonic() > self.deadline:
                die(f"rank {self.rank} seed {self.seed} overran its deadline in {self.phase!r}")


def die(why: str, seed: int = -1, found: list[Defect] | None = None) -> None:
    """A hang: say where every thread is, then end the job (never wait for it).

    ``found``: this rank's defects of the seed, not yet gathered: printed as
    ``UNREPORTED seed ...`` lines (the resume driver keeps them).
    """
    sys.stdout.flush()
    for d in found or ():
        sys.stderr.write(f"UNREPORTED {d.line(seed)}\n")
    sys.stderr.write(f"HANG: {why}\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(3)


ALL_KINDS = ("check", "check", "win", "comm", "derived") + (("vec",) if PETSc is not None else ())


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
    comm = MPI.Intracomm(world.Dup())
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

    def destroy_vec(i: int, v: Any) -> None:
        note(i)
        v.destroy()

    old_threshold = gc.get_threshold()
    gc.set_threshold(mine.randrange(20, 2000), mine.randrange(2, 20), mine.randrange(2, 20))
    holders: list[Holder | None] = []
    regs: list[cgc.Registration | None] = []
    cls = NaiveHolder if naive else Holder
    try:
        for i in range(n):
            fn: Callable[..., None]
            args: tuple[Any, ...]
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
                assert PETSc is not None, "no petsc4py: leave 'vec' out of kinds"
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
            # Diagnostics between sync points: pending and find_cycles are local,
            # view is collective (every rank, decided by the shared RNG).
            if not naive:
                if mine.random() < 0.2:
                    cgc.pending(comm)
                if shared.random() < 0.1:
                    cgc.view(comm, file=None)
                if mine.random() < 0.1:
                    live = [x for x in holders if x is not None]
                    if live:
                        cgc.find_cycles(live[mine.randrange(len(live))], max_depth=4)
                    del live
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


def _graph_defects(res: Outcome, rank: int) -> list[Defect]:
    """The graph round's findings in the classes of stress.ledger."""
    out = [Defect("error", "graph", rank, e) for e in res.errors if "differ" not in e]
    out += [Defect("disagree", "graph", rank, e) for e in res.errors if "differ" in e]
    if res.hangs:
        out.append(Defect("hang", "graph", rank, "a sync point timed out"))
    if res.double:
        out.append(Defect("double", "graph", rank, f"{res.double} object(s) destroyed twice"))
    if res.leaks:
        out.append(Defect("lost", "graph", rank, f"{res.leaks} object(s) never destroyed"))
    return out


def check_seed(
    world: MPI.Intracomm,
    ck: MPI.Comm,
    seed: int,
    dog: Watchdog,
    *,
    objects: int = 80,
    naive: bool = False,
    graph: bool = True,
    faults: bool = True,
    hang_timeout: float = 15.0,
    only: tuple[str, ...] = (),
    kinds: tuple[str, ...] = ALL_KINDS,
    notes: dict[str, Any] | None = None,
    big: bool = True,
) -> tuple[list[Defect], list[str], Outcome | None]:
    """Collective over ``world``: one seed's graph round and fault episodes.

    Returns every rank's defects (the same list on every rank, gathered over
    ``ck`` against a deadline), the episodes run, and this rank's graph outcome.
    ``notes``, if given, gets what this rank's episodes recorded about the
    paths they exercised (``Ledger.notes``). ``big``: whether an episode may
    run at the scale of a report (tens of seconds; see ``stress.episodes.Ctx``).
    A hang ends the job (watchdog or checkpoint deadline), never waits.
    """
    rank = world.Get_rank()
    dog.arm(seed, "graph")
    defects: list[Defect] = []
    episodes: list[str] = []
    res = None
    if graph:
        res = run_seed(world, seed, objects, naive, kinds)
        defects += _graph_defects(res, rank)
    if faults:
        ledger = Ledger(rank)

        def arm(phase: str, seconds: float) -> None:
            dog.arm(seed, phase, max(seconds, dog.seconds))

        try:
            episodes = run_faults(world, seed, ledger, hang_timeout, arm, only, big)
        except CheckpointTimeout as exc:
            die(f"rank {rank} seed {seed}: {exc}", seed, defects + ledger.defects)
        defects += ledger.defects
        if notes is not None:
            notes.update(ledger.notes)
    dog.arm(seed, "report", 2 * hang_timeout + 30)
    try:
        everyone = exchange(ck, defects, 2 * hang_timeout + 15, f"seed {seed} report")
    except CheckpointTimeout as exc:
        die(f"rank {rank} seed {seed}: {exc}", seed, defects)
    dog.disarm()
    return [d for per in everyone for d in per], episodes, res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--objects", type=int, default=80)
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds per seed")
    parser.add_argument("--naive", action="store_true", help="destroy from __del__ (deadlocks)")
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=15.0,
        help="deadline of sync points that must complete (timing out there is a hang)",
    )
    parser.add_argument("--only", default="", help="comma-separated episodes (default: random)")
    parser.add_argument("--no-graph", action="store_true", help="fault episodes only")
    parser.add_argument("--no-faults", action="store_true", help="the graph round only")
    parser.add_argument(
        "--no-big",
        action="store_true",
        help="no episode at the scale of a report (the sparse episode's ~700k keys), as make test",
    )
    parser.add_argument("--report", default="", help="rank 0 appends one JSON line per seed")
    args = parser.parse_args()
    only = tuple(x for x in args.only.split(",") if x)
    unknown = set(only) - set(EPISODES)
    if unknown:
        parser.error(f"unknown episodes {sorted(unknown)}; known: {sorted(EPISODES)}")
    # The late and freed episodes leave destroys pending on purpose (a manager
    # that timed out, a freed communicator); their exit warnings are expected.
    warnings.simplefilter("ignore", cgc.ExitLeakWarning)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    dog = Watchdog(args.deadline, rank)
    ck = world.Dup()  # the per-seed report exchange, never shared with the library
    totals = Outcome(-1)
    counts = dict.fromkeys(CLASSES, 0)
    t0 = time.perf_counter()
    bad = 0
    # The sparse episode's agreement paths: seeds on which each certainly ran.
    paths: dict[str, int] = {}
    for seed in range(args.first, args.first + args.seeds):
        ts = time.perf_counter()
        notes: dict[str, Any] = {}
        found, episodes, res = check_seed(
            world,
            ck,
            seed,
            dog,
            objects=args.objects,
            naive=args.naive,
            graph=not args.no_graph or args.naive,
            faults=not (args.naive or args.no_faults),
            hang_timeout=args.hang_timeout,
            only=only,
            notes=notes,
            big=not args.no_big,
        )
        for path in notes.get("sparse", ()):
            paths[path] = paths.get(path, 0) + 1
        if res is not None:
            totals.objects += res.objects
            totals.destroys += res.destroys
        for d in found:
            counts[d.cls] += 1
        if found:
            bad += 1
        if rank == 0:
            for d in found:
                print(d.line(seed), flush=True)
            if args.report:
                per = {c: sum(1 for d in found if d.cls == c) for c in CLASSES}
                with open(args.report, "a") as f:
                    line = {
                        "seed": seed,
                        "episodes": episodes,
                        "counts": per,
                        "notes": notes,
                        "seconds": round(time.perf_counter() - ts, 3),
                        "lines": [d.line(seed) for d in found],
                    }
                    f.write(json.dumps(line) + "\n")
            if (seed + 1 - args.first) % 20 == 0:
                print(
                    f"  {seed + 1 - args.first}/{args.seeds} seeds, "
                    f"{time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
    sums = world.allreduce((totals.objects, totals.destroys), op=_tuple_sum())
    if rank == 0:
        tally = ", ".join(f"{c} {counts[c]}" for c in CLASSES)
        print(
            f"stress{' (naive)' if args.naive else ''}: {world.Get_size()} ranks, "
            f"seeds {args.seeds}, graph objects {sums[0] // world.Get_size()} per rank, "
            f"destroys {sums[1]} (all ranks); {tally}; bad seeds {bad}, "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        shown = ", ".join(f"{p} {n}" for p, n in sorted(paths.items())) or "none"
        print(f"  sparse episode, seeds on which each path certainly ran: {shown}", flush=True)
    ck.Free()
    return 1 if bad else 0


def _tuple_sum() -> MPI.Op:
    # A pickle-based reduction of Python tuples: the function returns the result.
    return MPI.Op.Create(
        lambda a, b, dt: tuple(x + y for x, y in zip(a, b)),  # type: ignore[arg-type]
        commute=True,
    )


if __name__ == "__main__":
    sys.exit(main())
