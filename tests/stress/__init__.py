"""Fault injection for the randomized stress harness (``tests/stress_harness.py``).

- :mod:`.ledger`: what every managed object of a seed became (destroy counts,
  liveness when its destroy ran, detaches, keys), the defect classes, and the
  checkpoint exchange between ranks, which has a deadline of its own.
- :mod:`.episodes`: the fault scenarios (threads, interrupts in destroys,
  meddling destroys, late ranks, freed communicators).
- :mod:`.resume`: a driver that restarts the harness after a seed killed the
  job (a hang caught by the watchdog, a crash), for runs against faulty code.
"""
