"""The loaders across ``os.fork()``: a training loop that forks a helper (an
asynchronous checkpoint writer) while its loader runs. The parent's loader must
deliver every element whatever the child does with its copy; the copy is inert
in the child (its ``next()`` raises a clear error); a loader the child makes
itself works; a child that leaves exits at once.

Launcher tests (they start worker processes and fork): serial session only.
Each case runs in a script of its own (``data_scripts/forker.py``), so that the
fork happens in a plain process, not in pytest's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launcher

SCRIPTS = os.path.join(os.path.dirname(__file__), "data_scripts")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "forker.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


CODES = {3: "the child's next() of the parent's loader did not raise a clear error",
         4: "the child hangs at exit",
         5: "the parent's loader lost elements",
         6: "a loader made in the child gave wrong elements",
         7: "a forked helper holds the loader's descriptors or memory",
         8: "a forked helper keeps the workers alive after close()"}  # fmt: skip


@pytest.mark.parametrize("probe", [False, True], ids=["", "probe"])
@pytest.mark.parametrize("how", ["exit", "close", "new"])
@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_forked_child_leaves_the_parents_loader_alone(kind: str, how: str, probe: bool) -> None:
    """Issue 24, defects 1 and 2. Before: a ProcessPrefetch child's ``close()``
    (``sys.exit`` through the ``with``, or ``close()`` then ``os._exit``) shut
    the shared socket down and the parent got WorkerError after ~14 of 200
    elements; the child's ``next()`` took the parent's elements; a
    ThreadPrefetch child hung for ever at exit on a lock of the producer
    thread, which does not exist in the child."""
    result = _run(kind, how, *(["probe"] if probe else []))
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        CODES.get(result.returncode, f"exit code {result.returncode}") + "\n" + result.stderr
    )


def test_a_forked_helper_pins_none_of_the_loaders_memory() -> None:
    """Issue 24, defect 7. Before: a helper process forked by the rank (one
    that never uses the loader) held every slot's and ring's memfd and mapping
    until it exited, even after the rank died. Now it holds only the segment
    of the element it has a copy of."""
    result = _run("process", "helper")
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        CODES.get(result.returncode, f"exit code {result.returncode}") + "\n" + result.stderr
    )
