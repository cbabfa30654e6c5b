"""Deadlines bound every wait of a sync point, and a late rank never reports OK
for a sync point the others gave up on (issue 11, defect 4).

Run on 4 ranks; rank 3 is the late one. Each rank prints one line per phase:
``<phase> <rank> <outcome>`` with outcome OK, TIMEOUT or UNUSABLE.
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
rank = world.Get_rank()
LATE = 3
keep: list[object] = []


class Obj:
    pass


def attempt(phase: str, comm: MPI.Intracomm, late: float = 0.0) -> None:
    if rank == LATE:
        time.sleep(late)
    t0 = time.monotonic()
    try:
        cgc.collect(comm, timeout=1.0)
        outcome = "OK"
    except cgc.CollectiveTimeoutError:
        outcome = "TIMEOUT"
    except cgc.CollectiveGCError:
        outcome = "UNUSABLE"
    print(f"{phase} {rank} {outcome} {time.monotonic() - t0:.1f}", flush=True)


# (a) The first use of a communicator (its private duplicate) has a deadline too.
a = world.Dup()
keep.append(a)
attempt("first-use", a, late=2.5)

# (b) A rank arriving after the others gave up on an empty sync point.
b = world.Dup()
keep.append(b)
cgc.collect(b)  # in step: the manager's duplicate exists everywhere
attempt("late-header", b, late=2.5)
attempt("after-late", b)

# (c) A timeout in a derived communicator's sync marks the parent unusable.
parent = world.Dup()
keep.append(parent)
child = cgc.dup(parent)
o = Obj()
cgc.register(o, lambda: None, comm=child)
cgc.collect(parent)
del o
attempt("child-timeout", parent, late=2.5)
attempt("parent-after", parent)

world.Barrier()  # everyone is here: the abandoned requests can complete now
sys.stdout.flush()
