"""What tracing sync points costs (collective_gc.trace), on all ranks of COMM_WORLD.

The empty sync point (``cgc.collect(comm, generation=None)`` with nothing
pending), in three ways, interleaved repeat by repeat so that a slow phase of
this shared machine hits all three:

- off: the default. The sync point reads the tracer slot, finds nothing, and
  runs its steady state (in C where the extension was built with MPI);
- steps: a tracer that records nothing, so the sync point takes its Python
  steps and marks its phases: what leaving the steady state costs;
- on: ``collective_gc.trace`` writing this rank's file (one write a sync
  point).

And the off check alone (one list read and a truth test, timed in a loop),
beside the empty sync point: what tracing costs when it is off.

Run: mpiexec -n 4 python bench/bench_trace.py   (and -n 2). ``--off-only``
times the first row alone, on a tree without collective_gc.trace too (to
compare commits).
"""

from __future__ import annotations

import gc
import shutil
import statistics
import sys
import tempfile
import timeit
from collections.abc import Callable

from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402
from collective_gc import _switch  # noqa: E402

try:
    from collective_gc import _tracing
except ImportError:  # a tree from before the tracer hook (--off-only)
    _tracing = None  # type: ignore[assignment]

from _common import save, say, timed  # noqa: E402

comm = MPI.COMM_WORLD
REPEATS = 9
K = 1000  # sync points per timing


class Silent:
    """A tracer that records nothing: the Python steps' own cost."""

    def sync_point_began(self, *args: object) -> None:
        pass

    def sync_point(self, *args: object) -> None:
        pass


def main() -> None:
    gc.disable()  # no automatic collection pauses inside the timings
    off_only = "--off-only" in sys.argv[1:]
    c = comm.Dup()
    cgc.manager(c)
    say(
        comm,
        f"bench_trace: {comm.Get_size()} ranks, {K} empty sync points a timing, median of "
        f"{REPEATS}, slowest rank per timing; steady state: {_switch.speedups()}",
    )

    def syncs() -> None:
        collect = cgc.collect
        for _ in range(K):
            collect(c, generation=None)

    made = tempfile.mkdtemp(prefix="cgc-bench-trace-") if comm.Get_rank() == 0 else None
    where = comm.bcast(made)

    def off() -> float:
        return timed(comm, syncs, 1)

    def steps() -> float:
        before = _tracing.set_tracer(Silent())
        try:
            return timed(comm, syncs, 1)
        finally:
            _tracing.set_tracer(before)

    def on() -> float:
        from collective_gc import trace

        with trace.tracing(where):
            return timed(comm, syncs, 1)

    modes: dict[str, Callable[[], float]] = {"off": off}
    if not off_only:
        modes.update(steps=steps, on=on)
    for fn in modes.values():
        fn()  # warm: the family, the buffers, the file
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(REPEATS):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for m in order:
            times[m].append(modes[m]() / K)
    med = {m: statistics.median(ts) for m, ts in times.items()}
    rows: list[dict[str, object]] = []
    for m in modes:
        ratio = statistics.median(a / b for a, b in zip(times[m], times["off"]))
        say(
            comm,
            f"empty sync point, trace {m:5s}: {med[m] * 1e6:8.1f} us   ratio to off {ratio:.2f}",
        )
        rows.append({"bench": f"sync_trace_{m}", "sync_us": med[m] * 1e6, "ratio": ratio})

    if _tracing is None:
        return
    # The off check itself: what Collective.quick and SyncPoint.run add when
    # no tracer is set.
    # (A module attribute since core v4, no longer a one-item list.)
    n = 1_000_000
    check = min(timeit.repeat(lambda: _tracing.TRACER is None, number=n, repeat=5)) / n
    loop = min(timeit.repeat(lambda: None, number=n, repeat=5)) / n
    check = max(check - loop, 0.0)
    say(
        comm,
        f"the off check alone: {check * 1e9:.1f} ns, {check / med['off']:.2e} of the "
        "empty sync point off",
    )
    rows.append(
        {
            "bench": "trace_off_check",
            "check_ns": check * 1e9,
            "ratio": check / med["off"],
        }
    )
    if comm.Get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    if not off_only and "--no-save" not in sys.argv[1:]:
        save("trace" if comm.Get_size() != 2 else "trace_2ranks", rows, comm)
    c.Free()


if __name__ == "__main__":
    main()
