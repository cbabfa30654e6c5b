"""Start ProcessPrefetch loaders with ever more descriptors to spare, from too few to enough.

With too few, the loader's start-up fails part-way (some workers spawned,
waiting for their boot data, then stopped). Prints, per attempt, ``ok`` or
the error the first next() raised, as ``error TYPE ERRNO MESSAGE``; the test
reads this process's stderr, where a worker stopped at start-up must write
nothing.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # no MPI singleton: this test is about processes only

import numpy as np  # noqa: E402

from collective_gc.data import ProcessPrefetch  # noqa: E402


def element(i: int) -> np.ndarray[Any, Any]:
    return np.full(4096, i, np.float32)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for spare in range(4, 60, 2):
        loader = ProcessPrefetch(element, range(8), num_workers=3)
        used = open_fds()
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + spare, hard))
        try:
            got = [int(e[0]) for e in loader]
        except OSError as exc:
            text = " ".join([str(exc), *getattr(exc, "__notes__", [])]).replace("\n", " ")
            print("error", type(exc).__name__, exc.errno, text, flush=True)
            continue
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            loader.close()
        print("ok" if got == list(range(8)) else f"wrong {got}", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
