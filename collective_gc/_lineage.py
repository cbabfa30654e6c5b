"""Where a family's communicators were made: a mark the same on every rank.

A family numbers its members in the order they joined (their tags). A
``cgc.dup`` and the communicator that opens a family join at a collective
of their own, so their tags agree by construction. A library's communicator
(``comm.Dup()``, PETSc's inner duplicate) joins where it is first used: two
of them first used in different orders on different ranks get each other's
tags, and the order fingerprint, a sum over registrations of hash(key, tag),
cannot tell (the same tags in the same order). One agreed order would then
run collective destroys on two communicators at once.

Only ``MPI_Comm_dup`` can say which communicator is which without a
message: it copies the communicator's attributes, on every rank, at one
point in the order of the collectives over it. A family's collectively
joined members carry a :class:`Lineage` attribute; its copy callback gives
each duplicate the path (root's tag, n1, n2, ...): the n-th duplicate of
the n-th duplicate ..., the same on every rank. A member that joins at
first use and carries a lineage is fingerprinted by a hash of its path
instead of its tag, so the ranks' fingerprints differ when they put key k
on different communicators, whatever order they first used them in.

No lineage (a ``Split``, ``Create_group``, a duplicate of a communicator
made before any family was opened on it): its tag, the first-use order,
is trusted, as before. A lineage is present on every rank or on none
(set at collectives, copied at collectives), so a mark never differs
between ranks for a correct program. Paths from an older family may
repeat a newer family's: that only weakens the check, never raises.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["root", "mark"]

_MASK62 = (1 << 62) - 1


class Lineage:
    """Where one communicator was made, and how many duplicates of it were
    made since (the next one's last step)."""

    __slots__ = ("path", "made")

    def __init__(self, path: tuple[int, ...]) -> None:
        self.path = path
        self.made = 0


def _copy(comm: MPI.Comm, keyval: int, parent: Lineage) -> Lineage:
    # An MPI attribute copy callback, run inside MPI_Comm_dup on every rank:
    # no MPI here.
    parent.made += 1
    return Lineage((*parent.path, parent.made))


_KEYVAL: list[int] = []


def _keyval() -> int:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(copy_fn=_copy))
    return _KEYVAL[0]


def root(comm: MPI.Intracomm, tag: int) -> None:
    """``comm`` joined its family at a collective of its own, as member
    ``tag``: its duplicates from now on carry where they were made. A
    communicator that has a lineage keeps it (every rank has one alike).
    Local (an attribute), at a point every rank reaches in the same order
    of ``comm``'s collectives."""
    kv = _keyval()
    if comm.Get_attr(kv) is None:
        comm.Set_attr(kv, Lineage((tag,)))


def mark(comm: MPI.Intracomm) -> int:
    """What registrations on ``comm``, a member that joined at its first
    use, add to the order fingerprint with in place of its tag: a hash of
    its lineage's path (never 0, below 2**63), or 0 if it has none. Local."""
    if not _KEYVAL:
        return 0
    found = comm.Get_attr(_KEYVAL[0])
    if not isinstance(found, Lineage):
        return 0
    h = 0x6A09E667F3BCC909
    for step in found.path:
        h = ((h ^ step) * 0x100000001B3 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return (h & _MASK62) | (1 << 62)
