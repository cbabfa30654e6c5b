"""Whole 4-rank jobs started with mpiexec: behaviour at exit.

These start their own ``mpiexec``, so they run from the serial session only.
"""

from __future__ import annotations

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
