"""A process that iterates a ProcessPrefetch and then waits to be killed.

Usage: victim.py MODE, MODE one of:
  main    loader created on the main thread, workers waiting on a full buffer;
  busy    the same, but the workers are inside a long fn when the parent dies;
  thread  loader created on a thread that has exited (a thread's exit must not
          look like the parent's death, and the parent's death must still be seen);
  main-fork, thread-fork  as main and thread, and each worker's fn forks a
          child that would sleep for 10 minutes.
Prints "ready PID PID" once its workers run, then sleeps.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import mpi4py

mpi4py.rc.initialize = False  # no MPI singleton: this test is about processes only

import numpy as np  # noqa: E402

from collective_gc.data import ProcessPrefetch, testing  # noqa: E402


def element(i: int) -> np.ndarray:
    if MODE == "busy" and i >= 2:
        time.sleep(600)
    if MODE.endswith("fork") and i < 2 and os.fork() == 0:  # one child per worker
        time.sleep(600)
        os._exit(0)
    return np.full(65536, i, np.float32)


MODE = sys.argv[1] if len(sys.argv) > 1 else "main"

if __name__ == "__main__":
    loaders: list[ProcessPrefetch[np.ndarray]] = []
    kept: list[np.ndarray] = []

    def start() -> None:
        loader = ProcessPrefetch(element, range(10**6), num_workers=2, buffer_size=2)
        kept.append(next(loader))
        kept.append(next(loader))
        loaders.append(loader)

    if MODE.startswith("thread"):
        t = threading.Thread(target=start)
        t.start()
        t.join()  # the creating thread is gone; its workers must live on
        time.sleep(0.5)
    else:
        start()
    time.sleep(0.3)  # let the workers fill their buffers, or enter fn
    pids = [p.pid for p in testing.workers(loaders[0])]
    print("ready", *pids, flush=True)
    time.sleep(600)
