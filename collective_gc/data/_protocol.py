"""What the parent and its workers say to each other, and how an element is laid out.

Both sides import this module; it imports nothing of the rest of the package
but the error base class, so a worker stays light.

Messages travel over one ``SOCK_SEQPACKET`` socket pair per worker, so every
``send`` is one message and a segment's file descriptor rides on the message
that first uses it (``SCM_RIGHTS``). On x86-64 most worker -> parent messages
take a shared-memory ring instead (see "The ring" below); the socket keeps
the others:

* worker -> parent: a fixed header (``HEAD``) whose ``seq`` counts the
  worker's elements (0, 1, 2, ...), so the parent notices a message it failed
  to take in (an interrupt can strike just as a receive returns), then, for an
  element that fits, its pickle inline. ``ITEM`` with ``slot >= 0`` says the
  element is in that slot: its pickle, the lengths of its out-of-band buffers,
  then the buffers, laid out by :func:`layout`. ``ARRAY`` is a plain numpy
  array at the start of its slot, described by an :data:`ARRAY_META` record
  and its shape (no pickle on either side). ``ERROR`` carries a pickled
  :func:`pack_error` tuple; ``DONE`` says the worker's share is finished.
* parent -> worker: a message of ``CTRL`` records. ``CONSUMED n`` says the
  parent has taken ``n`` of the worker's elements in all (the worker may run
  ``window`` elements ahead of that); ``ALLOW n`` says how many slots it may
  own; ``FREE s q`` hands slot ``s`` back once every array built on element
  ``q`` (which used it) has died. Every record can be sent twice without harm
  (counts are absolute, a FREE for a slot not leased under that element is
  ignored), so a send interrupted before its bookkeeping is simply repeated.
  Records are batched (one message per few elements), because every message
  wakes a process, and wake-ups, not bytes, cost time on a busy machine.

The ring: one per worker, a shared segment created by the parent: first
``ring_entries(window)`` entries of ``RING_ENTRY`` bytes, for the worker's
messages. Element ``seq`` of the worker goes to entry ``seq % entries``: the
message (the same bytes as on the socket) at offset 8, then ``seq + 1`` in the
entry's first aligned int64 (its mark), then one count on the parent's
doorbell (an ``eventfd``) in case the parent sleeps. The parent reads an entry
whose mark says ``seq + 1`` with no system call at all; that needs stores to
become visible in program order (x86's memory model: the mark is never seen
before the message), so the ring is used on x86-64 only. An entry is
rewritten only for element ``seq + entries``, which the worker may make only
once the parent has said it consumed elements up to ``seq + 2`` (the window),
so an entry is never rewritten under a parent still reading it. A message
that carries a descriptor or does not fit an entry (a big pickle, most
errors) takes the socket, after every element before it was posted; a worker
killed while writing an entry leaves its mark unwritten, so the parent never
reads half a message.

Then the control area, the parent's records in the same ring: the counts
CONSUMED and ALLOWANCE, and the FREE records in a ring of their own (the
parent advances PUT after writing them, the worker TAKEN after reading them),
each the same as on the socket and as harmless twice. The parent writes
CONSUMED after every element (one store) and the rest every few elements.

Doorbells, batched: a wake-up costs more than the element on a busy
machine (each one waits for a core), so neither side rings for every
element, only when the other sleeps and asked for what it now has. A
parent that finds element ``s`` not posted stores ``ASK = s + k`` (wake me
once your count of posted elements reaches it; ``k``, up to the window,
grows with how fast the worker posts, so a fast worker wakes the parent
once per ``k`` elements and a slow one once per element); the worker rings
the parent's doorbell when a post reaches ASK, before it sleeps itself
(the parent may wait for what it posted), and after DONE and ERROR. A
worker that must wait stores ``SLEEP = n`` (wake me once CONSUMED reaches
``n``: half a window on, so one wake-up per half window) or ``NEEDS_SLOT``
(wake me when you hand a slot back or raise the allowance); the parent
rings the worker's doorbell (another ``eventfd``) when that holds. Either
side stores its condition, then :func:`fence`, then looks at the other's
progress once more before it sleeps, and the other stores its progress,
then :func:`fence`, then reads the condition: of two such store-then-load
sequences one always sees the other's store, so a sleeper is never
forgotten. (The parent's per-element look at SLEEP has no fence; the
fenced look it takes before it sleeps, and every few elements, catches
what that one missed.) A parent's wait also wakes every ``POLL`` seconds.

Exceptions cross pickled when they can be (the worker's exception object, its
traceback left behind) and as type + text otherwise; the worker's formatted
traceback always crosses as text, and becomes the ``__cause__`` of the error
raised in the parent, as ``concurrent.futures`` does (see :func:`rebuild_error`).
Frames never cross: they would keep elements alive.
"""

from __future__ import annotations

import pickle
import struct
import traceback
from _thread import allocate_lock as _allocate_lock
from typing import Any

from .._errors import CollectiveGCError

__all__ = [
    "ALLOW",
    "ASK_AT",
    "NEEDS_SLOT",
    "SLEEP_AT",
    "fence",
    "ARRAY",
    "ARRAY_META",
    "CONSUMED",
    "CTRL",
    "DONE",
    "ERROR",
    "FREE",
    "MARK",
    "WORD",
    "HEAD",
    "INLINE_MAX",
    "ITEM",
    "LoaderError",
    "MAX_MESSAGE",
    "MAX_RECORDS",
    "OUT_OF_BAND_MIN",
    "RING_ENTRY",
    "RING_MESSAGE",
    "RemoteTraceback",
    "WorkerError",
    "layout",
    "lengths_offset",
    "pack_error",
    "rebuild_array",
    "read_mark",
    "rebuild_error",
    "ring_bytes",
    "ring_control",
    "ring_entries",
]

# worker -> parent: kind, slot (-1: inline), element number in this worker's
# share, new segment capacity (0: none), pickle length (ITEM, ERROR: the
# blob's; ARRAY: the array's bytes), number of out-of-band buffers (ARRAY: ndim).
# A kind of 0 never travels: the parent marks its inbox empty with it.
HEAD = struct.Struct("<iiqqqq")
ITEM, ERROR, DONE, ARRAY = 1, 2, 3, 4
# After the header of an ARRAY: dtype.str (8 bytes, NUL-padded), order (b"C" or
# b"F"), then ndim int64 dimensions.
ARRAY_META = struct.Struct("<8sc")

# parent -> worker, repeated: kind, slot, value.
CTRL = struct.Struct("<iiq")
CONSUMED, ALLOW, FREE = 1, 2, 3
# Records per message: bounded so a message always fits the socket buffer.
MAX_RECORDS = 2048

# A message must fit the socket's send buffer (~208 KiB by default); anything
# bigger goes through a slot.
MAX_MESSAGE = 1 << 16
INLINE_MAX = MAX_MESSAGE - HEAD.size - 1024
# The ring: entry size, the longest message an entry holds (after its 8-byte
# mark), and the entry's size in int64 units (where the worker stores marks).
RING_ENTRY = 512
RING_MESSAGE = RING_ENTRY - 8
MARK = RING_ENTRY // 8
# Whatever one process reads while the other may be writing it is one aligned
# int64, written and read whole ("@q": native, one memory access; a standard-
# size struct format may move it a byte at a time, and a count read half old,
# half new could run the worker ahead).
WORD = struct.Struct("@q")
read_mark = WORD.unpack_from
# After the entries, the control area (the parent's side of the ring): the
# parent writes CONSUMED, ALLOWANCE and PUT, the count of FREE records it has
# written; the worker writes TAKEN, the count it has read, on a cache line of
# its own; then the records, a ring of FREED_RECORDS (slot, element) pairs.
CONSUMED_AT, ALLOWANCE_AT, PUT_AT, TAKEN_AT, RECORDS_AT = 0, 8, 16, 64, 128
# The doorbells' conditions (see "Doorbells, batched" below): ASK, the
# parent's, on its cache line; SLEEP, the worker's, on the worker's.
ASK_AT, SLEEP_AT = 24, 72
FREED_RECORDS = 1024
FREED_RECORD = struct.Struct("@qq")
CONTROL_BYTES = RECORDS_AT + FREED_RECORDS * FREED_RECORD.size
# SLEEP's value while a worker waits for a slot rather than for CONSUMED.
NEEDS_SLOT = -1


def fence() -> None:
    """A full memory barrier: every store before it is visible before any load after it.

    x86 keeps stores in order and loads in order, but lets a load pass an
    earlier store (to another address) still in the core's store buffer;
    a locked instruction drains that buffer. The cheapest one Python can
    reach is a fresh lock's acquire (glibc's ``sem_trywait``: a ``lock
    cmpxchg``). A fresh lock each time, never released: an interrupt between
    an acquire and a release of a shared lock would leave it held for ever
    (NOTE [ Loader shutdown and interrupts ] in ``_loader``, rule 4).
    """
    _allocate_lock().acquire(False)


def ring_entries(window: int) -> int:
    """Entries in a worker's ring: the window, the element after it, and its end (DONE)."""
    return window + 2


def ring_bytes(window: int) -> int:
    """The size of a worker's ring segment: its entries, then its control area."""
    return ring_entries(window) * RING_ENTRY + CONTROL_BYTES


def ring_control(size: int) -> tuple[int, int]:
    """``(entries, control area offset)`` of a ring segment of ``size`` bytes."""
    entries = (size - CONTROL_BYTES) // RING_ENTRY
    return entries, entries * RING_ENTRY


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


class LoaderError(CollectiveGCError, RuntimeError):
    """A loader cannot deliver its next element in order.

    Raised by ``next()`` if the element numbers show one was lost (a guard:
    interrupts inside ``next()`` lose nothing), and by a loader's copy in a
    process forked from its owner, which cannot use the owner's workers; the
    loader then raises it on every later call, so an epoch is never silently
    cut short. :class:`WorkerError` is a subclass.
    """


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text.

    Set as the ``__cause__`` of the exception ``next()`` re-raises, so the
    worker's frames print above it, as ``concurrent.futures`` does.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class WorkerError(LoaderError):
    """A prefetch worker failed: it died, or an element could not be made or sent.

    An exception raised by the user's function (or ``worker_init_fn``) is
    re-raised as itself when it can be pickled, else as its own type built
    from a message, else as ``WorkerError``; in every case its ``__cause__`` is
    a :class:`RemoteTraceback` holding the worker's traceback.

    Attributes:
        exitcode: the worker's exit code if it died (negative: killed by that
            signal), else None.
    """

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


_TEXT_MAX = INLINE_MAX // 2 - 1024
_CUT = "[... traceback cut ...]\n"
_OBJECT_MAX = INLINE_MAX // 4


def pack_error(exc: BaseException, where: str) -> bytes:
    """Pickle ``exc`` as (exception or None, type or None, type name, where, traceback text).

    The exception itself crosses when it pickles small (its traceback is not
    pickled); else its type crosses by reference when it can (a class
    importable by name) so the parent can raise the same type. The text is cut
    to fit one message, keeping its end, where the error is.
    """
    text = "".join(traceback.format_exception(exc))
    if len(text) > _TEXT_MAX:
        text = _CUT + text[-_TEXT_MAX:]
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    obj_blob: bytes | None
    try:
        blob = pickle.dumps(exc)
        obj_blob = blob if len(blob) <= _OBJECT_MAX else None
    except Exception:  # noqa: BLE001 (any object may refuse to pickle: the text still crosses)
        obj_blob = None
    try:
        type_blob: bytes | None = pickle.dumps(type(exc))
    except (pickle.PicklingError, AttributeError, TypeError):  # cannot be named: text only
        type_blob = None
    blob = pickle.dumps((obj_blob, type_blob, name, where, text))
    if len(blob) <= INLINE_MAX:
        return blob
    # Too big for one message, which the parent could not receive whole: the
    # cut above counts characters, and one may take 4 bytes (or the object is
    # big). Measured in bytes now: the object goes (its type still crosses),
    # and the text keeps as many bytes of its end as fit.
    rest = len(pickle.dumps((None, type_blob, name, where, _CUT))) + 16  # + a longer length
    tail = text.encode("utf-8", "surrogatepass")[-max(1, INLINE_MAX - rest) :]
    text = _CUT + tail.decode("utf-8", "ignore")  # a character cut in two is dropped
    return pickle.dumps((None, type_blob, name, where, text))


def rebuild_error(blob: bytes, worker: str) -> BaseException:
    """A fresh exception from a :func:`pack_error` message, its cause the remote traceback.

    No frame of the worker is attached (only text), so keeping the error keeps
    no element alive.
    """
    obj_blob, type_blob, name, where, text = pickle.loads(blob)
    context = f"{name} raised in {worker} {where}"
    cause = RemoteTraceback(f'\n"""\n{context}; the worker\'s traceback:\n\n{text}"""')
    exc: BaseException | None = None
    if obj_blob is not None:
        try:
            loaded = pickle.loads(obj_blob)
        except Exception:  # noqa: BLE001 (its class may not unpickle here: fall back on the type)
            loaded = None
        if isinstance(loaded, Exception):
            exc = loaded
    if exc is None:
        message = f"{context}; the worker's traceback:\n\n{text}"
        exc_type: object = None
        if type_blob is not None:
            try:
                exc_type = pickle.loads(type_blob)
            except (AttributeError, ImportError, pickle.UnpicklingError):  # not importable here
                exc_type = None
        if isinstance(exc_type, type) and issubclass(exc_type, Exception):
            try:
                exc = exc_type(message)
            except Exception:  # noqa: BLE001 (an __init__ that wants other arguments)
                exc = None
        if exc is None:
            exc = WorkerError(message)
    exc.__cause__ = cause
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:  # Python 3.11+: say where it came from under the message
        add_note(f"(raised in {worker} {where})")
    return exc
