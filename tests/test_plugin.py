"""The pytest plugin: parallel_assert in this process, and the leak check and
strict marker on a sample suite (tests/plugin_suite) run by a child pytest,
under ``mpiexec -n 4`` and serially.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from collective_gc.pytest_plugin import parallel_assert

from conftest import mpiexec_cmd, mpiexec_env

SUITE = Path(__file__).parent / "plugin_suite"


# -- parallel_assert, in this process -----------------------------------------------


class ParallelAssertTests:
    COMM: MPI.Intracomm

    def test_holds_everywhere(self, comm: MPI.Intracomm) -> None:
        parallel_assert(True, "never shown", comm=comm)
        parallel_assert(lambda: comm.Get_rank() >= 0, comm=comm)

    def test_fails_on_the_last_rank_only(self, comm: MPI.Intracomm) -> None:
        last = comm.Get_size() - 1
        rank = comm.Get_rank()
        with pytest.raises(AssertionError) as info:
            parallel_assert(rank != last, f"value {rank * 10} is wrong", comm=comm)
        # Every rank raises, and the message names the failing rank and its message.
        assert str(info.value) == (
            f"parallel assertion failed on rank(s) {last} of {comm.Get_size()}: "
            f"value {last * 10} is wrong"
        )

    def test_messages_are_lazy_and_per_rank(self, comm: MPI.Intracomm) -> None:
        formatted: list[int] = []

        def message() -> str:
            formatted.append(comm.Get_rank())
            return f"rank {comm.Get_rank()} says no"

        with pytest.raises(AssertionError) as info:
            parallel_assert(False, message, comm=comm)
        assert formatted == [comm.Get_rank()]  # formatted once, here
        text = str(info.value)
        if comm.Get_size() == 1:
            assert text == "parallel assertion failed on rank(s) 0 of 1: rank 0 says no"
        else:
            for r in range(comm.Get_size()):
                assert f"\n  rank {r}: rank {r} says no" in text
        formatted.clear()
        parallel_assert(True, message, comm=comm)
        assert formatted == []  # never formatted when it holds

    def test_condition_raising_on_one_rank_is_a_failure(self, comm: MPI.Intracomm) -> None:
        def check() -> bool:
            if comm.Get_rank() == 0:
                raise KeyError("missing")
            return True

        with pytest.raises(AssertionError, match=r"rank\(s\) 0 of .*raised KeyError: 'missing'"):
            parallel_assert(check, comm=comm)

    def test_a_raised_exception_whose_str_raises_is_still_a_failure_everywhere(
        self, comm: MPI.Intracomm
    ) -> None:
        # Formatting what the condition (or the message) raised must not
        # raise in turn: that rank would skip the collective.
        class Bad(Exception):
            def __str__(self) -> str:
                raise ValueError("no str")

        def check() -> bool:
            if comm.Get_rank() == 0:
                raise Bad()
            return True

        def message() -> str:
            raise Bad()

        with pytest.raises(AssertionError, match=r"rank\(s\) 0 of .*raised Bad \(whose str"):
            parallel_assert(check, comm=comm, timeout=30)
        with pytest.raises(AssertionError, match=r"formatting the message raised Bad \(whose"):
            parallel_assert(comm.Get_rank() != 0, message, comm=comm, timeout=30)
        with pytest.raises(AssertionError, match=r"rank\(s\) 0 of .*: 42"):
            parallel_assert(comm.Get_rank() != 0, lambda: 42, comm=comm, timeout=30)  # type: ignore[arg-type, return-value]


class TestParallelAssertSelf(ParallelAssertTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi(min_size=2)
class TestParallelAssertWorld(ParallelAssertTests):
    COMM = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_parallel_assert_timeout_when_a_rank_is_late(comm: MPI.Intracomm) -> None:
    last = comm.Get_size() - 1
    if comm.Get_rank() == last:
        time.sleep(1.0)  # late, past the others' deadline
        parallel_assert(True, comm=comm)  # still matches their abandoned allreduce
    else:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="did not hear from every rank"):
            parallel_assert(True, comm=comm, timeout=0.3)
        assert time.monotonic() - t0 < 0.9  # gave up at its deadline, not when the late rank came
    comm.Barrier()  # progresses the abandoned requests; the comm is usable again


# -- the plugin on a sample suite, in a child pytest ---------------------------------


def run_suite(
    *args: str, ranks: int
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str]]]:
    """Run the sample suite; return the process and its (outcome, test) summary lines."""
    pytest_args = ["-m", "pytest", "-p", "collective_gc.pytest_plugin", "-rA", "--color=no", *args]
    if ranks > 1:
        cmd = [*mpiexec_cmd(ranks, 120), sys.executable, "-m", "mpi4py"]
        cmd += [*pytest_args, "--with-mpi"]
    else:
        cmd = [sys.executable, *pytest_args]
    proc = subprocess.run(
        cmd, cwd=SUITE, capture_output=True, text=True, timeout=150, env=mpiexec_env()
    )
    outcomes = set(re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) (suite_\S+)", proc.stdout, re.M))
    return proc, outcomes


PASSING = [
    "suite_pass.py::test_dropped_objects_and_cycles",
    "suite_pass.py::test_module_fixture_again",
    "suite_pass.py::test_split_communicators",
    "suite_pass.py::test_self_and_rank_local",
    "suite_pass.py::test_explicit_destroy",
    "suite_pass.py::test_strict_without_cycles",
    "suite_fail.py::test_opted_out",
    "suite_fail.py::test_still_in_step_after_failures",
]


def check_failing_run(
    proc: subprocess.CompletedProcess[str], outcomes: set[tuple[str, str]], ranks: int
) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    everyone = ", ".join(str(r) for r in range(ranks))
    # The deliberate leak fails its test (at teardown), naming the object on every rank.
    assert ("ERROR", "suite_fail.py::test_leaks") in outcomes, out
    assert f"rank(s) {everyone}: Resource 'leaky-solver' (key " in out
    assert f"), alive, on a communicator of size {ranks}" in out
    assert ("ERROR", "suite_fail.py::test_marked_leak") in outcomes, out
    # Strict mode names the object that died in a cycle, and where it was registered.
    assert ("ERROR", "suite_fail.py::test_strict_cycle") in outcomes, out
    assert re.search(
        rf"rank\(s\) {everyone}: Resource 'cyclic-solver' \(key \d+\) .*suite_fail\.py:\d+", out
    )
    # parallel_assert fails on every rank, naming the last one.
    assert ("FAILED", "suite_fail.py::test_assert_on_last_rank") in outcomes, out
    assert (
        f"parallel assertion failed on rank(s) {ranks - 1} of {ranks}: bad value {10 * (ranks - 1)}"
        in out
    )
    # Nothing else failed, and the tests after the failures ran in step.
    expected_bad = {"suite_fail.py::test_leaks", "suite_fail.py::test_marked_leak"}
    expected_bad |= {"suite_fail.py::test_strict_cycle", "suite_fail.py::test_assert_on_last_rank"}
    if ranks > 1:
        assert ("PASSED", "suite_pass.py::test_lookups_in_different_orders") in outcomes, out
        # A registration on one rank only: reported, naming what was registered
        # where, within the checks' timeout, and the checks stay on (the leak
        # tests after it still fail).
        assert ("ERROR", "suite_fail.py::test_registered_on_one_rank_only") in outcomes, out
        assert "registered different numbers of objects" in out, out
        # (Ranks of that communicator, whose order is COMM_WORLD's reversed:
        # see suite_fail.py.)
        assert f"rank {ranks - 1} registered 2 ('everywhere', 'rank-0-only')" in out, out
        assert f"rank {ranks - 2} registered 1 ('everywhere')" in out, out
        assert "checks are off" not in out, out
        expected_bad.add("suite_fail.py::test_registered_on_one_rank_only")
    # Only known test ids: mpiexec may splice two ranks' lines into one.
    known = expected_bad | set(PASSING)
    bad = {t for o, t in outcomes if o in ("FAILED", "ERROR") and t in known}
    assert bad == expected_bad, out
    for test in PASSING:
        assert ("PASSED", test) in outcomes, (test, out)


@pytest.mark.launcher
def test_sample_suite_on_4_ranks() -> None:
    t0 = time.monotonic()
    proc, outcomes = run_suite("--cgc-leak-check", "suite_pass.py", "suite_fail.py", ranks=4)
    check_failing_run(proc, outcomes, 4)
    assert ("PASSED", "suite_pass.py::test_parallel_assert_beside_pytest_mpi") in outcomes
    # A rank's failure never left the others waiting (mpiexec's limit is 120 s).
    assert time.monotonic() - t0 < 60


@pytest.mark.launcher
def test_a_rank_late_for_the_checks_hears_that_the_others_gave_up() -> None:
    """The last rank reaches a test's checks 4 s late, the others give up
    after 1.5 s: it must fail at once, saying that a rank gave up (the
    checks' own communicator has the agreement's watch), not carry on alone
    and wait out its own timeout in a collective nobody else will join."""
    proc, outcomes = run_suite("--cgc-leak-check", "--cgc-timeout=1.5", "suite_late.py", ranks=4)
    out = proc.stdout + proc.stderr
    assert ("ERROR", "suite_late.py::test_last_rank_is_late") in outcomes, out
    assert re.search(r"rank 3 stopped waiting .*rank [0-2] gave up waiting at its deadline", out), (
        out
    )
    assert ("PASSED", "suite_late.py::test_after_it") in outcomes, out


@pytest.mark.launcher
def test_sample_suite_serially_with_the_ini_option() -> None:
    proc, outcomes = run_suite(
        "-o", "cgc_leak_check=true", "-m", "not mpi", "suite_pass.py", "suite_fail.py", ranks=1
    )
    check_failing_run(proc, outcomes, 1)


@pytest.mark.launcher
def test_without_the_option_only_marked_tests_are_checked() -> None:
    proc, outcomes = run_suite("suite_fail.py", "-k", "leak", ranks=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # Off by default: the unmarked leak passes; the marker turns the check on.
    assert ("PASSED", "suite_fail.py::test_leaks") in outcomes, out
    assert ("ERROR", "suite_fail.py::test_leaks") not in outcomes, out
    assert ("ERROR", "suite_fail.py::test_marked_leak") in outcomes, out
    assert "Resource 'marked-leak'" in out and "'leaky-solver'" not in out


# -- issue 39: the promise, round 5 ------------------------------------------------

CLOSING_BAD = [
    "suite_closing.py::test_closing_leak",
    "suite_closing.py::test_closing_marked_leak",
    "suite_closing.py::test_closing_strict_cycle",
    "suite_closing.py::test_closing_strict_cycle_left_to_the_end",
]


@pytest.mark.launcher
@pytest.mark.parametrize("ranks", [4, 1])
def test_the_testing_guides_fixture_leaves_the_checks_on(ranks: int) -> None:
    """Issue 39, item 9. docs/guides/testing.rst recommends a fixture that
    ends with ``cgc.manager(c).close()``; with it, under --cgc-leak-check, a
    test that keeps a managed object alive passed, and so did a
    ``cgc_leak_check``-marked one and a ``cgc_strict`` one with a cyclic
    death (the only trace: an ExitLeakWarning in the warnings summary).
    With the guide's fixture each must fail, as it does on COMM_WORLD,
    naming the object on every rank; a clean test still passes."""
    args = ["--cgc-leak-check"] if ranks > 1 else ["-o", "cgc_leak_check=true"]
    proc, outcomes = run_suite(*args, "suite_closing.py", ranks=ranks)
    out = proc.stdout + proc.stderr
    for test in CLOSING_BAD:
        assert ("ERROR", test) in outcomes, (test, out)
    assert ("PASSED", "suite_closing.py::test_closing_clean") in outcomes, out
    everyone = ", ".join(str(r) for r in range(ranks))
    for name in ("closed-leak", "closed-marked-leak", "closed-cycle", "closed-cycle-at-the-end"):
        assert f"rank(s) {everyone}: Resource '{name}' (key " in out, (name, out)
