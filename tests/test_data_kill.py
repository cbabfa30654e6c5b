"""Workers die with their parent; a user's MPI script runs loaders under mpiexec.

Launcher tests: they start their own processes (and mpiexec), so they run from
the serial session only, one at a time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _util import process_alive, script_env
from conftest import mpiexec_cmd, mpiexec_env

pytestmark = pytest.mark.launcher

SCRIPTS = os.path.join(os.path.dirname(__file__), "data_scripts")


# A zombie is dead: only its parent (init, after reparenting) can reap it.
_alive = process_alive


def _shm() -> set[str]:
    # Ours never have a name at all (memfd); what a Python loader would leave
    # there has these (SharedMemory, multiprocessing's semaphores). Every MPI's
    # own segments, of other jobs running meanwhile too, are none of ours.
    return {n for n in os.listdir("/dev/shm") if n.startswith(PYTHON_SHM)}


PYTHON_SHM = ("psm_", "sem.mp-", "wnsm_", "collective_gc")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("mode", ["main", "busy", "thread"])
def test_workers_exit_when_the_parent_is_killed(mode: str, sig: int) -> None:
    shm_before = _shm()
    victim = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, "victim.py"), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=script_env(),
    )
    try:
        line = victim.stdout.readline() if victim.stdout else ""
        assert line.startswith("ready"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        victim.send_signal(sig)
        victim.wait(10)
        t0 = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        latency = time.monotonic() - t0
        survivors = [p for p in pids if _alive(p)]
    finally:
        victim.kill()
        victim.wait()
    assert not survivors, f"workers {survivors} outlived their parent"
    assert latency < 1.0
    assert _shm() <= shm_before


def test_a_users_mpi_script_under_mpiexec() -> None:
    # A spawn-context Pool in such a script brought the whole job down here
    # (mpiexec itself segfaulted); loader workers must not even initialize MPI.
    proc = subprocess.run(
        [*mpiexec_cmd(2, 120), sys.executable, os.path.join(SCRIPTS, "mpi_main.py")],
        capture_output=True,
        text=True,
        env=mpiexec_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mpiexec may splice the two ranks' lines together: find them, not split them.
    ranks = sorted(re.findall(r"rank (\d) of 2: 20 elements, total 40", proc.stdout))
    assert ranks == ["0", "1"], proc.stdout + proc.stderr
