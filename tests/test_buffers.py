"""The pool of reusable fragment-sized buffers."""

from __future__ import annotations

import gc
import platform
import subprocess

import pytest
import torch

from diloco.coordinator.buffers import BufferPool


def test_a_buffer_given_back_is_lent_again_and_views_have_the_size_asked():
    pool = BufferPool(100, keep=1)
    a = pool.take(60)
    assert a.shape == (60,) and a.dtype == torch.float32
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(100)
    assert b.data_ptr() == ptr and b.numel() == 100


def test_two_buffers_lent_at_once_never_share_memory():
    pool = BufferPool(10, keep=4)
    a, b = pool.take(10), pool.take(10)
    assert a.data_ptr() != b.data_ptr()


def test_give_refuses_what_the_pool_did_not_lend_and_a_second_give():
    pool = BufferPool(10, keep=4)
    with pytest.raises(ValueError, match="not lent"):
        pool.give(torch.empty(10))
    pool.give(None)
    a = pool.take(10)
    alias = a.view(2, 5)  # the same memory, another tensor: not what was lent
    with pytest.raises(ValueError, match="not lent"):
        pool.give(alias)
    b = pool.take(10)
    assert b.data_ptr() != a.data_ptr(), "a buffer still lent must not be lent again"
    pool.give(a)
    with pytest.raises(ValueError, match="given back already"):
        pool.give(a)
    c, d = pool.take(10), pool.take(10)
    assert c.data_ptr() != d.data_ptr()


def test_idle_buffers_beyond_keep_are_freed_and_forgotten_ones_do_not_pile_up():
    pool = BufferPool(10, keep=1)
    views = [pool.take(10) for _ in range(3)]
    for v in views:
        pool.give(v)
    assert len(pool._idle) == 1
    lost = pool.take(10)
    del lost
    gc.collect()
    pool.take(10)
    assert len(pool._lent) == 1  # the dropped view's entry is gone


def test_requests_above_capacity_get_a_fresh_tensor():
    pool = BufferPool(10, keep=1)
    big = pool.take(11)
    assert big.numel() == 11
    pool.give(big)
    assert not pool._idle


def test_borrow_gives_back_on_exit():
    pool = BufferPool(10, keep=1)
    with pool.borrow(5) as buf:
        ptr = buf.data_ptr()
    assert pool.take(10).data_ptr() == ptr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator settings are glibc's")
def test_the_allocator_is_tuned_without_running_a_subprocess(monkeypatch):
    """`ctypes.util.find_library` ran `ldconfig -p` at every join and every heap trim (1-3 ms each)."""
    from diloco.node import heap

    def no_subprocess(*args, **kwargs):
        raise AssertionError("a subprocess was started")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    heap._glibc.cache_clear()
    try:
        assert heap._glibc() is not None
        heap.return_large_buffers_to_os()
        heap.trim_heap()
    finally:
        heap._glibc.cache_clear()
