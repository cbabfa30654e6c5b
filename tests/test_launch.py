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
