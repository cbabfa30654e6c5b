"""shard_indices: this rank's share of ``range(n)``."""

from __future__ import annotations

from typing import Literal, Protocol

__all__ = ["shard_indices"]


class _RankAndSize(Protocol):
    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...


def shard_indices(
    n: int, comm: _RankAndSize, *, mode: Literal["contiguous", "strided"] = "contiguous"
) -> range:
    """The indices of ``range(n)`` that this rank of ``comm`` should load.

    Local (no communication): only ``comm.Get_rank()`` and ``comm.Get_size()``
    are called, so any object with those two methods works. Every index goes
    to exactly one rank, and shard sizes differ by at most one.

    ``mode="contiguous"`` (default): rank ``r`` gets one block; the first
    ``n % size`` ranks get one index more. Reads stay sequential, which suits
    data sorted on disk, and each rank touches only its part of a file.

    ``mode="strided"``: rank ``r`` gets ``r, r + size, r + 2 size, ...``. Each
    rank sees every part of the index range, which evens out cost or content
    that varies along it (sorted by length or by class, say).

    A collective loop over the shards (an allreduce per element) needs the
    same count on every rank: pick ``n`` divisible by the size, or stop all
    ranks at the smallest shard, ``n // size``.

    Raises ValueError if ``n`` < 0 or ``mode`` is unknown.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    rank, size = comm.Get_rank(), comm.Get_size()
    if mode == "strided":
        return range(rank, n, size)
    if mode != "contiguous":
        raise ValueError(f"mode must be 'contiguous' or 'strided', got {mode!r}")
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))
