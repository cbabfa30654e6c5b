"""Tracing sync points (``collective_gc.trace``): one Chrome trace-event file
per rank, its summary, and that a trace stopped leaves sync points their
steady state (what tracing costs, off and on: bench/bench_trace.py).

The files are real files, written by real sync points (serially and on 4
ranks of COMM_WORLD), read back as strict JSON; the summary's numbers are
checked against a job built to have a known answer (one rank arriving late
at every sync point); whole jobs (marker ``launcher``) check the environment
variable, a crash in the middle of a run, and a disk that fills up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import trace

from _util import JOB_HEAD, Obj, job_report, noop, run_job, script_env

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh directory every rank of the job sees (rank 0 makes it)."""
    made = tempfile.mkdtemp(prefix="cgc-trace-") if RANK == 0 else None
    path = Path(WORLD.bcast(made) if SIZE > 1 else made)  # type: ignore[arg-type]
    yield path
    if SIZE > 1:
        WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_trace_left() -> Iterator[None]:
    """Every test ends with tracing off, whatever it did."""
    assert trace.active() is None
    yield
    stopped = trace.stop()
    assert stopped is None, f"the test left {stopped!r} running"


def drop_and_sync(comm: MPI.Intracomm, n: int) -> cgc.CollectStats:
    """Register ``n`` objects that die at once, then a sync point."""
    for _ in range(n):
        cgc.register(Obj(), noop, comm=comm)
    return cgc.collect(comm, generation=None)


def sync_points(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each sync point event with the phase events that follow it."""
    out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for e in events:
        if e["ph"] != "X":
            continue
        if e["name"] == "sync point":
            out.append((e, []))
        else:
            out[-1][1].append(e)
    return out


# -- the files ----------------------------------------------------------------------


def test_every_sync_point_is_written_as_chrome_trace_events(
    comm: MPI.Intracomm, shared_dir: Path
) -> None:
    with trace.tracing(shared_dir / "run.json") as tr:
        assert trace.active() is tr
        for _ in range(5):
            assert drop_and_sync(comm, 3).destroyed == 3
    assert trace.active() is None
    file = shared_dir / f"run.rank{RANK}.json"
    assert tr.file == file
    events = json.loads(file.read_text())  # strict JSON: a complete array
    assert isinstance(events, list)
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys(), e
        assert e["pid"] == RANK  # one process per rank in a viewer
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["tid"], int), e
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {RANK}"}
    (started,) = [e for e in events if e["name"] == "trace started"]
    assert started["args"]["world_rank"] == RANK and started["args"]["world_size"] == SIZE

    points = sync_points(events)
    assert len(points) == 5
    seqs = [p["args"]["seq"] for p, _ in points]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    assert sum(p["args"]["destroyed"] for p, _ in points) == 15
    for point, phases in points:
        assert point["args"]["outcome"] == "ok"
        assert point["args"]["rank"] == comm.Get_rank()
        assert isinstance(point["args"]["family"], str) and point["args"]["family"]
        begin, end = point["ts"], point["ts"] + point["dur"]
        got = {ph["name"]: ph for ph in phases}
        assert set(got) <= set(trace.PHASES), got.keys()
        assert {"prepare", "agree", "destroy"} <= set(got)
        for ph in phases:
            assert begin <= ph["ts"] and ph["ts"] + ph["dur"] <= end, (point, ph)
        if SIZE > 1:  # the allreduce's wait, inside the agreement
            wait, agree = got["wait"], got["agree"]
            assert agree["ts"] <= wait["ts"]
            assert wait["ts"] + wait["dur"] <= agree["ts"] + agree["dur"]
        else:
            assert "wait" not in got  # nothing to wait for


def test_naming_of_the_files() -> None:
    assert trace.file_for("/x/trace", 3) == Path("/x/trace.rank3.json")
    assert trace.file_for("/x/trace.json", 3) == Path("/x/trace.rank3.json")
    assert trace.file_for("/x/trace/", 0) == Path("/x/trace/rank0.json")
    with tempfile.TemporaryDirectory() as d:
        assert trace.file_for(d, 12) == Path(d) / "rank12.json"  # an existing directory
        for r in (10, 2, 0):
            (Path(d) / f"rank{r}.json").write_text("[]")
            (Path(d) / f"t.rank{r}.json").write_text("[]")
        (Path(d) / "other.json").write_text("[]")
        assert [f.name for f in trace.files(d)] == ["rank0.json", "rank2.json", "rank10.json"]
        assert [f.name for f in trace.files(Path(d) / "t")] == [
            "t.rank0.json",
            "t.rank2.json",
            "t.rank10.json",
        ]
        with pytest.raises(FileNotFoundError, match="no trace files"):
            trace.summarize(Path(d) / "none")


def test_start_stop_and_the_context_manager_say_what_runs(shared_dir: Path) -> None:
    tr = trace.start(shared_dir / "a")
    try:
        with pytest.raises(RuntimeError, match=r"already running .*a\.rank\d+\.json.*stop\(\)"):
            trace.start(shared_dir / "b")
        assert trace.active() is tr
    finally:
        assert trace.stop() is tr
    assert trace.stop() is None  # a second stop does nothing
    # No sync point ran: no file (see the next test).
    assert not tr.file.exists()
    with pytest.raises(ZeroDivisionError):
        with trace.tracing(shared_dir / "c"):
            1 / 0  # noqa: B018
    assert trace.active() is None


def test_a_process_that_runs_no_sync_point_leaves_existing_files_alone(shared_dir: Path) -> None:
    """The summary runs ``import collective_gc``, which starts a trace when
    COLLECTIVE_GC_TRACE is still set in the shell: it must not truncate the
    files it is about to read. A file is made at the first sync point."""
    own = trace.file_for(shared_dir / "kept", RANK)
    own.write_text('[{"name":"x","ph":"M","pid":0}]')
    with trace.tracing(shared_dir / "kept"):
        pass
    assert json.loads(own.read_text()) == [{"name": "x", "ph": "M", "pid": 0}]


# Forking a process that has threads (MPI's, the reaper) is what this tests;
# Python 3.12+ warns of it.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_does_not_write_into_the_parents_trace(shared_dir: Path) -> None:
    with trace.tracing(shared_dir / "forked"):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(w, repr(trace.active()).encode())
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        seen = os.read(r, 200).decode()
        os.close(r)
        assert trace.active() is not None
    assert seen == "None"


def test_sync_points_on_several_threads_write_whole_events(shared_dir: Path) -> None:
    """Each thread's sync points on a communicator of its own (COMM_SELF's
    duplicates: no collective between threads), the threads switched as
    often as Python can: every sync point is in the file once, whole, under
    its thread."""
    comms = [MPI.COMM_SELF.Dup() for _ in range(3)]
    errors: list[BaseException] = []

    def worker(c: MPI.Intracomm) -> None:
        try:
            for _ in range(60):
                assert drop_and_sync(c, 1).destroyed == 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with trace.tracing(shared_dir / "threads") as tr:
            threads = [threading.Thread(target=worker, args=(c,)) for c in comms]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
        for c in comms:
            c.Free()
    assert not errors, errors
    events = json.loads(tr.file.read_text())
    points = [e for e in events if e["name"] == "sync point"]
    assert len(points) == 180
    by_thread: dict[int, list[int]] = {}
    for p in points:
        by_thread.setdefault(p["tid"], []).append(p["args"]["seq"])
    assert sorted(len(seqs) for seqs in by_thread.values()) == [60, 60, 60]
    assert all(seqs == list(range(seqs[0], seqs[0] + 60)) for seqs in by_thread.values())
    named = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert named == set(by_thread)
    for point, phases in sync_points(events):
        assert all(ph["tid"] == point["tid"] for ph in phases)


def test_a_file_cut_short_is_read_up_to_its_last_whole_sync_point(
    comm: MPI.Intracomm, shared_dir: Path
) -> None:
    """What a kill in the middle of a write would leave (the writer makes
    one write per sync point, so this is the worst case)."""
    with trace.tracing(shared_dir / "cut") as tr:
        for _ in range(4):
            drop_and_sync(comm, 2)
    whole = trace.read(tr.file)
    text = tr.file.read_text()
    cut = text[: text.rindex('{"name":"sync point"') + 40]  # in the middle of the 4th
    broken = shared_dir / f"broken{RANK}.json"
    broken.write_text(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    events = trace.read(broken)
    assert len(sync_points(events)) == 3
    assert events == whole[: len(events)]


def test_the_summary_says_when_files_of_another_run_are_mixed_in(
    comm: MPI.Intracomm, shared_dir: Path
) -> None:
    """A directory traced into by an 8-rank job, then by this one: the
    8-rank job's higher ranks are still there."""
    with trace.tracing(shared_dir):
        drop_and_sync(comm, 1)
    if SIZE > 1:
        WORLD.Barrier()
    if RANK == 0:
        old = trace.read(shared_dir / "rank0.json")
        for e in old:
            if e["name"] == "trace started":
                e["args"].update(world_rank=SIZE + 3, world_size=SIZE + 4)
        (shared_dir / f"rank{SIZE + 3}.json").write_text(json.dumps(old))
    if SIZE > 1:
        WORLD.Barrier()
    summary = trace.summarize(shared_dir)
    assert summary.notes == [
        f"these {SIZE + 1} files come from jobs of {sorted({SIZE, SIZE + 4})} ranks: "
        "files of an earlier run may be among them"
    ]
    assert f"note: these {SIZE + 1} files" in summary.text()


# -- the summary --------------------------------------------------------------------

LATE = 0.05  # seconds the late rank sleeps before each sync point


@pytest.mark.mpi(min_size=2)
def test_the_summary_names_the_rank_the_others_waited_for(
    comm: MPI.Intracomm, shared_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A constructed case with a known answer: one rank sleeps before each
    of 8 sync points, so it is the last to arrive at every one, and the
    others spend those sync points waiting for it."""
    late = SIZE - 2
    drop_and_sync(comm, 1)  # the family's first sync point, untraced
    with trace.tracing(shared_dir):
        for _ in range(8):
            if RANK == late:
                time.sleep(LATE)
            drop_and_sync(comm, 2)
    WORLD.Barrier()
    summary = trace.summarize(shared_dir)
    assert [r.rank for r in summary.ranks] == list(range(SIZE))
    assert summary.matched == 8 and summary.ambiguous == 0
    assert summary.last[late] == 8, summary.last
    for r in summary.ranks:
        assert r.sync_points == 8 and r.destroyed == 16 and r.failed == 0
        assert r.matched == 8
        assert r.waiting <= r.seconds <= r.traced
        assert abs(sum(r.phases.values()) - r.seconds) < 1e-6 * r.sync_points + 1e-9
        if r.rank == late:
            assert r.last == 8
            assert r.waiting < 8 * LATE / 2, r  # it hardly waited
        else:
            assert r.last == 0
            assert r.waiting > 8 * LATE * 0.8, r  # it waited for the late one
            assert r.wait_share > 0.5, r
    text = summary.text()
    assert f"last most often: rank {late}, in 8 of 8 sync points" in text
    if RANK == 0:
        capsys.readouterr()
        assert trace.main([str(shared_dir)]) == 0
        assert capsys.readouterr().out.strip() == text.strip()


@pytest.mark.mpi(min_size=2)
def test_merge_puts_every_rank_in_one_file_on_one_clock(
    comm: MPI.Intracomm, shared_dir: Path
) -> None:
    drop_and_sync(comm, 1)
    with trace.tracing(shared_dir):
        for _ in range(6):
            drop_and_sync(comm, 1)
    WORLD.Barrier()
    if RANK == 0:
        out = shared_dir / "merged.json"
        shifts = trace.merge(shared_dir, out)
        events = json.loads(out.read_text())
        assert {e["pid"] for e in events} == set(range(SIZE))
        assert len(sync_points([e for e in events if e["pid"] == 1])) == 6
        # One machine: one clock (CLOCK_MONOTONIC), so the estimated shifts
        # are the allreduce's completion skew, far below a sync point's time.
        assert set(shifts) == set(range(SIZE)) and shifts[0] == 0.0
        assert all(abs(s) < 0.05 for s in shifts.values()), shifts
    WORLD.Barrier()


def test_the_plot_is_drawn(comm: MPI.Intracomm, shared_dir: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    with trace.tracing(shared_dir):
        for _ in range(3):
            drop_and_sync(comm, 1)
    if SIZE > 1:
        WORLD.Barrier()
    if RANK == 0:
        out = shared_dir / "summary.png"
        trace.summarize(shared_dir).plot(out)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- what it costs off --------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_a_trace_stopped_leaves_sync_points_their_steady_state(
    comm: MPI.Intracomm, shared_dir: Path, outcomes: list[str]
) -> None:
    """Off (never started, or stopped), an empty sync point runs the steady
    state (one call, C where built), as it did before any trace; on, it
    takes the Python steps, which hand the tracer their phases. What that
    costs, off and on, is bench/bench_trace.py's (a timed assertion here
    would test the machine's load)."""
    drop_and_sync(comm, 1)

    def block(n: int = 5) -> list[str]:
        outcomes.clear()
        for _ in range(n):
            cgc.collect(comm, generation=None)
        return list(outcomes)

    assert block() == ["steady"] * 5
    for i in range(2):
        with trace.tracing(shared_dir / f"on{i}"):
            assert block() == []
            assert drop_and_sync(comm, 2).destroyed == 2
        assert trace.active() is None
        assert block() == ["steady"] * 5
    everyone_alike = comm.allgather(len(outcomes))
    assert everyone_alike == [5] * comm.Get_size()


# -- whole jobs ---------------------------------------------------------------------

_TRACED_JOB = (
    JOB_HEAD
    + """
import time
comm = MPI.COMM_WORLD
with cgc.collective_scope(comm) as scope:
    for step in range(10):
        objs = [Obj() for _ in range(3)]
        for o in objs:
            cgc.register(o, lambda: None, comm=comm)
        del objs, o
        if rank == 3:
            time.sleep(0.03)
        scope.sync()
print("traced to", cgc.trace.active().file)
"""
)


@pytest.mark.launcher
def test_the_environment_variable_traces_a_launched_job(tmp_path: Path) -> None:
    path = tmp_path / "trace"  # made by the job: a directory, as the "/" says
    proc, outs, errs, _ = run_job(tmp_path, _TRACED_JOB, COLLECTIVE_GC_TRACE=f"{path}/")
    report = job_report(proc, outs, errs)
    assert proc.returncode == 0, report
    for r in range(4):
        file = tmp_path / "trace" / f"rank{r}.json"
        assert f"traced to {file}" in outs[r], report
        points = sync_points(json.loads(file.read_text()))
        # The 10 of the loop, the scope's exit, and the exit agreement's:
        # what runs after atexit handlers are called is traced too.
        assert len(points) >= 12, (r, len(points))
        assert sum(p["args"]["destroyed"] for p, _ in points) == 30
    # The plot where matplotlib is (not on the PyPI stack legs: the plot's
    # own test skips there, and says so).
    out = tmp_path / "summary.png"
    plot = ["--plot", str(out)] if importlib.util.find_spec("matplotlib") else []
    cli = subprocess.run(
        [sys.executable, "-m", "collective_gc.trace", str(path), *plot],
        capture_output=True,
        text=True,
        timeout=120,
        env={**script_env(), "COLLECTIVE_GC_TRACE": str(path)},  # still set: harmless
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "last most often: rank 3" in cli.stdout, cli.stdout
    for r in range(4):
        assert any(line.split()[:1] == [str(r)] for line in cli.stdout.splitlines()), cli.stdout
        assert len(sync_points(json.loads((path / f"rank{r}.json").read_text()))) >= 12
    if plot:
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_CRASH_JOB = (
    JOB_HEAD
    + """
import signal
comm = MPI.COMM_WORLD
for step in range(6):
    if step == 5 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no flush, no stop()
    for _ in range(2):
        cgc.register(Obj(), lambda: None, comm=comm)
    cgc.collect(comm, generation=None)
    print("sync point", step, flush=True)
"""
)


@pytest.mark.launcher
def test_a_crash_in_the_middle_of_a_run_leaves_readable_files(tmp_path: Path) -> None:
    path = tmp_path / "crash"
    proc, outs, errs, _ = run_job(tmp_path, _CRASH_JOB, COLLECTIVE_GC_TRACE=str(path))
    report = job_report(proc, outs, errs)
    assert proc.returncode != 0, report  # the job died with its rank
    assert "sync point 4" in outs[1] and "sync point 5" not in outs[1], report
    for r in range(4):
        events = json.loads((tmp_path / f"crash.rank{r}.json").read_text())  # strict JSON
        points = sync_points(events)
        assert len(points) >= 5, (r, report)
        assert [p["args"]["seq"] for p, _ in points[:5]] == list(range(5))
    summary = trace.summarize(path)
    assert [r.sync_points for r in summary.ranks][1] == 5
    assert summary.matched == 5


_HANG_JOB = (
    JOB_HEAD
    + """
import time
comm = MPI.COMM_WORLD
for step in range(4):
    cgc.register(Obj(), lambda: None, comm=comm)
    cgc.collect(comm, generation=None)
if rank == 2:
    time.sleep(4)  # it never comes to the fifth: it is somewhere else, then gone
    os._exit(0)
try:
    cgc.collect(comm, generation=None, timeout=2)
except cgc.CollectiveTimeoutError:
    print("timed out", flush=True)
"""
)


@pytest.mark.launcher
def test_the_summary_names_the_rank_that_never_came(tmp_path: Path) -> None:
    """What a user of a hanging solver does: a timeout on the sync point,
    and the trace says which rank never reached it."""
    path = tmp_path / "hang"
    proc, outs, errs, _ = run_job(tmp_path, _HANG_JOB, COLLECTIVE_GC_TRACE=str(path))
    report = job_report(proc, outs, errs)
    for r in (0, 1, 3):
        assert "timed out" in outs[r], report
    summary = trace.summarize(path)
    assert [r.sync_points for r in summary.ranks] == [5, 5, 4, 5], report
    (missing,) = summary.missing
    assert missing.seq == 4 and missing.absent == [2]
    assert missing.ended == {r: "CollectiveTimeoutError" for r in (0, 1, 3)}
    for r in (0, 1, 3):
        (failed,) = summary.ranks[r].failures
        assert failed.seq == 4 and failed.wait >= 1.9, failed
    text = summary.text()
    assert f"sync point 4 of the {missing.family}: ended on rank(s) 0, 1, 3" in text, text
    assert "no record on rank(s) 2" in text, text


_FULL_DISK = """
import resource, signal, sys
import collective_gc as cgc
from collective_gc import trace
from mpi4py import MPI

class Obj:
    pass

comm = MPI.COMM_SELF.Dup()
tr = trace.start(sys.argv[1])
# Writes past 4 KiB fail with EFBIG, as on a full disk (SIGXFSZ ignored).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
destroyed = 0
for step in range(50):
    for _ in range(2):
        cgc.register(Obj(), lambda: None, comm=comm)
    destroyed += cgc.collect(comm, generation=None).destroyed
print("destroyed", destroyed, "active", trace.active(), "error", type(tr.error).__name__)
"""


@pytest.mark.launcher
def test_a_write_that_fails_stops_the_trace_not_the_sync_points(tmp_path: Path) -> None:
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=120,
        env=script_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "destroyed 100 active None error OSError" in proc.stdout, proc.stdout
    assert proc.stderr.count("tracing stopped on this rank") == 1, proc.stderr
    file = tmp_path / "t.rank0.json"
    assert file.stat().st_size <= 4096
    points = sync_points(json.loads(file.read_text()))  # cut back to a whole sync point
    assert 1 <= len(points) < 50
    assert [p["args"]["seq"] for p, _ in points] == list(range(len(points)))


# -- issue 39: the promise, round 5 ------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_two_families_of_one_size_have_two_ids_the_same_on_every_rank(
    comm: MPI.Intracomm, shared_dir: Path
) -> None:
    """Issue 39, item 8. Two families over the same processes (the test's
    communicator, and its processes in reverse order: not congruent, so a
    family of its own) take turns. What the trace says of each sync point's
    family must tell them apart, alike on every rank, since the summary and
    ``--merge`` pair the ranks' records by it: each family needs an id the
    same on every rank (today both are "communicator of size N")."""
    size = comm.Get_size()
    rev = comm.Split(0, size - comm.Get_rank())
    with trace.tracing(shared_dir / "two.json"):
        for _ in range(3):
            drop_and_sync(comm, 1)
            drop_and_sync(rev, 1)
    mine = [
        trace.family_key(r.family)
        for r in trace.records(trace.read(shared_dir / f"two.rank{RANK}.json"))
    ]
    seen = comm.allgather(mine)
    cgc.manager(rev).close()
    rev.Free()
    assert all(len(ids) == 6 and len(set(ids)) == 2 for ids in seen), seen
    assert all(ids == seen[0] for ids in seen), seen


_HUNG_JOB = (
    JOB_HEAD
    + """
import time
comm = MPI.COMM_WORLD
for step in range(4):
    cgc.register(Obj(), lambda: None, comm=comm)
    cgc.collect(comm, generation=None)
if rank == 2:
    time.sleep(3)  # the others hang in sync point 4 meanwhile, with no timeout
    comm.Abort(3)  # what a job's time limit does to them all
    # MPICH's MPI_Abort returns once it has asked its launcher to kill the
    # job: rank 2 must not go on into sync point 4 before the kill lands.
    time.sleep(60)
cgc.collect(comm, generation=None)
"""
)


@pytest.mark.launcher
def test_a_hung_run_s_trace_shows_the_sync_point_it_hangs_in(tmp_path: Path) -> None:
    """Issue 39, item 8. Ranks 0, 1 and 3 wait without a timeout in sync
    point 4, which rank 2 never reaches; the job is then killed (rank 2
    aborts it, as a time limit would). Their trace files must show that
    they were in sync point 4: its begin has to be written as it starts,
    not only with its end, which never comes."""
    path = tmp_path / "hung"
    proc, outs, errs, _ = run_job(tmp_path, _HUNG_JOB, COLLECTIVE_GC_TRACE=str(path))
    report = job_report(proc, outs, errs)
    assert proc.returncode != 0, report  # aborted
    for r in (0, 1, 3):
        events = trace.read(tmp_path / f"hung.rank{r}.json")
        assert [p["args"]["seq"] for p, _ in sync_points(events)][:4] == [0, 1, 2, 3], report
        hung = [e for e in events if e.get("args", {}).get("seq") == 4]
        assert [e["name"] for e in hung] == ["sync point began"], (r, events[-3:])
        assert [seq for _, seq in trace.unfinished(events)] == [4], (r, events[-3:])
    assert trace.unfinished(trace.read(tmp_path / "hung.rank2.json")) == [], report
    (missing,) = trace.summarize(path).missing
    assert (missing.seq, missing.began, missing.absent, missing.ended) == (4, [0, 1, 3], [2], {})
    text = trace.summarize(path).text()
    assert "began and never ended on rank(s) 0, 1, 3; no record on rank(s) 2" in text, text
