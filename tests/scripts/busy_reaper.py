"""Interpreter shutdown while the rank-local reaper thread is busy."""

import time

import collective_gc as cgc

ran = []


class Seg:
    pass


def slow_close(i: int) -> None:
    time.sleep(0.3)
    ran.append(i)


segs = [Seg() for _ in range(40)]  # 12 s of destroys: more than the shutdown waits
for i, s in enumerate(segs):
    cgc.register(s, slow_close, i, comm=None)
del s
segs.clear()
print("exiting", flush=True)
