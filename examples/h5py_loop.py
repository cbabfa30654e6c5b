"""A parallel HDF5 output loop with h5py: a file per step, never closed by hand (issue 33).

Each step opens its own file with the MPI driver on COMM_WORLD, writes a
dataset collectively (a row per rank) and an attribute, and leaves the file,
the dataset and a group in its wrapper, which sits in a reference cycle, as
real codes leave them; each rank also makes a different amount of cyclic
garbage, so that the ranks' collectors run at different moments.

    mpiexec -n 4 python -m mpi4py examples/h5py_loop.py [--steps N] [--mode M] [--check]

``--mode cgc`` (the default) is the documented path (docs/guides/h5py.rst):
one scope on COMM_WORLD, and ``collective_gc.h5py.manage(step, step.dset,
step.file, comm=WORLD)``: the file is closed at the agreed sync point once
the step has died on every rank, what is open in it first; a young
collection before each sync point finds the dead step. ``--mode close``
closes each file by hand at the end of its step (the baseline to compare
with). ``--mode gc`` leaves it to plain GC: it hangs (one rank's collector
closes a file, a collective, while the others are elsewhere), so run it with
a timeout. After the loop every rank reads every file back and checks it.
The last line printed by rank 0 is a JSON summary; ``--check`` exits 1
unless every file was read back right, RSS grew by at most 20 KiB a step
from step 20, no HDF5 file is left open and nothing is pending.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.h5py as ch5

WORLD = MPI.COMM_WORLD
N = 64  # values per rank and step


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def expected(i: int, rank: int) -> np.ndarray[Any, Any]:
    """What step ``i`` writes in rank ``rank``'s row."""
    return np.arange(N, dtype="f8") + 1000.0 * i + rank


class Step:
    """One step: its file, a dataset and a group of it, in a cycle."""

    def __init__(self, out_dir: str, i: int) -> None:
        self.me = self  # a cycle, as real codes leave them
        self.i = i
        self.file = h5py.File(path_of(out_dir, i), "w", driver="mpio", comm=WORLD)
        self.dset = self.file.create_dataset("u", (WORLD.size, N), dtype="f8")
        self.group = self.file.create_group("meta")
        self.group.attrs["step"] = i  # attribute writes are collective too
        self.callback = self.report  # a bound method: another cycle
        # Rank-dependent cyclic garbage: the ranks' collectors run at
        # different moments, as they do in real programs.
        junk: list[Any] = [[] for _ in range(40 * WORLD.rank)]
        for j in junk:
            j.append(j)

    def report(self) -> str:
        return f"step {self.i} on {WORLD.size} ranks"

    def write(self) -> None:
        with self.dset.collective:
            self.dset[WORLD.rank] = expected(self.i, WORLD.rank)


def path_of(out_dir: str, i: int) -> str:
    return os.path.join(out_dir, f"step{i:04d}.h5")


def read_back(out_dir: str, steps: int) -> list[str]:
    """Every file, opened collectively and read by every rank: what is wrong. Collective."""
    bad = []
    for i in range(steps):
        try:
            with h5py.File(path_of(out_dir, i), "r", driver="mpio", comm=WORLD) as f:
                data = f["u"][...]
                step = int(f["meta"].attrs["step"])
            want = np.stack([expected(i, r) for r in range(WORLD.size)])
            if step != i or not np.array_equal(data, want):
                bad.append(f"step {i}: wrong contents")
        except Exception as exc:  # noqa: BLE001 (reported, with the others)
            bad.append(f"step {i}: {type(exc).__name__}: {exc}")
    return bad


def open_files() -> int:
    """HDF5 files this process still has open (HDF5's own count). Local."""
    return int(h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE))


def run(mode: str, steps: int, out_dir: str | None = None) -> dict[str, Any]:
    """The loop in one mode; returns this rank's figures. Collective."""
    own_dir = out_dir is None
    if out_dir is None:
        out_dir = WORLD.bcast(tempfile.mkdtemp(prefix="cgc-h5py-") if WORLD.rank == 0 else "")
    rss: list[int] = []
    most_open = 0
    sync_s = 0.0
    WORLD.Barrier()
    t0 = time.perf_counter()
    if mode == "cgc":
        with cgc.collective_scope(WORLD, timeout=120) as scope:
            for i in range(steps):
                step = Step(out_dir, i)
                # The dataset first: the order that lost every file with keep.
                ch5.manage(step, step.dset, step.file, comm=WORLD)
                step.write()
                del step
                s0 = time.perf_counter()
                # A young collection finds the dead step (the automatic
                # collector is off in a managed scope, so it is still young),
                # and this sync point closes its file. Without it the scope's
                # own collections find the steps a few at a time (at most 6
                # files open at once here, and a little more memory).
                gc.collect(0)
                scope.sync()
                sync_s += time.perf_counter() - s0
                rss.append(rss_kib())
                most_open = max(most_open, open_files())
    else:
        for i in range(steps):
            step = Step(out_dir, i)
            step.write()
            if mode == "close":
                step.file.close()
            del step
            rss.append(rss_kib())
            most_open = max(most_open, open_files())
    total = time.perf_counter() - t0
    bad = read_back(out_dir, steps)
    left_open = open_files()
    WORLD.Barrier()
    if own_dir and WORLD.rank == 0:
        shutil.rmtree(out_dir)
    start = min(20, len(rss) - 1)
    return {
        "mode": mode,
        "steps": steps,
        "ms_per_step": 1e3 * total / steps,
        "sync_share": sync_s / total,
        "rss_kib_per_step": (rss[-1] - rss[start]) / max(1, len(rss) - 1 - start),
        "unreadable": bad,
        "most_open_files": most_open,
        "open_files": left_open,
        "pending": sum(len(m.pending()) + m.registered for m in cgc.managers()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mode", choices=("cgc", "close", "gc"), default="cgc")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every file reads back right, RSS <= 20 KiB/step, nothing left",
    )
    args = parser.parse_args()
    mine = run(args.mode, args.steps)
    summaries = WORLD.gather(mine)
    if WORLD.rank == 0:
        summary = dict(mine)
        summary["rss_kib_per_step"] = max(s["rss_kib_per_step"] for s in summaries)
        summary["unreadable"] = sorted({b for s in summaries for b in s["unreadable"]})
        summary["open_files_by_rank"] = [s["open_files"] for s in summaries]
        summary["pending_by_rank"] = [s["pending"] for s in summaries]
        del summary["open_files"], summary["pending"]
        print(json.dumps(summary), flush=True)
        bad = (
            summary["rss_kib_per_step"] > 20
            or summary["unreadable"]
            or any(summary["open_files_by_rank"])
            or any(summary["pending_by_rank"])
        )
        if args.check and bad:
            raise SystemExit(f"h5py_loop: over budget: {summary}")


if __name__ == "__main__":
    main()
