"""Participants: votes, their field, their fingerprint, ``finish`` and ``may_raise`` seen
alike on every rank.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

from collective_gc import _agree


def test_the_participants_fingerprint_has_64_bits() -> None:
    values = {_agree.fingerprint(f"p{i}") for i in range(20_000)}
    assert len(values) == 20_000
    assert any(v >= 1 << 48 or v < 0 for v in values)  # all 64 bits are used
    assert all(-(1 << 63) <= v < 1 << 63 for v in values)  # one int64 word
