"""The first next() of a ProcessPrefetch under a KeyboardInterrupt every 50-300 us.

A fresh interpreter, so that start-up does all its work (``multiprocessing``
is not imported yet). The interrupt is raised wherever the main thread is,
except in this file's own code (the loop that resumes after each one) and in
finalizers and collector callbacks (which would swallow it). Prints ``ok INTERRUPTS`` once the first
element came and then every element, in order; ``hang`` if the first next()
did not finish within 30 s.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # no MPI singleton: this test is about processes only

import numpy as np  # noqa: E402

from collective_gc.data import ProcessPrefetch  # noqa: E402

TOTAL = 50


def element(i: int) -> np.ndarray[Any, Any]:
    return np.full(4096, i, np.float32)


class Pester:
    def __init__(self) -> None:
        self.armed = True
        self.rng = random.Random(7)
        self.old = signal.signal(signal.SIGALRM, self.handler)
        signal.setitimer(signal.ITIMER_REAL, 0.0001)

    def handler(self, signum: int, frame: Any) -> None:
        if not self.armed:
            return
        signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(0.00005, 0.0003))
        if frame is None or frame.f_code.co_filename == __file__:
            return  # this file's loop: an interrupt there is not the loader's to survive
        f = frame
        while f is not None:
            # A finalizer or the collector's callback would only print it as
            # "Exception ignored": not an interrupt anyone could catch.
            if f.f_code.co_name in ("__del__", "_gc_phase"):
                return
            f = f.f_back
        raise KeyboardInterrupt

    def stop(self) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)


def main() -> int:
    assert "multiprocessing" not in sys.modules
    loader = ProcessPrefetch(element, range(TOTAL), num_workers=2)
    got: list[int] = []
    interrupts = 0
    deadline = time.monotonic() + 30
    pester = Pester()
    try:
        while not got:
            if time.monotonic() > deadline:
                print("hang", interrupts, flush=True)
                return 1
            try:
                got.append(int(next(loader)[0]))
            except KeyboardInterrupt:
                interrupts += 1
    finally:
        pester.stop()
    got += [int(e[0]) for e in loader]
    loader.close()
    if got != list(range(TOTAL)):
        print("wrong", got, flush=True)
        return 2
    print("ok", interrupts, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
