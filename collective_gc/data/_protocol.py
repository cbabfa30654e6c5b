"""What the parent and its workers say to each other, and how an element is laid out.

Both sides import this module; it imports nothing of the rest of the package
but the error base class, so a worker stays light.

Messages travel over one ``SOCK_SEQPACKET`` socket pair per worker, so every
``send`` is one message and a segment's file descriptor rides on the message
that first uses it (``SCM_RIGHTS``):

* worker -> parent: a fixed header (``HEAD``), then, for an element that fits,
  its pickle inline. ``ITEM`` with ``slot >= 0`` says the element is in that
  slot: its pickle, the lengths of its out-of-band buffers, then the buffers,
  laid out by :func:`layout`. ``ERROR`` carries a pickled :func:`pack_error`
  tuple; ``DONE`` says the worker's share is finished.
* parent -> worker: a message of ``CTRL`` records. ``CREDIT n`` lets the
  worker send ``n`` more elements; ``ALLOW n`` says how many slots it may own;
  ``FREE s`` hands slot ``s`` back once every array built on it has died.
  Records are batched (one message per few elements), because every message
  wakes a process, and wake-ups, not bytes, cost time on a busy machine.

Exceptions cross as type + traceback text, never as objects: an exception
object carries frames, and frames keep elements alive (see :func:`pack_error`).
"""

from __future__ import annotations

import pickle
import struct
import traceback
from typing import Any

from .._errors import CollectiveGCError

__all__ = [
    "ALLOW",
    "CREDIT",
    "CTRL",
    "DONE",
    "ERROR",
    "FREE",
    "HEAD",
    "INLINE_MAX",
    "ITEM",
    "MAX_MESSAGE",
    "MAX_RECORDS",
    "OUT_OF_BAND_MIN",
    "WorkerError",
    "layout",
    "lengths_offset",
    "pack_error",
    "rebuild_array",
    "rebuild_error",
]

# worker -> parent: kind, slot (-1: inline), new segment capacity (0: none),
# pickle length, number of out-of-band buffers.
HEAD = struct.Struct("<iiqqq")
ITEM, ERROR, DONE = 1, 2, 3

# parent -> worker, repeated: kind, value.
CTRL = struct.Struct("<ii")
CREDIT, ALLOW, FREE = 1, 2, 3
# Records per message: bounded so a message always fits the socket buffer.
MAX_RECORDS = 2048

# A message must fit the socket's send buffer (~208 KiB by default); anything
# bigger goes through a slot.
MAX_MESSAGE = 1 << 16
INLINE_MAX = MAX_MESSAGE - HEAD.size - 1024
# Smaller buffers are cheaper copied inside the pickle than tracked in a slot.
OUT_OF_BAND_MIN = 4096
# Every out-of-band buffer starts on a cache line; the slot itself starts on a page.
ALIGN = 64


def _up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def rebuild_array(buf: Any, dtype: str, shape: tuple[int, ...], order: str) -> Any:
    """Unpickle a plain numpy array pickled by the worker, as a view of ``buf``.

    Numpy's own reduction pickles the dtype as an object, which costs more to
    build and to load than the array itself; ``dtype.str`` says it all for
    the dtypes the worker sends this way (see ``_worker.Pickler``).
    """
    import numpy as np

    return np.frombuffer(buf, dtype).reshape(shape, order=order)  # type: ignore[call-overload]


def lengths_offset(pickle_len: int) -> int:
    """Where the int64 buffer lengths start in a slot, after a pickle of ``pickle_len``."""
    return _up(pickle_len, 8)


def layout(pickle_len: int, lengths: tuple[int, ...] | list[int]) -> tuple[int, list[int], int]:
    """Offsets of an element in a slot: ``(lengths_offset, buffer_offsets, total)``.

    The pickle starts at 0, the int64 buffer lengths follow it (8-aligned), then
    each buffer, 64-aligned. Both sides compute the same layout from the same
    numbers, so only the numbers cross.
    """
    start = lengths_offset(pickle_len)
    offset = _up(start + 8 * len(lengths), ALIGN)
    offsets = []
    for n in lengths:
        offsets.append(offset)
        offset = _up(offset + n, ALIGN)
    return start, offsets, offset


class WorkerError(CollectiveGCError, RuntimeError):
    """A prefetch worker failed: it died, or an element could not be made or sent.

    An exception raised by the user's function is re-raised as its own type when
    that type can be rebuilt from a message, else as ``WorkerError``; either
    way the message holds the worker's traceback text.

    Attributes:
        exitcode: the worker's exit code if it died (negative: killed by that
            signal), else None.
    """

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


_TEXT_MAX = INLINE_MAX // 2 - 1024


def pack_error(exc: BaseException, where: str) -> bytes:
    """Pickle ``exc`` as (type or None, type name, where, traceback text).

    The type crosses by reference when it can (a class importable by name) so
    the parent can raise the same type; the text is cut to fit one message,
    keeping its end, where the error is.
    """
    try:
        type_blob: bytes | None = pickle.dumps(type(exc))
    except (pickle.PicklingError, AttributeError, TypeError):  # cannot be named: text only
        type_blob = None
    text = "".join(traceback.format_exception(exc))
    if len(text) > _TEXT_MAX:
        text = "[... traceback cut ...]\n" + text[-_TEXT_MAX:]
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return pickle.dumps((type_blob, name, where, text))


def rebuild_error(blob: bytes, worker: str) -> BaseException:
    """A fresh exception from a :func:`pack_error` message (no frames attached)."""
    type_blob, name, where, text = pickle.loads(blob)
    message = f"{name} raised in {worker} {where}; the worker's traceback:\n\n{text}"
    exc_type: object = None
    if type_blob is not None:
        try:
            exc_type = pickle.loads(type_blob)
        except (AttributeError, ImportError, pickle.UnpicklingError):  # not importable here
            exc_type = None
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        try:
            return exc_type(message)
        except Exception:  # noqa: BLE001 (an __init__ that wants other arguments)
            return WorkerError(message)
    return WorkerError(message)
