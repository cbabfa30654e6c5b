"""Test harness: the same suite runs serially and under ``mpiexec -n 4``.

Under more than one rank, a failing test aborts the whole job at once
(MPI_Abort), so that the other ranks never wait for ever in a collective the
failed rank will not reach. pytest-timeout (thread method) and mpiexec's
``--timeout`` are the second and third nets.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from mpi4py import MPI

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
        WORLD.Abort(1)


def pytest_configure(config: pytest.Config) -> None:
    if WORLD.Get_size() > 1 and config.option.basetemp is None:
        # Ranks sharing one pytest temp root race on its cleanup.
        config.option.basetemp = os.path.join(
            tempfile.gettempdir(), f"cgc-pytest-{os.getuid()}-rank{WORLD.Get_rank()}"
        )
    if WORLD.Get_size() > 1 and WORLD.Get_rank() > 0:
        # One report is enough; failures on any rank still print (see above).
        config.option.verbose = -2
        config.option.reportchars = ""


@pytest.fixture
def comm(request: pytest.FixtureRequest) -> Iterator[MPI.Intracomm]:
    """A fresh duplicate of the test class's COMM (default COMM_WORLD), freed after."""
    base = getattr(request.cls, "COMM", WORLD)
    c = base.Dup()
    yield c
    c.Free()


def mpiexec_env() -> dict[str, str]:
    """Environment for a child ``mpiexec`` started by a launcher test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_"))}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="true",
        OMPI_MCA_mpi_yield_when_idle="true",
    )
    return env
