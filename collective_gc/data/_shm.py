"""Anonymous shared-memory segments: created by a worker, mapped by both sides.

A segment is a ``memfd`` (Linux): it has no name, so nothing ever appears in
``/dev/shm``, nothing has to be unlinked, and no process death, however
abrupt, can leak one: the kernel frees the memory when the last mapping and
the last descriptor are gone. Its descriptor crosses to the parent once, on
the first message that uses the segment (``SCM_RIGHTS``); both sides close
their descriptor right after mapping it. The parent closes its copy only once
the mapping is stored, so an interrupt in between leaves it there to map again.

The parent's mappings keep no descriptor (:func:`map_fd`: an anonymous
``mmap`` object whose pages are replaced by the segment's, where
``mmap.mmap(fd)`` would keep a duplicate of the descriptor for as long as the
mapping lives), and this module knows every one of them, so that a process
forked from the parent can take its copies out of the segments
(:func:`detach_in_child`): see NOTE [ Loader shutdown and interrupts ] in
``_loader``.

On the parent side each mapping is owned by a :class:`Segment`, registered on
the rank-local reaper: when the last reference to it goes (the ring dropped
it, and every element lease that pinned it has been released), the mapping is
closed on the reaper thread, exactly once, never on the consumer's thread.
``mmap.close`` refuses (``BufferError``) while any view of the mapping is
alive, so even a bookkeeping bug could never unmap memory under a live array.
"""

from __future__ import annotations

import ctypes
import mmap
import os

from ._forked import Tracked

__all__ = [
    "Segment",
    "create",
    "detach_in_child",
    "map_fd",
    "round_capacity",
    "supported",
    "unmap_view",
]

PAGE = mmap.PAGESIZE

# -- mappings that keep no descriptor -------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)
_MMAP = _LIBC.mmap
_MMAP.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]  # fmt: skip
_MMAP.restype = ctypes.c_void_p
_MREMAP = _LIBC.mremap
_MREMAP.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                    ctypes.c_void_p]  # fmt: skip
_MREMAP.restype = ctypes.c_void_p
_MUNMAP = _LIBC.munmap
_MUNMAP.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MUNMAP.restype = ctypes.c_int
_RW = mmap.PROT_READ | mmap.PROT_WRITE
# Linux's values on every architecture it runs on (not in the mmap module).
_MAP_FIXED = 0x10
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


# This process's mappings of segments, for a forked child to take its copies
# out of them.
MAPPED: Tracked[mmap.mmap] = Tracked()


def _address(mapping: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mapping)  # an export, released with `anchor`
    return ctypes.addressof(anchor)


def map_fd(fd: int, capacity: int) -> mmap.mmap:
    """Map ``capacity`` bytes of the segment ``fd`` shared; the mapping keeps no descriptor.

    An anonymous ``mmap`` object (which keeps none) whose pages are replaced,
    in place, by the segment's: the object unmaps the segment when it is
    closed or freed, as one made from ``fd`` would. ``fd`` stays the caller's.
    """
    mapping = mmap.mmap(-1, capacity)
    addr = _address(mapping)
    got = _MMAP(addr, capacity, _RW, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        mapping.close()
        raise OSError(err, f"cannot map a shared-memory segment: {os.strerror(err)}")
    MAPPED.add(mapping)
    return mapping


def detach_in_child() -> None:
    """In a forked child: take this process's copies out of the parent's segments.

    A mapping nothing views any more is unmapped; one that an element of this
    process still views gets private memory holding the same bytes, at the
    same address (the element never notices), so that the child keeps
    neither the parent's memory nor a window onto it: what the parent or its
    workers write there later is not seen here. Only the forking thread
    exists here: nothing else reads these mappings meanwhile.
    """
    for mapping in MAPPED.take():
        try:
            mapping.close()
            continue
        except BufferError:  # viewed by an element this process holds
            pass
        _privatize(mapping)


def _privatize(mapping: mmap.mmap) -> None:
    size = len(mapping)
    addr = _address(mapping)
    copy = _MMAP(None, size, _RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if copy in (None, _MAP_FAILED):
        return  # no memory for a copy: the child keeps the shared mapping, as it was
    ctypes.memmove(copy, addr, size)
    # One call moves the copy over the shared pages: the address is never unmapped.
    if _MREMAP(copy, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr) != addr:
        _MUNMAP(copy, size)


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
        return fd, map_fd(fd, capacity)
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
        from ..local import register_released_in_child

        self.view = memoryview(mapping)
        self.capacity = capacity
        # Kept so that the loader can run the unmap itself when the reaper lags.
        # A forked child lets go of the call (its mapping is its own copy, see
        # detach_in_child), where it keeps the other registrations'.
        self.reg = register_released_in_child(self, _unmap, self.view, mapping, name=name)

    def unmap_if_unused(self) -> bool:
        """In a forked child: unmap this process's copy unless an element here views it."""
        return unmap_view(self.view)

    def __repr__(self) -> str:
        # Only a live Segment can be printed, and a live one is always mapped.
        return f"<collective_gc.data Segment of {self.capacity} bytes, mapped>"
