"""Sync-point cost as the backlog and the job grow: 1e3, 1e4, 1e5 pending keys at 2-16 ranks.

Issue 14: "per-key cost linear to 1e5 pending and flat in ranks per
rank-CPU". For each rank count (2, 4, 8, 16 by default) the driver launches
one job, ``tools/mpirun N TIMEOUT python -m mpi4py bench/bench_scale.py
--worker``, which measures on a duplicate of COMM_WORLD, through the public
API only (``cgc.register`` with a no-op destroy, ``cgc.collect``):

- an empty sync point, beside one ``Allreduce`` of 8 int64 (the baseline,
  interleaved in the same run);
- a sync point that destroys 1e3, 1e4, 1e5 keys queued on every rank (the
  registrations and drops are untimed setup).

Each figure is the slowest rank's time, median of ``--repeats`` (default 5;
three times as many for 1e3 and 1e4) repeats. The machine has fewer cores than the larger jobs have
ranks, so times are also given per rank-CPU: time x ranks / cores (cores =
the CPUs this machine has, at most the ranks). Printed ratios, all from the
same run: per-key cost at each backlog over the per-key cost at 1e3 (linear
in the backlog: ~1), and per-rank-CPU cost at each rank count over that at
the smallest one (flat in ranks: ~1).

Run: python bench/bench_scale.py   (make bench; not under mpiexec: it launches
its own jobs). ``--ranks 2,4`` picks the jobs, ``--no-save`` skips
bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MPIRUN = HERE.parent / "tools" / "mpirun"
RESULTS = HERE / "results"
BACKLOGS = (1_000, 10_000, 100_000)
EMPTY_K = 200  # empty sync points per timed repeat: one alone is below the clock's use


def worker(out: str, repeats: int) -> None:
    """One job: every rank measures; rank 0 writes the rows to ``out``."""
    import gc

    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, str(HERE))
    import collective_gc as cgc

    from _common import paired

    gc.disable()  # no automatic collection pauses inside the timings
    world = MPI.COMM_WORLD
    c = world.Dup()
    cgc.collect(c, generation=None)  # the manager exists on every rank before any timing
    a = np.zeros(8, dtype=np.int64)
    b = np.empty_like(a)

    class Res:
        pass

    def noop() -> None:
        pass

    def allreduce() -> None:
        for _ in range(EMPTY_K):
            c.Allreduce(a, b, MPI.MAX)

    def empty_sync() -> None:
        for _ in range(EMPTY_K):
            cgc.collect(c, generation=None)

    t_sync, t_ar, ratio = paired(world, empty_sync, allreduce, repeats)
    rows: list[dict[str, Any]] = [
        {
            "pending": 0,
            "sync_us": t_sync / EMPTY_K * 1e6,
            "allreduce_us": t_ar / EMPTY_K * 1e6,
            "ratio_to_allreduce": ratio,
        }
    ]

    def fill(n: int) -> None:
        register = cgc.register
        for _ in range(n):
            register(Res(), noop, comm=c)

    for n in BACKLOGS:
        samples = []
        # The small backlogs take milliseconds, where one descheduling of an
        # oversubscribed rank shows: more repeats for them (they are cheap).
        for _ in range(repeats if n >= 100_000 else 3 * repeats):
            fill(n)
            world.Barrier()
            t0 = time.perf_counter()
            stats = cgc.collect(c, generation=None)
            dt = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            assert stats.destroyed == n, f"{stats.destroyed} destroyed, {n} queued"
            samples.append(dt)
        t = statistics.median(samples)
        rows.append({"pending": n, "sync_us": t * 1e6, "us_per_key": t / n * 1e6})
    if world.Get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def launch(ranks: int, repeats: int, timeout: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            str(MPIRUN),
            str(ranks),
            str(timeout),
            sys.executable,
            "-m",
            "mpi4py",
            str(Path(__file__).resolve()),
            "--worker",
            str(out),
            "--repeats",
            str(repeats),
        ]
        subprocess.run(cmd, check=True)
        rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.repeats)
        return 0
    cpus = os.cpu_count() or 1
    counts = [int(r) for r in args.ranks.split(",")]
    print(f"bench_scale: ranks {counts} on {cpus} CPUs, median of {args.repeats}", flush=True)
    rows: list[dict[str, Any]] = []
    for ranks in counts:
        t0 = time.perf_counter()
        per_cpu = ranks / min(ranks, cpus)
        job = launch(ranks, args.repeats, args.timeout)
        for row in job:
            row["ranks"] = ranks
            row["bench"] = f"scale {ranks} ranks, {row['pending']} pending"
            row["rank_cpu_us"] = row["sync_us"] / per_cpu
            if row["pending"]:
                row["rank_cpu_us_per_key"] = row["us_per_key"] / per_cpu
        empty = job[0]
        print(
            f"{ranks:2d} ranks: empty sync {empty['sync_us']:8.1f} us, Allreduce "
            f"{empty['allreduce_us']:8.1f} us, ratio {empty['ratio_to_allreduce']:.2f}; "
            + ", ".join(
                f"{r['pending']:.0e}: {r['sync_us'] / 1e3:8.2f} ms "
                f"({r['us_per_key']:.2f} us/key, {r['rank_cpu_us_per_key']:.2f} per rank-CPU)"
                for r in job[1:]
            )
            + f"  [{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
        rows.extend(job)
    # Ratios against baselines from this same run.
    first = counts[0]
    for row in rows:
        if not row["pending"]:
            row["ratio"] = row["ratio_to_allreduce"]
            continue
        ref_backlog = next(
            r for r in rows if r["ranks"] == row["ranks"] and r["pending"] == BACKLOGS[0]
        )
        ref_ranks = next(r for r in rows if r["ranks"] == first and r["pending"] == row["pending"])
        row["linearity"] = row["us_per_key"] / ref_backlog["us_per_key"]
        row["ratio"] = row["rank_cpu_us_per_key"] / ref_ranks["rank_cpu_us_per_key"]
    print(f"per-key cost / per-key cost at {BACKLOGS[0]:.0e} (linear: ~1, same ranks):")
    for ranks in counts:
        line = "  ".join(
            f"{r['pending']:.0e}: {r['linearity']:.2f}"
            for r in rows
            if r["ranks"] == ranks and r["pending"]
        )
        print(f"  {ranks:2d} ranks: {line}")
    print(f"per-rank-CPU cost per key / that at {first} ranks (flat: ~1, same backlog):")
    for n in BACKLOGS:
        line = "  ".join(f"{r['ranks']} ranks: {r['ratio']:.2f}" for r in rows if r["pending"] == n)
        print(f"  {n:.0e} pending: {line}")
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        meta = {
            "ranks": ",".join(map(str, counts)),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "host_cpus": cpus,
            "load": os.getloadavg()[0],
        }
        (RESULTS / "scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
