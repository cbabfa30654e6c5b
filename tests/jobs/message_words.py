"""The length of the message each sync point's agreement sent, on every rank
(tests/test_agreement.py runs it at 2, 4 and 16 ranks: it must not change).

Prints ``words <size> <rank> <words of each sync point>``.
"""

from __future__ import annotations

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD


class Obj:
    pass


mgr = cgc.manager(world)
sent = []
cgc.collect(world, generation=None)  # empty: the first sync point
sent.append(mgr.message[0])  # type: ignore[index]
for n in (0, 10, 0, 300, 0):  # steps that register n objects, all dropped
    objs = [Obj() for _ in range(n)]
    o = None
    for o in objs:
        cgc.register(o, lambda: None, comm=world)
    objs = o = None  # type: ignore[assignment]
    cgc.collect(world, generation=None)
    sent.append(mgr.message[0])  # type: ignore[index]
print(f"words {world.Get_size()} {world.Get_rank()} {' '.join(map(str, sent))}", flush=True)
