"""Shared timing helpers for the benchmarks (all ranks call them together)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

RESULTS = Path(__file__).parent / "results"


def timed(
    comm: MPI.Comm,
    fn: Callable[[], object],
    repeats: int = 5,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median over ``repeats`` of the slowest rank's wall time of ``fn()``."""
    return timed_cpu(comm, fn, repeats, setup)[0]


def timed_cpu(
    comm: MPI.Comm,
    fn: Callable[[], object],
    repeats: int = 5,
    setup: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Medians over ``repeats`` of the slowest rank's wall time and CPU time
    (this process's) of ``fn()``. With more ranks than cores the two differ:
    the wall time also holds the time a rank waited for a core."""
    walls, cpus = [], []
    for _ in range(repeats):
        if setup is not None:
            setup()
        comm.Barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
        walls.append(comm.allreduce(dt, op=MPI.MAX))
        cpus.append(comm.allreduce(dc, op=MPI.MAX))
    return statistics.median(walls), statistics.median(cpus)


def paired(
    comm: MPI.Comm,
    ours: Callable[[], object],
    base: Callable[[], object],
    repeats: int = 5,
    setup: Callable[[], object] | None = None,
) -> tuple[float, float, float]:
    """Interleaved medians: (ours, base, median of per-repeat ratios).

    Each repeat times the baseline and then ours back to back, so that a slow
    phase of this shared machine hits both; the ratio is taken per repeat.
    """
    t_ours, t_base, ratios = [], [], []
    for _ in range(repeats):
        b = timed(comm, base, 1)
        o = timed(comm, ours, 1, setup)
        t_ours.append(o)
        t_base.append(b)
        ratios.append(o / b)
    return statistics.median(t_ours), statistics.median(t_base), statistics.median(ratios)


def save(name: str, rows: list[dict[str, Any]], comm: MPI.Comm) -> None:
    if comm.Get_rank() == 0:
        RESULTS.mkdir(exist_ok=True)
        meta = {
            "ranks": comm.Get_size(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "host_cpus": os.cpu_count(),
        }
        (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def say(comm: MPI.Comm, *args: object) -> None:
    if comm.Get_rank() == 0:
        print(*args, flush=True)
