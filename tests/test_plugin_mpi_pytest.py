"""The pytest plugin's settings from the environment, and the plugin under
Firedrake's mpi-pytest (issue 22, item 5).

mpi-pytest's forking mode re-runs each parallel test as
``mpiexec ... pytest --runxfail -s -q file::test``: the parent's command line
never reaches the children, the ini file and the environment do. The first
tests run here, in this venv (pytest-mpi's). The mpi-pytest ones need a venv of
their own (both plugins install a top-level ``pytest_mpi``): ``make
test-plugin-mpipytest`` builds ``.venv-mpipytest`` and names its Python in
``CGC_MPIPYTEST_PYTHON``; without it they skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import mpiexec_env

HERE = Path(__file__).parent
MPIRUN = HERE.parent / "tools" / "mpirun"
MPI_PYTEST_PYTHON = os.environ.get("CGC_MPIPYTEST_PYTHON", "")
needs_mpi_pytest = pytest.mark.skipif(
    not MPI_PYTEST_PYTHON, reason="needs mpi-pytest's venv: make test-plugin-mpipytest"
)
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED) (suite_\S+)", re.M)


def run(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str]]]:
    full_env = mpiexec_env()
    full_env.pop("COLLECTIVE_GC_LEAK_CHECK", None)
    full_env.pop("COLLECTIVE_GC_TIMEOUT", None)
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=280, env=full_env)
    return proc, set(OUTCOME.findall(proc.stdout))


# -- settings from the environment, beside pytest-mpi ------------------------------


def serial_suite(
    env: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str]]]:
    cmd = [sys.executable, "-m", "pytest", "-rA", "--color=no", "-m", "not mpi", *args]
    return run(cmd, HERE / "plugin_suite", env)


@pytest.mark.launcher
def test_leak_check_from_the_environment() -> None:
    """COLLECTIVE_GC_LEAK_CHECK=1 turns the check on, as --cgc-leak-check does
    (what reaches mpi-pytest's forked children); 0 turns an ini's true off."""
    proc, outcomes = serial_suite({"COLLECTIVE_GC_LEAK_CHECK": "1"}, "suite_fail.py", "-k", "leak")
    out = proc.stdout + proc.stderr
    assert ("ERROR", "suite_fail.py::test_leaks") in outcomes, out
    assert "Resource 'leaky-solver'" in out, out
    proc, outcomes = serial_suite(
        {"COLLECTIVE_GC_LEAK_CHECK": "0"},
        "-o",
        "cgc_leak_check=true",
        "suite_fail.py",
        "-k",
        "leak",
    )
    out = proc.stdout + proc.stderr
    assert ("PASSED", "suite_fail.py::test_leaks") in outcomes, out
    # The marker still wins over the default, whatever set it.
    assert ("ERROR", "suite_fail.py::test_marked_leak") in outcomes, out


@pytest.mark.launcher
def test_bad_environment_values_are_usage_errors() -> None:
    proc, _ = serial_suite({"COLLECTIVE_GC_LEAK_CHECK": "maybe"}, "suite_pass.py")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "COLLECTIVE_GC_LEAK_CHECK='maybe'" in proc.stderr, proc.stderr
    proc, _ = serial_suite({"COLLECTIVE_GC_TIMEOUT": "soon"}, "suite_pass.py")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "COLLECTIVE_GC_TIMEOUT='soon'" in proc.stderr, proc.stderr


# -- under mpi-pytest, in its own venv ---------------------------------------------


def suite_copy(tmp_path: Path, ini_leak_check: bool) -> Path:
    """The Firedrake-style suite, with ``cgc_leak_check = true`` in its ini if asked."""
    dest = tmp_path / "suite"
    shutil.copytree(
        HERE / "plugin_suite_mpipytest", dest, ignore=shutil.ignore_patterns("__pycache__")
    )
    if ini_leak_check:
        with open(dest / "pytest.ini", "a") as ini:
            ini.write("cgc_leak_check = true\n")
    return dest


def non_forking(
    suite: Path, env: dict[str, str], *files: str
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str]]]:
    # As Firedrake's CI runs it: the whole session under mpiexec, selecting
    # the tests of that size.
    cmd = [str(MPIRUN), "4", "240", MPI_PYTEST_PYTHON, "-m", "mpi4py", "-m", "pytest"]
    cmd += ["-rA", "--color=no", "-m", "parallel[4]", *files]
    return run(cmd, suite, env)


def check_leak_reported(
    proc: subprocess.CompletedProcess[str], outcomes: set[tuple[str, str]]
) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "mpi-pytest-" in out, out  # really mpi-pytest's session
    assert ("ERROR", "suite_leak.py::test_leaks_a_solver") in outcomes, out
    assert "rank(s) 0, 1, 2, 3: Solver 'leaky-solver' (key " in out, out
    for test in (
        "suite_leak.py::test_after_the_leak",
        "suite_clean.py::test_solvers_in_cycles",
        "suite_clean.py::test_both_parallel_asserts",
        "suite_clean.py::test_command_line_exported_for_forked_children",
    ):
        assert ("PASSED", test) in outcomes, (test, out)
    bad = {t for o, t in outcomes if o in ("FAILED", "ERROR")}
    assert bad == {"suite_leak.py::test_leaks_a_solver"}, out


@needs_mpi_pytest
@pytest.mark.launcher
@pytest.mark.parametrize("how", ["environment", "ini", "command line"])
def test_non_forking_mode_reports_a_leak(tmp_path: Path, how: str) -> None:
    suite = suite_copy(tmp_path, ini_leak_check=how == "ini")
    env = {"COLLECTIVE_GC_LEAK_CHECK": "1"} if how == "environment" else {}
    option = ["--cgc-leak-check"] if how == "command line" else []
    proc, outcomes = non_forking(suite, env, *option, "suite_clean.py", "suite_leak.py")
    check_leak_reported(proc, outcomes)


@needs_mpi_pytest
@pytest.mark.launcher
def test_non_forking_mode_clean_suite_passes(tmp_path: Path) -> None:
    suite = suite_copy(tmp_path, ini_leak_check=True)
    proc, outcomes = non_forking(suite, {}, "suite_clean.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert ("PASSED", "suite_clean.py::test_solvers_in_cycles") in outcomes, out
