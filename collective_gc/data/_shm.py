"""Anonymous shared-memory segments: created by a worker, mapped by both sides.

A segment is a ``memfd`` (Linux): it has no name, so nothing ever appears in
``/dev/shm``, nothing has to be unlinked, and no process death, however
abrupt, can leak one: the kernel frees the memory when the last mapping and
the last descriptor are gone. Its descriptor crosses to the parent once, on
the first message that uses the segment (``SCM_RIGHTS``); both sides close
their descriptor right after mapping it (``mmap`` keeps a duplicate of its
own, closed when the mapping is closed). The parent closes its copy only once
the mapping is stored, so an interrupt in between leaves it there to map again.

On the parent side each mapping is owned by a :class:`Segment`, registered on
the rank-local reaper: when the last reference to it goes (the ring dropped
it, and every element lease that pinned it has been released), the mapping is
closed on the reaper thread, exactly once, never on the consumer's thread.
``mmap.close`` refuses (``BufferError``) while any view of the mapping is
alive, so even a bookkeeping bug could never unmap memory under a live array.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["Segment", "create", "round_capacity", "supported", "unmap_view"]

PAGE = mmap.PAGESIZE


def supported() -> bool:
    """Whether this platform has what segments need (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create")


def round_capacity(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages, at least one."""
    return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)


def create(capacity: int, name: str) -> tuple[int, mmap.mmap]:
    """A new segment of ``capacity`` bytes: ``(fd, mapping)``; the caller closes ``fd``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        return fd, mmap.mmap(fd, capacity)
    except BaseException:
        os.close(fd)
        raise


def unmap_view(view: memoryview) -> bool:
    """Unmap the mapping ``view`` was made of, unless something else still views it.

    For a forked child letting go of the parent's mappings (only its thread
    exists there). False if a view of it is alive (an element this process
    holds): then it stays mapped, as it must.
    """
    try:
        mapping = view.obj
    except ValueError:  # released already
        return True
    if not isinstance(mapping, mmap.mmap):
        return False
    try:
        view.release()
        mapping.close()
    except BufferError:
        return False
    return True


def _unmap(view: memoryview, mapping: mmap.mmap) -> None:
    # The reaper's destroy for a Segment: every lease on it is gone. A lease's
    # callback runs at the start of its array's deallocation, though, so the
    # array may still hold its view for a few instructions on another thread;
    # then close() refuses (BufferError: it never unmaps under a live view), and
    # the mmap object unmaps itself when that view goes, a moment later.
    try:
        view.release()
        mapping.close()
    except BufferError:
        return


class Segment:
    """The parent's mapping of one slot's segment.

    Holders: the worker's slot table while the slot uses it, and the pending
    release of each element lease built on it. The mapping is closed on the
    reaper thread when the last holder lets go. Not to be closed by hand.
    """

    __slots__ = ("__weakref__", "capacity", "reg", "view")

    def __init__(self, mapping: mmap.mmap, capacity: int, name: str) -> None:
        # Imported here: the worker side of this module must not import the core.
        from ..local import register

        self.view = memoryview(mapping)
        self.capacity = capacity
        # Kept so that the loader can run the unmap itself when the reaper lags.
        self.reg = register(self, _unmap, self.view, mapping, name=name)

    def unmap_if_unused(self) -> bool:
        """In a forked child: unmap this process's copy unless an element here views it."""
        return unmap_view(self.view)

    def __repr__(self) -> str:
        # Only a live Segment can be printed, and a live one is always mapped.
        return f"<collective_gc.data Segment of {self.capacity} bytes, mapped>"
