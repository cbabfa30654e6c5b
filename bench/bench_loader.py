"""Per-rank loader benchmark: collective_gc ProcessPrefetch vs Grain, PyTorch and mp.Queue.

The same pipeline for all four: ``fn(i)`` makes a 256 KiB float32 element
(``full``: ``np.full``, a fresh array per element, ~20 us of work in the
worker; ``row``: a row of a table in memory, almost no work, so the loaders'
own cost is measured; both by default), 2 worker processes, the same prefetch
depth, and a consumer that reads two values of each element. Each
measurement runs in a fresh process and times ``--n`` elements (``--n-slow``
for the baselines) after ``--warmup`` (worker start-up excluded); the
methods alternate, ``--reps`` times, and the medians are printed, with each
ratio against a baseline measured in the same run. PyTorch runs
``DataLoader(dataset, batch_size=None, num_workers=2, prefetch_factor=...)``
over a map-style dataset whose ``__getitem__`` is the same ``fn`` (each
element becomes a tensor, as its users get it).

Then the parent-death exit latency: a process iterating a ProcessPrefetch is
SIGKILLed, and we time until both its workers are gone (median of ``--kills``).
Measured processes do not initialize MPI (no singleton, so no ``orted``
child beside the workers), as under ``mpiexec``, where ranks have none.
Grain gets one such round too, for comparison (its workers are left running;
we kill them afterwards).

Grain 0.2.18 and PyTorch 2.13 are bench-only dependencies, each kept in its
own environment (never in .venv: Debian's petsc4py needs Debian's numpy):

    python -m venv --system-site-packages .venv-grain
    .venv-grain/bin/pip install grain==0.2.18
    bash bench/setup-torch-venv.sh .venv-torch
    python bench/bench_loader.py --grain-python .venv-grain/bin/python \
        --torch-python .venv-torch/bin/python

Without a Python that can import grain (or torch), that baseline is skipped
with a note and the other figures are still measured. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ELEMENT = 65536  # float32: 256 KiB
TABLE_ROWS = 64
_TABLE: np.ndarray[Any, Any] | None = None


def full(i: int) -> np.ndarray[Any, Any]:
    return np.full(ELEMENT, i, np.float32)


def row(i: int) -> np.ndarray[Any, Any]:
    global _TABLE
    if _TABLE is None:  # built once per worker, outside the timed part in practice
        _TABLE = np.arange(TABLE_ROWS * ELEMENT, dtype=np.float32).reshape(TABLE_ROWS, ELEMENT)
    out: np.ndarray[Any, Any] = _TABLE[i % TABLE_ROWS]
    return out


PIPELINES = {"full": full, "row": row}
PIPELINE_NOTES = {
    "full": "np.full, a new array per element",
    "row": "a row of a table in memory: transport only",
}


# -- one measurement, in a fresh process ------------------------------------------------


def _consume(it: Any, warmup: int, n: int) -> float:
    check = 0.0
    for _ in range(warmup):
        e = next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        e = next(it)
        check += float(e[0]) + float(e[-1])  # touch the element, as a consumer would
    elapsed = time.perf_counter() - t0
    del e
    assert check == check  # keep the reads
    return elapsed


def _run_cgc(fn: Any, args: argparse.Namespace) -> float:
    from collective_gc.data import ProcessPrefetch

    total = args.warmup + args.n
    with ProcessPrefetch(fn, range(total), num_workers=args.workers, buffer_size=args.buffer) as it:
        return _consume(it, args.warmup, args.n)


def _run_grain(fn: Any, args: argparse.Namespace) -> float:
    import grain.python as gp  # type: ignore[import-not-found, unused-ignore]

    total = args.warmup + args.n
    options = gp.MultiprocessingOptions(
        num_workers=args.workers, per_worker_buffer_size=max(1, args.buffer // args.workers)
    )
    ds = gp.MapDataset.range(total).map(fn).to_iter_dataset().mp_prefetch(options)
    it = iter(ds)
    elapsed = _consume(it, args.warmup, args.n)
    del it, ds
    return elapsed


class _MapDataset:
    """A map-style dataset for PyTorch's DataLoader: ``fn(i)`` for ``i < n``."""

    def __init__(self, fn: Any, n: int) -> None:
        self.fn, self.n = fn, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)


def _run_torch(fn: Any, args: argparse.Namespace) -> float:
    import torch.utils.data as tud  # type: ignore[import-not-found, unused-ignore]

    total = args.warmup + args.n
    loader = tud.DataLoader(
        _MapDataset(fn, total),
        batch_size=None,
        num_workers=args.workers,
        prefetch_factor=max(1, args.buffer // args.workers),
    )
    it = iter(loader)
    elapsed = _consume(it, args.warmup, args.n)
    del it, loader
    return elapsed


def _queue_worker(fn: Any, keys: range, q: Any) -> None:
    for i in keys:
        q.put(fn(i))


def _run_queue(fn: Any, args: argparse.Namespace) -> float:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    total, w = args.warmup + args.n, args.workers
    queues = [ctx.Queue(maxsize=max(1, args.buffer // w)) for _ in range(w)]
    procs = [
        ctx.Process(target=_queue_worker, args=(fn, range(k, total, w), queues[k]), daemon=True)
        for k in range(w)
    ]
    for p in procs:
        p.start()

    def ordered() -> Any:
        for i in range(total):
            yield queues[i % w].get()

    elapsed = _consume(ordered(), args.warmup, args.n)
    for p in procs:
        p.join(10)
    return elapsed


def _run_limit(fn: Any, args: argparse.Namespace) -> float:
    """No loader: make each element and copy it once (as into a slot), in this process.

    The machine's limit for a loader of ``--workers`` processes is this rate
    times the cores that can make elements at once (``_cores``), with the
    consumer's own work free: what a loader must approach.
    """
    total = args.warmup + args.n
    out = np.empty(ELEMENT, np.float32)

    def made() -> Any:
        for i in range(total):
            out[:] = fn(i)
            yield out

    return _consume(made(), args.warmup, args.n)


RUNNERS = {
    "limit": _run_limit,
    "collective_gc": _run_cgc,
    "grain": _run_grain,
    "torch": _run_torch,
    "mp.Queue": _run_queue,
}


# -- parent death -------------------------------------------------------------------


def _victim(kind: str) -> None:
    fn = PIPELINES["full"]
    if kind == "collective_gc":
        from collective_gc.data import ProcessPrefetch

        it: Any = ProcessPrefetch(fn, range(10**6), num_workers=2, buffer_size=4)
    else:
        import grain.python as gp  # type: ignore[import-not-found, unused-ignore]

        options = gp.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=2)
        it = iter(gp.MapDataset.range(10**6).map(fn).to_iter_dataset().mp_prefetch(options))
    kept = [next(it) for _ in range(4)]
    time.sleep(0.5)  # workers fill their buffers and wait
    print("ready", flush=True)
    del kept
    time.sleep(600)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


def _kill_round(python: str, kind: str, wait: float) -> tuple[float | None, int, int]:
    """SIGKILL a victim; (seconds until its children died or None, children, survivors)."""
    victim = subprocess.Popen(
        [python, __file__, "--victim", kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_child_env(),
    )
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"{kind} victim did not start")
        children = _children(victim.pid)
        victim.kill()
        t0 = time.perf_counter()
        while any(_alive(p) for p in children) and time.perf_counter() - t0 < wait:
            time.sleep(0.0005)
        latency = time.perf_counter() - t0
        survivors = [p for p in children if _alive(p)]
    finally:
        victim.kill()
        victim.wait()
    for p in survivors:  # Grain's: we clean up after it
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return (None if survivors else latency), len(children), len(survivors)


# -- driver -------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _cores(workers: int) -> int:
    return max(1, min(workers, os.cpu_count() or 1))


def _measure(python: str, method: str, pipeline: str, args: argparse.Namespace) -> float:
    n = args.n if method in ("collective_gc", "limit") else args.n_slow
    cmd = [
        python, __file__, "--one", method, "--pipeline", pipeline, "--n", str(n),
        "--warmup", str(args.warmup), "--workers", str(args.workers), "--buffer", str(args.buffer),
    ]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=_child_env(), timeout=900, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{method} run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["elements_per_s"])


NAMES = {
    "collective_gc": "collective_gc ProcessPrefetch",
    "grain": "grain 0.2.18 mp_prefetch",
    "torch": "torch 2.13 DataLoader",
    "mp.Queue": "multiprocessing.Queue (pickle)",
    "limit": "limit: in-process make + 1 copy",
}
# The throughput targets (issue 34), each against a baseline measured in the
# same run.
TARGETS = {"grain": 40.0, "torch": 40.0}
# Against the machine's limit (issue 40): the in-process rate times _cores().
LIMIT_TARGET = 0.5
DEATH_TARGET_MS = 3.0


def _throughput(pipeline: str, methods: list[str], args: argparse.Namespace) -> dict[str, float]:
    print(
        f"{pipeline} pipeline ({PIPELINE_NOTES[pipeline]}): {ELEMENT * 4 // 1024} KiB float32 "
        f"elements, {args.workers} workers, prefetch {args.buffer}; median of {args.reps} runs "
        f"of {args.n} timed elements ({args.n_slow} for the baselines) after {args.warmup}"
    )
    methods = [*methods, "limit"]
    rates: dict[str, list[float]] = {m: [] for m in methods}
    pythons = {"grain": args.grain_python, "torch": args.torch_python}
    for _ in range(args.reps):  # the methods alternate, so load changes hit all alike
        for m in methods:
            rates[m].append(_measure(pythons.get(m, sys.executable), m, pipeline, args))
    med = {m: statistics.median(r) for m, r in rates.items()}
    for m in methods:
        spread = f"{min(rates[m]):,.0f}-{max(rates[m]):,.0f}"
        gbs = med[m] * ELEMENT * 4 / 1e9
        print(f"  {NAMES[m]:32s} {med[m]:10,.0f} elements/s  {gbs:5.2f} GB/s  (runs {spread})")
    ours = med["collective_gc"]
    for m in methods[1:-1]:
        print(f"  ratio collective_gc / {m}: {ours / med[m]:.1f}x")
    cores = _cores(args.workers)
    limit = med["limit"] = cores * med["limit"]
    print(
        f"  the machine's limit: {cores} cores x the in-process rate = {limit:,.0f} elements/s; "
        f"collective_gc / limit: {ours / limit:.2f}"
    )
    verdict = [
        f">= {TARGETS[m]:.0f}x {m}: {'yes' if ours >= TARGETS[m] * med[m] else 'NO'}"
        for m in TARGETS
        if m in med
    ]
    met = "yes" if ours >= LIMIT_TARGET * limit else "NO"
    verdict.append(f">= {LIMIT_TARGET} of the limit: {met}")
    if verdict:
        print("  targets: " + "; ".join(verdict))
    return med


def _save(rows: list[dict[str, Any]], load_before: float) -> None:
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    # The host's load: a loader's hand-offs between processes suffer more from
    # other jobs on the cores than the baselines' per-element work does.
    meta = {
        "ranks": 1,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host_cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    (results / "loader.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _can_import(python: str, module: str) -> bool:
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False)
    return probe.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", choices=[*sorted(PIPELINES), "both"], default="both")
    parser.add_argument("--n", type=int, default=20000, help="timed elements per run")
    parser.add_argument(
        "--n-slow", type=int, default=3000, help="timed elements per Grain or mp.Queue run"
    )
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--buffer", type=int, default=8, help="prefetch depth, all workers")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--workers-more", type=int, default=4, help="workers of the extra `full` row (0: none)"
    )
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--death-only", action="store_true", help="only the parent-death rounds")
    parser.add_argument(
        "--grain-python", default=os.environ.get("GRAIN_PYTHON", sys.executable),
        help="a Python that can import grain 0.2.18 (default: $GRAIN_PYTHON or this one)",
    )  # fmt: skip
    parser.add_argument(
        "--torch-python", default=os.environ.get("TORCH_PYTHON", sys.executable),
        help="a Python that can import torch 2.13 (default: $TORCH_PYTHON or this one)",
    )  # fmt: skip
    parser.add_argument("--one", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--victim", choices=["collective_gc", "grain"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.victim or args.one:
        # collective_gc imports mpi4py.MPI: outside mpiexec that would start an
        # MPI singleton, and with it Open MPI's `orted` daemon, a child process
        # that is not the loader's (its exit is not ours to time) and takes CPU.
        try:
            import mpi4py

            mpi4py.rc.initialize = False
        except ImportError:
            pass
    if args.victim:
        _victim(args.victim)
        return
    if args.one:
        fn = PIPELINES[args.pipeline]
        elapsed = RUNNERS[args.one](fn, args)
        print(json.dumps({"elements_per_s": args.n / elapsed}))
        return

    if args.death_only:
        _death(args)
        return
    methods = ["collective_gc"]
    if _can_import(args.grain_python, "grain.python"):
        methods.append("grain")
    else:
        print(
            f"note: {args.grain_python} cannot import grain, so Grain is skipped; install it "
            "apart: python -m venv --system-site-packages .venv-grain && "
            ".venv-grain/bin/pip install grain==0.2.18, then pass --grain-python "
            ".venv-grain/bin/python"
        )
    if _can_import(args.torch_python, "torch.utils.data"):
        methods.append("torch")
    else:
        print(
            f"note: {args.torch_python} cannot import torch, so PyTorch is skipped; install "
            "it apart: bash bench/setup-torch-venv.sh .venv-torch, then pass --torch-python "
            ".venv-torch/bin/python"
        )
    methods.append("mp.Queue")
    load_before = os.getloadavg()[0]
    print(f"host: {os.cpu_count()} CPUs, load average {load_before:.1f} at the start")
    pipelines = sorted(PIPELINES) if args.pipeline == "both" else [args.pipeline]
    rows: list[dict[str, Any]] = []
    for pipeline in pipelines:
        med = _throughput(pipeline, methods, args)
        row: dict[str, Any] = {"bench": f"loader_{pipeline}", "ours_per_s": med["collective_gc"]}
        row["mpq_per_s"] = med["mp.Queue"]
        row["limit_per_s"] = med["limit"]
        row["ratio_limit"] = med["collective_gc"] / med["limit"]
        if "torch" in med:
            row["torch_per_s"] = med["torch"]
            row["ratio_torch"] = med["collective_gc"] / med["torch"]
        if "grain" in med:
            row["grain_per_s"] = med["grain"]
            row["ratio"] = med["collective_gc"] / med["grain"]
            row["target"] = ">= 40 (vs Grain); >= 40 vs torch"
        else:
            row["ratio"] = med["collective_gc"] / med["mp.Queue"]
            row["target"] = "vs mp.Queue (Grain not installed)"
        rows.append(row)
    if args.workers_more:
        # More workers than cores: the same depth per worker, the same baselines
        # (mp.Queue aside), the same limit (the cores, not the workers, bound it).
        more = argparse.Namespace(**vars(args))
        more.buffer = args.buffer * args.workers_more // args.workers
        more.workers = args.workers_more
        few = [m for m in methods if m != "mp.Queue"]
        med = _throughput("full", few, more)
        row = {"bench": f"loader_full_{more.workers}_workers", "ours_per_s": med["collective_gc"]}
        row["limit_per_s"] = med["limit"]
        row["ratio_limit"] = med["collective_gc"] / med["limit"]
        for m in ("grain", "torch"):
            if m in med:
                row[f"{m}_per_s"] = med[m]
                row[f"ratio_{m}"] = med["collective_gc"] / med[m]
        rows.append(row)

    rows.append(_death(args))
    _save(rows, load_before)
    if "grain" in methods:
        _grain_death(args)


def _death(args: argparse.Namespace) -> dict[str, Any]:
    latencies = []
    for _ in range(args.kills):
        latency, children, survivors = _kill_round(sys.executable, "collective_gc", 5.0)
        if latency is None:
            print(f"  parent death: {survivors} of {children} workers survived SIGKILL!")
        else:
            latencies.append(latency)
    if latencies:
        ms = statistics.median(latencies) * 1e3
        print(
            f"parent-death exit latency after SIGKILL (2 workers, median of "
            f"{len(latencies)}): {ms:.1f} ms (max {max(latencies) * 1e3:.1f} ms); "
            f"target <= {DEATH_TARGET_MS:.0f} ms: {'yes' if ms <= DEATH_TARGET_MS else 'NO'}"
        )
        return {
            "bench": "parent_death_ms",
            "median_ms": ms,
            "max_ms": max(latencies) * 1e3,
            "target": f"<= {DEATH_TARGET_MS:.0f} ms",
        }
    return {"bench": "parent_death_ms", "survivors": True}


def _grain_death(args: argparse.Namespace) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    latency, children, survivors = _kill_round(args.grain_python, "grain", 2.0)
    time.sleep(0.5)  # let the killed survivors go
    # What Grain left in /dev/shm after the kill: its segments, and its queues'
    # semaphores. Remove them (they appeared during this round only).
    leaked = [
        n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(("psm_", "sem.mp-"))
    ]
    for name in leaked:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
    print(
        f"  grain 0.2.18 after SIGKILL: {survivors} of {children} child processes "
        f"still alive 2 s later, {len(leaked)} entries left in /dev/shm "
        "(both cleaned up by this bench)"
    )


if __name__ == "__main__":
    main()
