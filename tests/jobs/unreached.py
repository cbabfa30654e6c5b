"""A library's communicator used before anything containing it had a sync
point (no scope, COMM_WORLD's manager unused): it is named (view, a warning
on every rank) until a sync point of COMM_WORLD reaches it and destroys what
died there (issue 22, item 2). Run by tests/test_clients.py on 2 ranks."""

import gc
import warnings

from mpi4py import MPI

import collective_gc as cgc
from collective_gc._comms import unreached

WORLD = MPI.COMM_WORLD
lib = WORLD.Dup()  # a library's own duplicate
ran = []


class Owner:
    pass


o = Owner()
cgc.register(o, ran.append, "destroyed", comm=lib)
text = cgc.view(WORLD, file=None)  # COMM_WORLD's first use: it names lib
assert "no sync point reaches" in text, text
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cgc.manager(lib) in unreached()
    assert unreached() == [cgc.manager(lib)]  # warned once
assert len(caught) == 1 and "no sync point reaches" in str(caught[0].message), caught
del o
gc.collect()
cgc.collect(WORLD)  # reaches lib (its group is in WORLD's) and syncs it
assert ran == ["destroyed"], ran
assert "no sync point reaches" not in cgc.view(WORLD, file=None)
lib.Free()
cgc.collect(WORLD)
print(f"rank {WORLD.rank}: ok", flush=True)
