"""Whole 4-rank jobs started with mpiexec: behaviour at exit, deadlines that bound every
wait, the exit agreements, calls after MPI_Finalize.

These start their own ``mpiexec``, so they run from the serial session only.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import mpiexec_cmd, mpiexec_env

SCRIPTS = Path(__file__).parent / "scripts"


pytestmark = pytest.mark.launcher


def mpiexec(
    script: str, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    e = mpiexec_env()
    e.update(env)
    return subprocess.run(
        [*mpiexec_cmd(4, timeout), sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        env=e,
    )


def test_exit_runs_pending_collective_destroys(tmp_path: Path) -> None:
    proc = mpiexec("exit_pending.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for rank in range(4):
        mine = [int(x) for x in (tmp_path / f"rank{rank}.txt").read_text().split()]
        # Every dropped object is destroyed at exit (the cycles too, after the
        # exit's gc.collect), newest first; the one alive at exit is not.
        assert mine == list(range(18, -1, -1)), (rank, mine, proc.stderr)
    assert "Warning" not in proc.stderr


def test_rank_dying_at_exit_does_not_hang_the_others() -> None:
    t0 = time.monotonic()
    proc = mpiexec("early_exit.py", timeout=90, COLLECTIVE_GC_EXIT_TIMEOUT="1.5")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank failed mid-loop" in proc.stderr
    # The failed rank leaked its pending destroy after its deadline instead of
    # waiting for the others; the others timed out in their own sync point.
    assert "ExitLeakWarning" in proc.stderr or "CollectiveTimeoutError" in proc.stderr, proc.stderr
    assert elapsed < 60, elapsed


_BARRIERS = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
for _ in range(2000):
    comm.Barrier()
print(f"rank {comm.Get_rank()} of {comm.Get_size()}")
"""


def test_four_ranks_yield_when_idle() -> None:
    # 4 ranks on 2 cores: without oversubscription the job does not start, and
    # without yield-when-idle (Open MPI) busy polling makes 2,000 barriers take
    # tens of seconds instead of a fraction of one.
    t0 = time.monotonic()
    proc = subprocess.run(
        [*mpiexec_cmd(4, 60), sys.executable, "-c", _BARRIERS],
        capture_output=True,
        text=True,
        timeout=90,
        env=mpiexec_env(),
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    # hydra may splice the ranks' lines together: find them, not split them.
    assert sorted(re.findall(r"rank (\d) of 4", proc.stdout)) == ["0", "1", "2", "3"], proc.stdout
    assert elapsed < 20, elapsed


def test_timeout_ends_a_hung_job() -> None:
    # The last net under every 4-rank run: each MPI spells the job timeout
    # differently (MPICH's hydra has no --timeout option).
    t0 = time.monotonic()
    proc = subprocess.run(
        [*mpiexec_cmd(2, 3), sys.executable, "-c", "import time; time.sleep(120)"],
        capture_output=True,
        text=True,
        timeout=90,
        env=mpiexec_env(),
    )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 30


JOBS = Path(__file__).parent / "jobs"


def run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = mpiexec_env()
    e.update(env)
    return subprocess.run(
        [*mpiexec_cmd(4, 90), sys.executable, "-m", "mpi4py", str(JOBS / script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=e,
    )


def outcomes(out: str, phase: str) -> dict[int, tuple[str, float]]:
    # Not line by line: mpiexec may splice two ranks' lines into one.
    found = re.findall(rf"{phase} (\d) (TIMEOUT|UNUSABLE|OK) (\d+\.\d)", out)
    return {int(r): (o, float(t)) for r, o, t in found}


def test_deadlines_bound_every_wait_and_no_late_rank_reports_ok() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    proc = run("deadlines.py")
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (a) The first use of a communicator, with rank 3 2.5 s late and a 1 s
    # timeout: every rank times out, the punctual ones after about 1 s.
    first = outcomes(out, "first-use")
    assert {r: o for r, (o, _) in first.items()} == dict.fromkeys(range(4), "TIMEOUT"), out
    assert all(t < 2.0 for r, (_, t) in first.items() if r != 3), first
    # (b) The late rank completes the others' abandoned header: it must not
    # report OK; and afterwards the manager is unusable on every rank.
    late = outcomes(out, "late-header")
    assert {r: o for r, (o, _) in late.items()} == dict.fromkeys(range(4), "TIMEOUT"), out
    after = outcomes(out, "after-late")
    assert {r: o for r, (o, _) in after.items()} == dict.fromkeys(range(4), "UNUSABLE"), out
    # (c) A timeout in a derived communicator's sync makes the parent unusable.
    child = outcomes(out, "child-timeout")
    assert {r: o for r, (o, _) in child.items()} == dict.fromkeys(range(4), "TIMEOUT"), out
    parent = outcomes(out, "parent-after")
    assert {r: o for r, (o, _) in parent.items()} == dict.fromkeys(range(4), "UNUSABLE"), out


def test_an_extra_sync_point_never_matches_the_exit_agreement() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    proc = run("extra_sync.py", COLLECTIVE_GC_EXIT_TIMEOUT="20")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    assert "extra sync point on rank 0: MISMATCH" in out, out + err
    assert "exit agreement" in out
    # The other ranks learn it at their exit agreement, each of them.
    for rank in (1, 2, 3):
        assert re.search(
            rf"ExitLeakWarning: collective_gc: at exit: rank {rank}: .*exit agreement", err
        ), err


def test_after_mpi_finalize_calls_raise_and_leaks_are_named() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    proc = run("finalized.py")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    for rank in range(4):
        for what in ("collect", "register"):
            assert f"{what} after finalize on rank {rank}: CollectiveGCError" in out, out + err
    assert "MPI is finalized" in out
    # What rank 0 had queued is named at exit; the other ranks had nothing.
    assert re.search(r"rank 0: leaked at exit \(MPI was finalized.*'res1'", err), err
    assert not re.search(r"rank [123]: leaked at exit", err), err


def test_destroy_pending_on_one_rank_at_exit_is_named() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    proc = run("exit_leak.py")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    for rank in range(4):
        assert f"destroyed everywhere on rank {rank}" in out, out
        assert f"destroyed only-on-rank-0 on rank {rank}" not in out, out
    assert re.search(r"ExitLeakWarning: .*rank 0: leaked at exit .*'only-on-rank-0'", err), err
    assert not re.search(r"rank [123]: leaked at exit", err), err


def test_exit_agreements_in_the_same_order_whatever_the_lookups() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    proc = run("exit_order.py", COLLECTIVE_GC_EXIT_TIMEOUT="20")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    for rank in range(4):
        assert f"destroyed a on rank {rank}" in out, out + err
        assert f"destroyed b on rank {rank}" in out, out + err
    assert "ExitLeakWarning" not in err, err


def test_an_abandoned_private_duplicate_does_not_crash_finalize() -> None:
    """Issue 11: the promise off the happy path, whole jobs."""
    for _ in range(3):
        proc = run("abandoned_dup.py")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("gave-up") == 1 and proc.stdout.count("finished") == 4
        assert "corrupted" not in proc.stderr, proc.stderr


def test_exit_destroys_what_was_dropped_after_a_kept_failure() -> None:
    """The exit agreement's first sync point only reports the failure an
    earlier sync point kept; the rounds go on and destroy the rest. Found by
    reading the deferred failure reports against the exit (seen failing at
    c4d420f: 'late' leaked at exit, said to be not queued on every rank)."""
    proc = run("exit_after_kept_failure.py")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out + err
    for rank in range(4):
        assert f"destroyed late on rank {rank}" in out, out + err
    assert re.search(r"ExitLeakWarning: collective_gc: at exit: .*raised at sync point", err), err
    assert "fails at the last sync point" in err, err
    assert "leaked at exit" not in err, err


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "10s"])
def test_exit_timeout_that_is_not_a_positive_number_is_a_usage_error(value: str) -> None:
    """Issue 41, section 3: ``COLLECTIVE_GC_EXIT_TIMEOUT=abc`` (or a negative
    value) fell back to 10 s without a word, as the pytest plugin's variables
    do not (they are usage errors). Now importing collective_gc fails, naming
    the variable, its value and what to set instead: before anything
    collective, on every rank alike, rather than at exit."""
    env = mpiexec_env()
    env["COLLECTIVE_GC_EXIT_TIMEOUT"] = value
    proc = subprocess.run(
        [sys.executable, "-c", "import collective_gc"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert (
        f"ValueError: COLLECTIVE_GC_EXIT_TIMEOUT={value!r} is not a positive number of seconds"
        in proc.stderr
    ), proc.stderr
    assert "unset it for the default of 10" in proc.stderr


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, 10.0), ("", 10.0), (" 2.5 ", 2.5), ("inf", float("inf"))]
)
def test_exit_timeout_reads_a_positive_number_or_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str | None, seconds: float
) -> None:
    """The values that work: unset or empty is the default, 10 s; ``inf``
    waits for ever; the variable is read again at each use, so a value the
    program sets after importing collective_gc counts."""
    from collective_gc._exit import exit_timeout

    if value is None:
        monkeypatch.delenv("COLLECTIVE_GC_EXIT_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("COLLECTIVE_GC_EXIT_TIMEOUT", value)
    assert exit_timeout() == seconds
