"""The randomized stress harness, on 20 seeds (``make stress`` runs 200+)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import mpiexec_env
from stress_harness import run_seed


@pytest.mark.mpi(min_size=2)
def test_twenty_seeds() -> None:
    world = MPI.COMM_WORLD
    for seed in range(20):
        out = run_seed(world, seed, n=60)
        assert out.errors == [], out.errors
        assert out.hangs == 0 and out.double == 0 and out.leaks == 0, out
        assert out.destroys == out.objects == 60 and out.order_ok


def test_one_seed_on_self() -> None:
    # COMM_SELF on every rank (serially too): no windows, which a singleton
    # Open MPI process cannot create.
    out = run_seed(MPI.COMM_SELF, 1234, n=60, kinds=("check", "comm", "vec"))
    assert (out.errors, out.hangs, out.double, out.leaks) == ([], 0, 0, 0)
    assert out.destroys == 60


@pytest.mark.launcher
def test_naive_version_deadlocks_and_the_harness_catches_it() -> None:
    harness = Path(__file__).parent / "stress_harness.py"
    proc = subprocess.run(
        [
            "mpiexec",
            "-n",
            "4",
            "--timeout",
            "60",
            sys.executable,
            "-m",
            "mpi4py",
            str(harness),
            "--naive",
            "--seeds",
            "3",
            "--deadline",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=mpiexec_env(),
    )
    assert proc.returncode != 0
    assert "HANG: rank" in proc.stderr, proc.stderr[-2000:]
