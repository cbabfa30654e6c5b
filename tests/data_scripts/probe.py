"""Run in loader workers by the tests: reports what the worker process looks like.

Kept apart from the test modules so that importing it (which a worker does to
unpickle ``report``) adds nothing of collective_gc to the worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def report(i: int) -> dict[str, Any]:
    from mpi4py import MPI

    return {
        "index": i,
        "mpi_initialized": MPI.Is_initialized(),
        "env": sorted(k for k in os.environ if k.startswith(("OMPI_", "PMIX_", "PMI_"))),
        "data_modules": sorted(m for m in sys.modules if m.startswith("collective_gc.data.")),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }
