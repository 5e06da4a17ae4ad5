"""Reusable fp32 work buffers of fragment size.

A fresh fragment-sized tensor is served by its own mmap (`node.heap.return_large_buffers_to_os`) and
page-faulted in on first touch: 12.5 MB cost about 4 ms of kernel time, against 0.5 ms to write warm memory.
One round touches dozens of them per learner (decodes, the merge, the outer step, snapshots), so the swarm
borrows them from a small pool instead. The pool keeps at most `keep` idle buffers (the memory bound);
more are handed out when asked for, and freed when given back beyond that.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


class BufferPool:
    """Flat fp32 CPU buffers of up to `capacity` elements, shared by threads."""

    def __init__(self, capacity: int, keep: int = 4) -> None:
        self.capacity, self.keep = capacity, keep
        self._idle: list[Tensor] = []
        self._lent: dict[int, tuple[weakref.ref, Tensor]] = {}  # id(view) -> (the view, its whole buffer)
        self._lock = threading.Lock()

    def take(self, numel: int) -> Tensor:
        """An uninitialised buffer of `numel` elements; hand it back with `give` when done with it."""
        if numel > self.capacity:  # lent like the others, freed when given back
            big = torch.empty(numel, dtype=torch.float32)
            with self._lock:
                self._lent[id(big)] = (weakref.ref(big), big)
            return big
        with self._lock:
            buf = self._idle.pop() if self._idle else None
            # views dropped without `give`: forget them (their buffers are freed with them)
            for key in [key for key, (ref, _) in self._lent.items() if ref() is None]:
                del self._lent[key]
        if buf is None:
            buf = torch.empty(self.capacity, dtype=torch.float32)
        view = buf[:numel]
        with self._lock:
            self._lent[id(view)] = (weakref.ref(view), buf)
        return view

    def give(self, view: Tensor | None) -> None:
        """Return a buffer from `take` (None: nothing to return). Raises `ValueError` for any other tensor, a
        view of a lent one or one given back twice: a caller that loses track of what it borrowed would
        otherwise leak buffers, or hand one out twice, without a trace."""
        if view is None:
            return
        with self._lock:
            ref, buf = self._lent.get(id(view), (None, None))
            if ref is None or ref() is not view:
                raise ValueError("this tensor was not lent by this pool, or was given back already")
            del self._lent[id(view)]
            if len(self._idle) < self.keep and buf.numel() == self.capacity:
                self._idle.append(buf)

    def lends(self, view: Tensor) -> bool:
        """`view` is out on loan from this pool (taken, not given back yet)."""
        with self._lock:
            ref, _ = self._lent.get(id(view), (None, None))
            return ref is not None and ref() is view

    def lent(self) -> int:
        """How many buffers are out (taken, not given back, still referenced)."""
        with self._lock:
            return sum(1 for ref, _ in self._lent.values() if ref() is not None)

    @contextmanager
    def borrow(self, numel: int) -> Iterator[Tensor]:
        view = self.take(numel)
        try:
            yield view
        finally:
            self.give(view)
