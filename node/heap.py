"""glibc's allocator, tuned for a learner: large buffers get their own mmap, free heap pages go back to the OS.

The README's memory figures say why (a learner's RSS swung and crept without these). Both are no-ops off glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

LARGE_BUFFER_BYTES = 1 << 20


def return_large_buffers_to_os() -> None:
    """glibc: serve allocations of 1 MiB and more with their own mmap, returned to the OS when freed.

    The swarm allocates fragment- and payload-sized buffers on several threads; with glibc's adaptive mmap
    threshold they land in heap arenas that are never given back, and a learner's RSS swings and creeps
    (the README's memory figures say by how much). A fixed 1 MiB threshold costs page faults once per outer
    step. Small allocations are unaffected; no-op off glibc.
    """
    libc = _glibc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.mallopt(-3, LARGE_BUFFER_BYTES)  # M_MMAP_THRESHOLD


def trim_heap() -> None:
    """glibc: give the free pages inside the heap arenas back to the OS (`malloc_trim(0)`). Payload-sized
    buffers (a few MiB, below the mmap threshold) are allocated and freed on several threads; without this
    the arenas' free pages stay resident, and a learner's RSS creeps up over a long run. No-op off glibc."""
    libc = _glibc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (whose allocator these two tune), else None. Asked once: glibc names
    itself through `confstr` (`ctypes.util.find_library` would run `ldconfig -p` in a subprocess, 1-3 ms,
    at every join and every heap trim)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # (no confstr, or a C library that does not know the name)
        return None
    if not version.startswith("glibc"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
