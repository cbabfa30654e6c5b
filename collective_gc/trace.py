"""Where sync time goes: a trace of every sync point, one file per rank.

``COLLECTIVE_GC_TRACE=path`` in the environment (read at ``import
collective_gc``), or :func:`start` / :func:`stop` / :func:`tracing`, writes
each sync point this rank runs, with its phases, in the Chrome trace-event
JSON format that Perfetto (https://ui.perfetto.dev) and ``chrome://tracing``
open::

    COLLECTIVE_GC_TRACE=trace/ mpiexec -n 4 python solver.py
    python -m collective_gc.trace trace/ [--plot trace.png] [--merge all.json]

The second line prints, per rank, the time spent in sync points, the share of
it spent waiting for the other ranks, and which rank was last most often.

Files: ``path`` an existing directory, or ending in ``/``: ``rank<R>.json``
in it; otherwise ``<path without .json>.rank<R>.json``. ``R`` is the rank in
``COMM_WORLD``. A rank's file is made at its first traced sync point (a
process that runs none, such as this module's summary, writes nothing).

Each sync point is one complete event ("sync point", with its family, number,
rank in the family, destroys and outcome) followed by one per phase, in this
rank's own clock (``time.perf_counter``, microseconds): ``prepare``,
``agree`` with the ``wait`` inside it (blocked in the allreduce until the
other ranks arrive), ``destroy``, ``visit`` (derived families, whose own
sync points nest in it), ``release``, ``check``, ``finish`` (participants),
``report``. Before all that, as the sync point begins, an instant event
"sync point began" (family, number, rank): a rank that hangs in a sync
point, and is then killed, keeps it, where the end is never written, and
the summary names the sync point each rank hung in (:func:`unfinished`).
The file is written as the run goes, two writes per sync point, and is a
complete JSON array after every write: a crash or a kill leaves every
finished sync point readable. Nothing is held in memory.

Tracing is local (each rank decides for itself) and never raises inside a
sync point: a write that fails stops tracing on that rank, says so on
stderr once, and leaves the file valid up to the last whole sync point. Off,
a sync point reads one list item and runs as it would without this module
(the C steady state; ``bench/bench_trace.py`` measures both).

Clocks: ranks on different nodes do not share one, so nothing here compares
two ranks' times. "Last" is measured within one rank: in a sync point that
several ranks traced (same family label, same number), the rank that waited
least was the one the others waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpi4py import MPI

from . import _tracing
from ._tracing import Phases, set_tracer

__all__ = [
    "Trace",
    "start",
    "stop",
    "tracing",
    "active",
    "file_for",
    "files",
    "read",
    "Record",
    "records",
    "unfinished",
    "family_key",
    "keyed",
    "PHASES",
    "COLUMNS",
    "Missing",
    "RankSummary",
    "Summary",
    "summarize",
    "merge",
    "main",
]

#: The environment variable read at ``import collective_gc``.
ENV = "COLLECTIVE_GC_TRACE"

_US = 1e6  # perf_counter seconds -> trace-event microseconds
_END = b"\n]\n"  # what closes the array after every write


def file_for(path: str | os.PathLike[str], rank: int) -> Path:
    """The file of ``rank``'s trace under ``path`` (see the module docs)."""
    text = os.fspath(path)
    p = Path(text)
    if text.endswith(os.sep) or p.is_dir():
        return p / f"rank{rank}.json"
    if p.suffix == ".json":
        p = p.with_suffix("")
    return p.with_name(f"{p.name}.rank{rank}.json")


def files(path: str | os.PathLike[str]) -> list[Path]:
    """The per-rank files of the trace written under ``path``, by rank."""
    text = os.fspath(path)
    p = Path(text)
    if text.endswith(os.sep) or p.is_dir():
        found = list(p.glob("rank*.json"))
        pattern = re.compile(r"rank(\d+)\.json$")
    else:
        if p.suffix == ".json":
            p = p.with_suffix("")
        found = list(p.parent.glob(f"{_glob_escape(p.name)}.rank*.json"))
        pattern = re.compile(re.escape(p.name) + r"\.rank(\d+)\.json$")
    ranked = []
    for f in found:
        m = pattern.match(f.name)
        if m:
            ranked.append((int(m.group(1)), f))
    return [f for _, f in sorted(ranked)]


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


class Trace:
    """The tracer that writes this rank's trace file (what :func:`start`
    sets). ``error`` is what stopped it writing, if anything did."""

    def __init__(self, path: str | os.PathLike[str], rank: int, size: int) -> None:
        self.path = path
        self.rank = rank
        self.size = size
        self.file = file_for(path, rank)
        self.started = time.perf_counter()
        self.error: OSError | None = None
        self._fd: int | None = None
        self._opened = False
        self._end = 0  # where _END starts in the file
        self._lock = threading.Lock()
        self._threads: set[int] = set()
        self._names: dict[str, str] = {}  # label -> its JSON string
        # One prefix for every event of this rank (pid = the world rank, so
        # that merged files show one process per rank).
        self._pid = f'"cat":"collective_gc","ph":"X","pid":{rank},"tid":'

    def __repr__(self) -> str:
        state = (
            f"failed: {self.error}"
            if self.error
            else ("writing" if self._fd is not None else ("closed" if self._opened else "started"))
        )
        return f"<collective_gc.trace.Trace rank {self.rank} to {str(self.file)!r}, {state}>"

    # -- the Tracer protocol (collective_gc._tracing) ------------------------------

    def sync_point_began(self, family: str, rank: int, seq: int, start: float) -> None:
        """Append an instant event: the sync point began. Written as it
        begins (one more write per sync point while tracing): a run killed
        while it hangs there keeps it, where its end is never written."""
        fam = self._names.get(family) or self._name(family)
        self._write(
            f',\n{{"name":"sync point began","cat":"collective_gc","ph":"i","s":"t",'
            f'"pid":{self.rank},"tid":{threading.get_native_id()},"ts":{start * _US:.3f},'
            f'"args":{{"family":{fam},"seq":{seq},"rank":{rank}}}}}'
        )

    def sync_point(
        self,
        family: str,
        rank: int,
        seq: int,
        start: float,
        end: float,
        phases: Phases,
        destroyed: int,
        outcome: str,
    ) -> None:
        """Append one sync point and its phases (see the module docs). Runs
        inside the sync point: records only, never raises."""
        tid = threading.get_native_id()
        head = self._pid + str(tid)
        names = self._names
        fam = names.get(family) or self._name(family)
        out = names.get(outcome) or self._name(outcome)
        events = [
            f'{{"name":"sync point",{head},"ts":{start * _US:.3f},"dur":{(end - start) * _US:.3f},'
            f'"args":{{"family":{fam},"seq":{seq},"rank":{rank},"destroyed":{destroyed},'
            f'"outcome":{out}}}}}'
        ]
        for name, a, b in phases:
            phase = names.get(name) or self._name(name)
            events.append(f'{{"name":{phase},{head},"ts":{a * _US:.3f},"dur":{(b - a) * _US:.3f}}}')
        if tid not in self._threads:
            self._threads.add(tid)
            thread = json.dumps(threading.current_thread().name)
            events.append(
                f'{{"name":"thread_name","ph":"M","pid":{self.rank},"tid":{tid},'
                f'"args":{{"name":{thread}}}}}'
            )
        self._write(",\n" + ",\n".join(events))

    def _name(self, text: str) -> str:
        encoded = json.dumps(text)
        self._names[text] = encoded
        return encoded

    # -- the file -------------------------------------------------------------------

    def _open(self) -> None:
        """Make the file: its header, and the array closed. (At the first
        sync point: a process that runs none leaves no file, and does not
        truncate one it only reads.)"""
        self._opened = True
        self.file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd = fd
        info = json.dumps(
            {
                "world_rank": self.rank,
                "world_size": self.size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "clock": "time.perf_counter",
            }
        )
        r = self.rank
        head = (
            "[\n"
            f'{{"name":"process_name","ph":"M","pid":{r},"tid":0,"args":{{"name":"rank {r}"}}}},\n'
            f'{{"name":"process_sort_index","ph":"M","pid":{r},"tid":0,'
            f'"args":{{"sort_index":{r}}}}},\n'
            f'{{"name":"trace started","cat":"collective_gc","ph":"i","s":"p","pid":{r},"tid":0,'
            f'"ts":{self.started * _US:.3f},"args":{info}}}'
        ).encode()
        self._put(head + _END, 0)
        self._end = len(head)

    def _write(self, text: str) -> None:
        with self._lock:
            if self.error is not None or (self._opened and self._fd is None):
                return  # failed, or stopped while this sync point ran
            at = self._end
            try:
                if not self._opened:
                    self._open()
                    at = self._end
                data = text.encode()
                self._put(data + _END, at)
                self._end = at + len(data)
            except OSError as exc:
                self._failed(exc, at)

    def _put(self, data: bytes, at: int) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n

    def _failed(self, exc: OSError, at: int) -> None:
        """A write failed (a full disk, a file size limit): stop tracing on
        this rank, with the file cut back to its last whole sync point."""
        self.error = exc
        if _tracing.TRACER is self:
            set_tracer(None)
        if self._fd is not None:
            try:
                if at:
                    os.pwrite(self._fd, _END, at)  # it fitted before
                    os.ftruncate(self._fd, at + len(_END))
            except OSError:
                pass  # the disk refused again: read() takes the whole lines it has
            try:
                os.close(self._fd)
            except OSError:
                pass  # nothing more to save; the error reported below is the first one
            self._fd = None
        try:
            sys.stderr.write(
                f"collective_gc.trace: rank {self.rank} could not write its trace to "
                f"{self.file} ({exc}); tracing stopped on this rank, the file holds the sync "
                "points before\n"
            )
        except Exception:  # noqa: BLE001 (no stderr: the error stays in .error)
            pass

    def close(self) -> None:
        """Stop writing (the file stays a complete JSON array). Local."""
        with self._lock:
            self._opened = True
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)


# -- starting and stopping ----------------------------------------------------------


def _world() -> tuple[int, int]:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return 0, 1


def start(path: str | os.PathLike[str]) -> Trace:
    """Trace every sync point of this process to its file under ``path``
    (see the module docs) until :func:`stop`. Local: each rank starts its
    own trace (call it on every rank to see them all).

    Raises RuntimeError if a trace is already running in this process (stop
    it first), and OSError if ``path``'s directory cannot be made.
    """
    current = _tracing.TRACER
    if current is not None:
        where = current.file if isinstance(current, Trace) else current
        raise RuntimeError(
            f"collective_gc.trace.start: a tracer is already running ({where}); call stop() first"
        )
    rank, size = _world()
    trace = Trace(path, rank, size)
    trace.file.parent.mkdir(parents=True, exist_ok=True)
    set_tracer(trace)
    return trace


def stop() -> Trace | None:
    """Stop tracing in this process; the trace that ran, or None. The file
    is complete as it is. Local; a second call does nothing."""
    current = _tracing.TRACER
    if not isinstance(current, Trace):
        return None
    set_tracer(None)
    current.close()
    return current


def active() -> Trace | None:
    """The trace running in this process, or None."""
    current = _tracing.TRACER
    return current if isinstance(current, Trace) else None


@contextmanager
def tracing(path: str | os.PathLike[str]) -> Iterator[Trace]:
    """``with tracing(path):`` :func:`start` on entry, :func:`stop` on exit."""
    trace = start(path)
    try:
        yield trace
    finally:
        if _tracing.TRACER is trace:
            stop()
        else:
            trace.close()


def start_from_environment() -> Trace | None:
    """:func:`start` at ``COLLECTIVE_GC_TRACE`` if it is set (what ``import
    collective_gc`` calls); a trace already running is left alone."""
    path = os.environ.get(ENV, "")
    if not path or _tracing.TRACER is not None:
        return None
    return start(path)


def _after_fork_in_child() -> None:
    # A forked child shares the parent's file descriptor: it must not write
    # into the parent's trace.
    if isinstance(_tracing.TRACER, Trace):
        set_tracer(None)


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- reading ------------------------------------------------------------------------


def read(file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of one rank's file. A file cut short (a process killed in
    the middle of a write) loses only its last, partial line."""
    text = Path(file).read_text()
    try:
        events: list[dict[str, Any]] = json.loads(text)
        return events
    except json.JSONDecodeError:
        pass  # cut short: read it line by line below
    events = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith("{"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the partial line a kill left: nothing after it
    return events


@dataclass
class Record:
    """One sync point on one rank, as read from its file."""

    family: str
    seq: int
    rank: int  # in the family
    tid: int
    start: float  # seconds, this rank's clock
    end: float
    destroyed: int
    outcome: str
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase
    wait_end: float | None = None
    first: float | None = None  # when its first phase started
    nested: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def wait(self) -> float:
        return self.phases.get("wait", 0.0)


def records(events: Sequence[dict[str, Any]]) -> list[Record]:
    """The sync points of one rank's events, phases attached (each sync
    point's phases follow it in the file)."""
    out: list[Record] = []
    current: Record | None = None
    for e in events:
        if e.get("ph") != "X":
            continue
        ts, dur = e["ts"] / _US, e.get("dur", 0.0) / _US
        if e["name"] == "sync point":
            a = e.get("args", {})
            current = Record(
                str(a.get("family", "")),
                int(a.get("seq", -1)),
                int(a.get("rank", -1)),
                int(e.get("tid", 0)),
                ts,
                ts + dur,
                int(a.get("destroyed", 0)),
                str(a.get("outcome", "ok")),
            )
            out.append(current)
        elif current is not None:
            name = str(e["name"])
            current.phases[name] = current.phases.get(name, 0.0) + dur
            if current.first is None or ts < current.first:
                current.first = ts
            if name == "wait":
                current.wait_end = ts + dur
    # A derived family's sync point runs inside its parent's (in "visit"),
    # on the same thread: its time is the parent's already.
    for tid in {r.tid for r in out}:
        top: Record | None = None
        for r in sorted((r for r in out if r.tid == tid), key=lambda r: (r.start, -r.end)):
            if top is not None and r.start >= top.start and r.end <= top.end:
                r.nested = True
            else:
                top = r
    return out


def unfinished(events: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """The sync points of one rank's events that began and never ended
    (family label, number): where it hung, or was killed, or cut short."""
    open_: dict[tuple[str, int, int], None] = {}
    for e in events:
        name = e.get("name")
        if name == "sync point began":
            a = e.get("args", {})
            open_[(str(a.get("family", "")), int(a.get("seq", -1)), int(e.get("tid", 0)))] = None
        elif name == "sync point" and e.get("ph") == "X":
            a = e.get("args", {})
            open_.pop((str(a.get("family", "")), int(a.get("seq", -1)), int(e.get("tid", 0))), None)
    return [(fam, seq) for fam, seq, _ in open_]


_RANK_IN_LABEL = re.compile(r"\s*\(rank \d+\)$")


def family_key(label: str) -> str:
    """What names a family alike on all its ranks: its label without the
    rank (``"communicator of size 4 (rank 2)"`` -> ``"communicator of size 4"``)."""
    return _RANK_IN_LABEL.sub("", label)


def keyed(recs: Sequence[Record]) -> Iterator[tuple[tuple[str, int, int], Record]]:
    """Each of one rank's sync points with what matches it on the other
    ranks: its family's label without the rank, its number, and which
    occurrence of that pair it is on this rank (two families under one label
    each count their own sync points; the program runs them in one order on
    every rank)."""
    seen: Counter[tuple[str, int]] = Counter()
    for rec in recs:
        pair = (family_key(rec.family), rec.seq)
        yield pair + (seen[pair],), rec
        seen[pair] += 1


def _start_info(events: Sequence[dict[str, Any]]) -> tuple[float | None, dict[str, Any]]:
    for e in events:
        if e.get("name") == "trace started":
            return e["ts"] / _US, dict(e.get("args", {}))
    return None, {}


# -- the summary --------------------------------------------------------------------

#: The phases, in the order a sync point runs them (``wait`` is inside ``agree``).
PHASES = ("prepare", "agree", "wait", "destroy", "visit", "release", "check", "finish", "report")

#: The summary's columns: the phases, what came before them ("collect": the
#: garbage collection ``cgc.collect`` and a scope's exit run first, and
#: taking the family's lock) and the rest ("other": between and after them).
COLUMNS = ("collect",) + PHASES + ("other",)


@dataclass
class RankSummary:
    """One rank's sync points (seconds in its own clock)."""

    rank: int
    host: str
    sync_points: int  # its own (a derived family's, nested in a parent's, not counted)
    nested: int  # derived families' sync points, inside those
    seconds: float  # in sync points
    waiting: float  # blocked in agreements until the other ranks arrived (nested ones too)
    traced: float  # from the start of the trace to the end of its last sync point
    phases: dict[str, float]  # seconds by phase, disjoint: "agree" without its "wait", etc.
    destroyed: int
    failed: int  # sync points that raised
    last: int = 0  # matched sync points in which this rank was the one waited for
    matched: int = 0  # sync points matched across ranks that this rank took part in
    wait_series: list[tuple[float, float]] = field(default_factory=list)  # (since start, wait)
    failures: list[Record] = field(default_factory=list)  # its sync points that raised

    @property
    def wait_share(self) -> float:
        return self.waiting / self.seconds if self.seconds else 0.0


@dataclass
class Missing:
    """A sync point that some ranks ended and others have no record of: on
    those it never began, was still running (a hang), or was not traced."""

    family: str  # its label, without the rank
    seq: int
    ended: dict[int, str]  # world rank -> how it ended there ("ok", or what it raised)
    absent: list[int]  # world ranks that traced the family from before, without it
    began: list[int] = field(default_factory=list)  # world ranks where it began, never ended


@dataclass
class Summary:
    """Every rank's :class:`RankSummary`, how often each one was last, and
    the sync points some ranks never ended."""

    ranks: list[RankSummary]
    matched: int  # sync points found on two ranks or more, and matched
    ambiguous: int  # sync points two families of one label shared (not matched)
    last: Counter[int]  # world rank -> sync points in which it was last
    missing: list[Missing] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # about the files themselves

    def text(self) -> str:
        """The summary as ``python -m collective_gc.trace`` prints it."""
        lines = [
            "            sync   in sync points    waiting for others   last to arrive",
            "rank      points      ms   of run          ms    share      in   of matched  destroys",
        ]
        for r in self.ranks:
            run = f"{r.seconds / r.traced:8.1%}" if r.traced > 0 else " " * 8
            lines.append(
                f"{r.rank:4d}  {r.sync_points:10d} {r.seconds * 1e3:7.1f} {run}  "
                f"{r.waiting * 1e3:10.1f}  {r.wait_share:7.1%}  {r.last:6d}  {r.matched:11d}"
                f"  {r.destroyed:8d}"
            )
        lines.append("")
        if self.last:
            (rank, n), *_ = self.last.most_common(1)
            lines.append(
                f"last most often: rank {rank}, in {n} of {self.matched} sync points matched "
                f"across ranks ({n / self.matched:.0%}); the others waited for it there"
            )
        elif len(self.ranks) > 1:
            lines.append("no sync point was matched across ranks")
        lines.extend(f"note: {note}" for note in self.notes)
        if self.ambiguous:
            lines.append(
                f"{self.ambiguous} sync point(s) not matched: two families with the same label "
                "(communicators of one size over different ranks) ran them"
            )
        nested = sum(r.nested for r in self.ranks)
        if nested:
            lines.append(
                f"{nested} sync point(s) of derived families ran inside their parents' (in "
                "'visit'); their waits count as waiting"
            )
        for r in self.ranks:
            for rec in r.failures[:3]:
                lines.append(
                    f"rank {r.rank}: sync point {rec.seq} of the {family_key(rec.family)} raised "
                    f"{rec.outcome} after {rec.seconds:.3g} s ({rec.wait:.3g} s waiting)"
                )
            if r.failed > 3:
                lines.append(f"rank {r.rank}: and {r.failed - 3} more sync point(s) raised")
        if self.missing:
            lines.append("sync points that some ranks never ended (a hang, a crash, or a rank")
            lines.append("that never came; the absent rank is the one to look at):")
            for m in self.missing[:5]:
                how = sorted(set(m.ended.values()))
                parts = []
                if m.ended:
                    ended = ", ".join(map(str, sorted(m.ended)))
                    parts.append(f"ended on rank(s) {ended} ({', '.join(how)})")
                if m.began:
                    parts.append(f"began and never ended on rank(s) {', '.join(map(str, m.began))}")
                if m.absent:
                    parts.append(f"no record on rank(s) {', '.join(map(str, m.absent))}")
                lines.append(f"  sync point {m.seq} of the {m.family}: " + "; ".join(parts))
            if len(self.missing) > 5:
                lines.append(f"  and {len(self.missing) - 5} more")
        if self.ranks:
            lines.append("")
            lines.append("time by phase (ms; agree without its wait):")
            names = [p for p in COLUMNS if any(r.phases.get(p) for r in self.ranks)]
            lines.append("rank  " + "".join(f"{p:>10}" for p in names))
            for r in self.ranks:
                lines.append(
                    f"{r.rank:4d}  " + "".join(f"{r.phases.get(p, 0.0) * 1e3:10.2f}" for p in names)
                )
        return "\n".join(lines)

    def plot(self, out: str | os.PathLike[str]) -> None:
        """Draw the summary into ``out`` (a PNG, or what matplotlib makes of
        its suffix): time by phase per rank, how often each rank was last,
        and each rank's waits over its run. Needs matplotlib."""
        import matplotlib  # type: ignore[import-untyped, import-not-found, unused-ignore]

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # type: ignore[import-untyped, import-not-found, unused-ignore]

        fig, (ax1, ax2, ax3) = plt.subplots(
            1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1.3, 0.7, 1.4]}
        )
        ranks = [r.rank for r in self.ranks]
        names = [p for p in COLUMNS if any(r.phases.get(p) for r in self.ranks)]
        left = [0.0] * len(ranks)
        for p in names:
            widths = [r.phases.get(p, 0.0) * 1e3 for r in self.ranks]
            label = "waiting for others" if p == "wait" else p
            ax1.barh(ranks, widths, left=left, label=label, color=_COLORS[p])
            left = [a + b for a, b in zip(left, widths)]
        for y, end, r in zip(ranks, left, self.ranks):
            ax1.text(end, y, f" {r.wait_share:.0%} waiting", va="center", fontsize="small")
        ax1.set_yticks(ranks, [f"rank {r}" for r in ranks])
        ax1.invert_yaxis()
        ax1.set_xlabel("time in sync points (ms)")
        ax1.set_xlim(0, max(left + [1e-3]) * 1.3)
        ax1.set_title("where each rank's sync time went")
        ax1.legend(
            fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False
        )

        ax2.bar(ranks, [self.last.get(r, 0) for r in ranks], color=_COLORS["wait"])
        ax2.set_xticks(ranks, [str(r) for r in ranks])
        ax2.set_xlabel("rank")
        ax2.set_ylabel("sync points")
        ax2.set_title(f"last to arrive (of {self.matched} matched)")

        for r in self.ranks:
            if r.wait_series:
                xs, ys = zip(*r.wait_series)
                ax3.plot(xs, [y * 1e3 for y in ys], ".", ms=3, label=f"rank {r.rank}")
        ax3.set_xlabel("seconds since the trace started (each rank's own clock)")
        ax3.set_ylabel("wait in the agreement (ms)")
        ax3.set_title("waiting for the others, sync point by sync point")
        if any(r.wait_series for r in self.ranks):
            ax3.legend(fontsize="small", markerscale=3)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        plt.close(fig)


# The plot's colours: waiting red, the agreement's own work pink, destroys
# blue, participants green, the rest in greys and muted tones.
_COLORS = {
    "collect": "#bcbd22",
    "prepare": "#c7c7c7",
    "agree": "#ff9896",
    "wait": "#d62728",
    "destroy": "#1f77b4",
    "visit": "#9467bd",
    "release": "#aec7e8",
    "check": "#17becf",
    "finish": "#2ca02c",
    "report": "#ff7f0e",
    "other": "#7f7f7f",
}


def summarize(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Summary:
    """The :class:`Summary` of a trace: ``paths`` is what the trace was
    started with (every rank's file under it), or a list of files."""
    found = _expand(paths)
    per_rank: list[tuple[int, str, float | None, list[Record]]] = []
    sizes: set[int] = set()
    hung: dict[tuple[str, int], list[int]] = defaultdict(list)  # began, never ended: ranks
    for n, f in enumerate(found):
        events = read(f)
        started, info = _start_info(events)
        rank = int(info.get("world_rank", n))
        sizes.add(int(info.get("world_size", 0)))
        per_rank.append((rank, str(info.get("host", "")), started, records(events)))
        for fam, seq in unfinished(events):
            hung[(family_key(fam), seq)].append(rank)
    per_rank.sort(key=lambda t: t[0])
    notes = []
    sizes.discard(0)  # a file without its header says nothing
    if len(sizes) > 1 or (sizes and len(per_rank) > max(sizes)):
        # A directory traced into twice, by jobs of different sizes.
        notes.append(
            f"these {len(per_rank)} files come from jobs of {sorted(sizes)} ranks: "
            "files of an earlier run may be among them"
        )

    # Match sync points across ranks (see keyed).
    groups: dict[tuple[str, int, int], list[tuple[int, Record]]] = defaultdict(list)
    for rank, _, _, recs in per_rank:
        for key, rec in keyed(recs):
            groups[key].append((rank, rec))
    last: Counter[int] = Counter()
    took_part: Counter[int] = Counter()
    matched = ambiguous = 0
    unclear: set[str] = set()  # families whose sync points cannot be told apart
    for (fam, _, _), members in groups.items():
        if len({rec.rank for _, rec in members}) < len(members):
            unclear.add(fam)  # one family rank twice: two families under one label
            if all(rec.wait_end is not None for _, rec in members):
                ambiguous += 1
            continue
        if len(members) < 2 or any(rec.wait_end is None for _, rec in members):
            continue
        matched += 1
        slowest = min(members, key=lambda m: m[1].wait)[0]
        last[slowest] += 1
        for rank, _ in members:
            took_part[rank] += 1

    # The ranks that traced a family from its sync point ``lowest`` on: a
    # sync point of it after that which one of them lacks is missing there.
    lowest: dict[str, dict[int, int]] = defaultdict(dict)
    for rank, _, _, recs in per_rank:
        for rec in recs:
            mine = lowest[family_key(rec.family)]
            mine[rank] = min(mine.get(rank, rec.seq), rec.seq)
    for fam, seq in hung:  # a family some rank only began a sync point of
        lowest[fam].update({r: seq for r in hung[(fam, seq)] if r not in lowest[fam]})
    missing = []
    for (fam, seq, _), members in groups.items():
        if fam in unclear:
            continue
        present = {rank for rank, _ in members}
        began = sorted(hung.pop((fam, seq), []))
        absent = sorted(
            r for r, lo in lowest[fam].items() if r not in present and r not in began and lo <= seq
        )
        if absent or began:
            ended = {rank: rec.outcome for rank, rec in members}
            missing.append(Missing(fam, seq, ended, absent, began))
    for (fam, seq), began in hung.items():  # ended nowhere: every rank there hung, or never came
        if fam in unclear:
            continue
        absent = sorted(r for r, lo in lowest[fam].items() if r not in began and lo <= seq)
        missing.append(Missing(fam, seq, {}, absent, sorted(began)))
    missing.sort(key=lambda m: (m.seq, m.family))

    out = []
    for rank, host, started, recs in per_rank:
        top = [r for r in recs if not r.nested]
        phases: dict[str, float] = defaultdict(float)
        for r in top:
            for p, s in r.phases.items():
                phases[p] += s
            if r.first is not None:
                phases["collect"] += r.first - r.start
        seconds = sum(r.seconds for r in top)
        waiting = sum(r.wait for r in recs)
        nested_wait = waiting - phases.get("wait", 0.0)
        phases["agree"] = phases.get("agree", 0.0) - phases.get("wait", 0.0)
        phases["wait"] = waiting
        if nested_wait:
            phases["visit"] = phases.get("visit", 0.0) - nested_wait
        phases["other"] = max(0.0, seconds - sum(phases.values()))
        origin = started if started is not None else (recs[0].start if recs else 0.0)
        traced = (max(r.end for r in recs) - origin) if recs else 0.0
        out.append(
            RankSummary(
                rank,
                host,
                len(top),
                len(recs) - len(top),
                seconds,
                waiting,
                traced,
                {p: s for p, s in phases.items() if s > 0},
                sum(r.destroyed for r in recs),
                sum(r.outcome != "ok" for r in recs),
                last.get(rank, 0),
                took_part.get(rank, 0),
                [(r.start - origin, r.wait) for r in recs if r.wait_end is not None],
                [r for r in recs if r.outcome != "ok"],
            )
        )
    return Summary(out, matched, ambiguous, last, missing, notes)


def _expand(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    for p in paths:
        if Path(p).is_file():
            found.append(Path(p))
        else:
            found.extend(files(p))
    if not found:
        raise FileNotFoundError(f"no trace files under {', '.join(str(p) for p in paths)}")
    return found


def merge(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
) -> dict[int, float]:
    """Write every rank's events into one file ``out`` (Perfetto opens one
    file at a time), each rank's times shifted onto the first rank's clock;
    the shifts in seconds, by rank.

    Ranks on different nodes have unrelated clocks, so the shift is
    estimated: an agreement's allreduce completes on every rank at about the
    same moment, so the median difference between two ranks' ends of ``wait``
    in the same sync points is the difference of their clocks (to within
    that skew, tens of microseconds on one node)."""
    found = _expand(paths)
    loaded = []
    for n, f in enumerate(found):
        events = read(f)
        _, info = _start_info(events)
        loaded.append((int(info.get("world_rank", n)), events, records(events)))
    loaded.sort(key=lambda t: t[0])
    ends = {
        rank: {key: rec.wait_end for key, rec in keyed(recs) if rec.wait_end is not None}
        for rank, _, recs in loaded
    }
    shifts: dict[int, float] = {}
    base = ends[loaded[0][0]] if loaded else {}
    for rank, _, _ in loaded:
        common = [base[k] - t for k, t in ends[rank].items() if k in base]
        shifts[rank] = statistics.median(common) if common else 0.0
    with open(out, "w") as merged:
        merged.write("[\n")
        first = True
        for rank, events, _ in loaded:
            shift = shifts[rank] * _US
            for e in events:
                if "ts" in e:
                    e = dict(e, ts=round(e["ts"] + shift, 3))
                merged.write(("" if first else ",\n") + json.dumps(e, separators=(",", ":")))
                first = False
        merged.write("\n]\n")
    return shifts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m collective_gc.trace PATH... [--plot OUT] [--merge OUT]``."""
    parser = argparse.ArgumentParser(
        prog="python -m collective_gc.trace",
        description="Summarize a collective_gc trace: per rank, the time in sync points, "
        "the share spent waiting for the other ranks, and which rank was last most often.",
    )
    parser.add_argument(
        "paths", nargs="+", help="what the trace was started with (COLLECTIVE_GC_TRACE), or files"
    )
    parser.add_argument("--plot", metavar="OUT", help="draw the summary into OUT (a PNG)")
    parser.add_argument(
        "--merge", metavar="OUT", help="write every rank's events into one file for Perfetto"
    )
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.paths)
    except (OSError, ValueError) as exc:
        print(f"collective_gc.trace: {exc}", file=sys.stderr)
        return 1
    print(summary.text())
    if args.plot:
        try:
            summary.plot(args.plot)
        except ImportError as exc:
            print(f"collective_gc.trace: --plot needs matplotlib ({exc})", file=sys.stderr)
            return 1
        print(f"\nplot: {args.plot}")
    if args.merge:
        shifts = merge(args.paths, args.merge)
        moved = ", ".join(f"rank {r} {s * 1e3:+.3f} ms" for r, s in shifts.items())
        print(f"merged: {args.merge} (clocks shifted onto rank {min(shifts)}'s: {moved})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
