"""The randomized stress harness with fault injection, on 20 seeds (``make stress`` runs 200).

Every seed runs the graph round (collective resources in random reference
graphs) and the fault episodes the seed draws (threads, interrupts in
destroys, meddling destroys, late ranks, freed communicators, signal storms,
sparse long-lived keys); see
``stress_harness.py`` and ``stress/``. A defect on any rank is reported on
every rank (the harness gathers them), so every rank fails the test together.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from _util import windows_fail
from conftest import mpiexec_cmd, mpiexec_env
from stress_harness import ALL_KINDS, Watchdog, check_seed

# Sync points that must complete get this long before they count as a hang.
HANG_TIMEOUT = 15.0


def _run(world: MPI.Intracomm, seeds: range, kinds: tuple[str, ...] = ALL_KINDS) -> list[str]:
    dog = Watchdog(120.0, world.Get_rank())
    ck = world.Dup()
    found: list[str] = []
    try:
        for seed in seeds:
            defects, _, res = check_seed(
                world,
                ck,
                seed,
                dog,
                objects=60,
                hang_timeout=HANG_TIMEOUT,
                kinds=kinds,
                big=False,  # make stress runs those (tens of seconds each)
            )
            found += [d.line(seed) for d in defects]
            assert res is not None and res.destroys == res.objects == 60 and res.order_ok, res
    finally:
        dog.disarm()
    ck.Free()
    return found


@pytest.mark.mpi(min_size=2)
def test_twenty_seeds_with_faults() -> None:
    kinds = ALL_KINDS
    if windows_fail(MPI.COMM_WORLD) is not None:
        # This MPI cannot create windows (Open MPI 4.1 with btl tcp,self):
        # the seeds run with the other resources.
        kinds = tuple(k for k in ALL_KINDS if k not in ("win", "derived"))
    found = _run(MPI.COMM_WORLD, range(20), kinds)
    assert found == [], "\n".join(found)


@pytest.mark.mpi(min_size=2)
def test_sparse_keys_reach_the_window_and_the_fallback() -> None:
    """The sparse episode alone (issue 25, defect 4's class: long-lived keys
    spread far wider than the agreement's window, each rank dropping at its
    own times), on seeds whose sizes send sync points through both the window
    and the fallback intersection: nothing found, and both paths certainly
    ran (so the episode still tests what it is for). Its report-scale class
    (~700k keys, which crashed the user-op fallback) is make stress's only."""
    world = MPI.COMM_WORLD
    dog = Watchdog(120.0, world.Get_rank())
    ck = world.Dup()
    found: list[str] = []
    paths: set[str] = set()
    try:
        for seed in (0, 5, 9):
            notes: dict[str, list[str]] = {}
            defects, _, _ = check_seed(
                world,
                ck,
                seed,
                dog,
                graph=False,
                hang_timeout=HANG_TIMEOUT,
                only=("sparse",),
                notes=notes,
                big=False,
            )
            found += [d.line(seed) for d in defects]
            paths.update(notes.get("sparse", ()))
    finally:
        dog.disarm()
    ck.Free()
    assert found == [], "\n".join(found)
    assert {"window", "fallback"} <= paths, paths


def test_two_seeds_on_self() -> None:
    # COMM_SELF on every rank (serially too): no windows, which a singleton
    # Open MPI process cannot create, and no late-rank episode.
    found = _run(MPI.COMM_SELF, range(1234, 1236), kinds=("check", "comm"))
    assert found == [], "\n".join(found)


@pytest.mark.launcher
def test_naive_version_deadlocks_and_the_harness_catches_it() -> None:
    harness = Path(__file__).parent / "stress_harness.py"
    proc = subprocess.run(
        [
            *mpiexec_cmd(4, 60),
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
