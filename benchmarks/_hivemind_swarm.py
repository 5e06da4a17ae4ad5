"""Hivemind and raw-socket half of the swarm benchmark. Every number is wall-clock seconds on 127.0.0.1.

* ``hivemind_allreduce_s``: ``peers`` processes (spawned, one torch thread each), each with its own
  ``hivemind.DHT`` (own p2pd) and ``DecentralizedAverager`` over ``numel`` float32 split into 8 equal
  tensors (``torch.randn``, one seed per peer), codec ``Uniform8BitQuantization``, ``target_group_size =
  min_group_size = peers``, ``min_matchmaking_time=2``. Each round every peer calls ``step(wait=False,
  require_trigger=True)``; once all peers are in stage AWAITING_TRIGGER (group formed; matchmaking is not
  timed, only logged) they are released together and each times ``allow_allreduce()`` until
  ``step.result()`` returns: the all-reduce alone (compress, exchange, reduce, decompress, in-place
  update). Number = median over ``repeats`` rounds of the max over peers, after a warm-up round that is not
  counted (the first is cold: new streams, first touch of buffers, ~3x slower). A round whose gathered dict
  lacks a peer is rerun. Peer 0 logs its relative RMS error against the exact fp32 mean after its first round.
  The swarm benchmark interleaves these rounds with its own (``alongside``).
* ``hivemind_load_state_s``: ``peers`` averagers with ``allow_state_sharing=True`` hold the same 8 tensors
  (``numel`` float32, identical seed); a fifth peer (its DHT joined, its averager started, all ``peers``
  state declarations visible in its DHT) times ``load_state_from_peers()`` from call to return, then checks
  the 8 tensors are bit-identical to the source. hivemind's default ``state_compression`` is used (none:
  fp32 on the wire). Median over ``repeats`` loads by that same peer (only the first of them fresh).
* ``raw_transfer_s``: ``nbytes`` from a preallocated buffer through one loopback TCP socket with default
  socket options between two spawned processes (``sendall`` / ``recv_into`` a preallocated bytearray);
  timed in the receiver from ``accept()`` returning to the last byte received; median over ``repeats``.
  The sender waits for a 1-byte ack before the next connection, so runs never overlap.

Every process started here (workers, the DHT and averager processes they fork, p2pd daemons) is killed and
reaped before a function returns, even on errors: p2pd first (its parent DHT process reaps it), then the
DHT and averager processes (reaped by their worker), then the worker; hivemind's unix sockets are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import psutil

P2P_OPTS = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False, use_relay=False, use_auto_relay=False)
P2P_OPTS.update(auto_nat=False, nat_port_map=False)
PREFIX = "swarmbench"
FRAGMENTS = 8
STATE_SEED = 1234


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _make_tensors(numel: int, seed: int | None):
    import torch

    if seed is None:
        return [torch.zeros(numel // FRAGMENTS) for _ in range(FRAGMENTS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel // FRAGMENTS, generator=g) for _ in range(FRAGMENTS)]


def _socket_glob(worker_pid: int) -> str:
    """Each worker points hivemind's unix sockets (p2pd's and every P2P client's) at its own file prefix,
    so they can all be removed afterwards, including those of a p2pd that failed to start."""
    return f"/tmp/hivemind-swarmbench-{worker_pid}-*"


def _kill_tree(root: psutil.Process, own: list) -> None:
    """SIGKILL root's descendants bottom-up and remove root's sockets; ``own`` are mp.Process children of
    this process (killed and joined here, so they are reaped); deeper processes are reaped by their parents."""
    with contextlib.suppress(psutil.Error):
        direct, own_pids = {p.pid for p in root.children()}, {p.pid for p in own}
        deep = [p for p in root.children(recursive=True) if p.pid not in own_pids]
        for p in sorted(deep, key=lambda p: p.pid in direct):  # p2pd first, so that its parent reaps it
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(deep, timeout=3)
        for p in own:
            with contextlib.suppress(Exception):
                p.kill()
                p.join(timeout=10)
    for path in glob.glob(_socket_glob(root.pid)):
        with contextlib.suppress(OSError):
            os.remove(path)


def _peer_main(rank: int, role: str, numel: int, peers: int, conn) -> None:
    """One hivemind peer. role: "avg" (all-reduce), "src" (shares its state) or "dst" (loads the state)."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    # hivemind defaults to torch's file_system sharing, which forks a torch_shm_manager and leaves /dev/shm
    # files behind when a process is SIGKILLed; file descriptors are unlinked at once and need no daemon
    os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] = "file_descriptor"
    mp.set_start_method("fork", force=True)  # a spawned child defaults to spawn; hivemind needs fork
    dht = avg = None
    try:
        import hivemind
        import torch
        from hivemind.averaging.control import AveragingStage

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")  # deprecation, in hivemind
        hivemind.p2p.P2P._UNIX_SOCKET_PREFIX = "/unix" + _socket_glob(os.getpid())[:-1]
        dht = hivemind.DHT(initial_peers=conn.recv(), start=True, **P2P_OPTS)
        if rank == 0:
            conn.send(("maddrs", [str(a) for a in dht.get_visible_maddrs()]))
        seed = {"avg": rank, "src": STATE_SEED, "dst": None}[role]
        avg = hivemind.averaging.DecentralizedAverager(
            _make_tensors(numel, seed), dht, start=True, prefix=PREFIX,
            target_group_size=peers, min_group_size=peers, min_matchmaking_time=2.0, request_timeout=1.0,
            compression=hivemind.compression.Uniform8BitQuantization(), allow_state_sharing=role == "src",
        )  # fmt: skip
        conn.send(("ready",))
        first = True
        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "step":
                ctl = avg.step(wait=False, require_trigger=True, timeout=60)
                t0 = time.perf_counter()
                while ctl.stage != AveragingStage.AWAITING_TRIGGER:
                    if ctl.done():
                        raise RuntimeError(f"matchmaking failed: {ctl.result()!r}")
                    time.sleep(0.002)
                conn.send(("grouped", time.perf_counter() - t0))
                if conn.recv()[0] != "go":  # "go" once all peers are grouped, else "stop"
                    break
                t1 = time.perf_counter()
                ctl.allow_allreduce()
                gathered = ctl.result(timeout=300)
                dt = time.perf_counter() - t1
                err = None
                if rank == 0 and first:  # relative RMS error of the 8-bit all-reduce vs the exact mean
                    exact = torch.stack([torch.cat(_make_tensors(numel, r)) for r in range(peers)]).mean(0)
                    with avg.get_tensors() as got:
                        err = float((torch.cat(got) - exact).norm() / exact.norm())
                first = False
                conn.send(("done", dt, len(gathered or {}), err))
            elif msg[0] == "load":
                key, deadline = f"{PREFIX}.all_averagers", time.monotonic() + 60
                while True:
                    found = dht.get(key, latest=True)
                    if found is not None and len(found.value) >= peers or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                t0 = time.perf_counter()
                loaded = avg.load_state_from_peers()
                dt = time.perf_counter() - t0
                want = _make_tensors(numel, STATE_SEED)
                ok = loaded is not None and len(loaded[1]) == len(want)
                ok = ok and all(map(torch.equal, loaded[1], want))
                conn.send(("done", dt, ok))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        _kill_tree(psutil.Process(), [p for p in (avg, dht) if p is not None and p.pid is not None])
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: torch's C++ threads can abort it ("terminate called ...")


@contextlib.contextmanager
def _spawn_context():
    """The spawn context; a multiprocessing resource tracker that it starts is stopped and reaped afterwards
    (an orphan would stay a zombie where PID 1 does not reap)."""
    tracker = mp.resource_tracker._resource_tracker
    was_running = tracker._pid is not None
    try:
        yield mp.get_context("spawn")
    finally:
        if not was_running and tracker._pid is not None:
            tracker._stop()


def _expect(conns: list, what: str, timeout: float) -> list[tuple]:
    """One message per connection, all of kind ``what``; the first error reported by any peer is raised."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < len(conns):
        ready = mp.connection.wait([c for c in conns if c not in got], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{len(conns) - len(got)} peer(s) sent no {what!r} within {timeout}s")
        for c in ready:
            msg = c.recv()
            if msg[0] == "error":
                raise RuntimeError(f"peer failed:\n{msg[1]}")
            if msg[0] != what:
                raise RuntimeError(f"expected {what!r}, got {msg!r}")
            got[c] = msg
    return [got[c] for c in conns]


def _stop(procs: list, conns: list) -> None:
    procs = [p for p in procs if p.pid is not None]  # started ones
    for c in conns:
        with contextlib.suppress(Exception):
            c.send(("stop",))
    for p in procs:
        p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(psutil.Error):
                _kill_tree(psutil.Process(p.pid), [])
            p.kill()
        p.join()
    for c in conns:
        c.close()


def _with_peers(roles: list[str], numel: int, peers: int, body):
    """Start one worker per role, bootstrap all DHTs from the first, wait for all averagers, run body(conns)."""
    assert numel % FRAGMENTS == 0, f"numel must be a multiple of {FRAGMENTS}"
    procs, conns = [], []
    with _spawn_context() as ctx, contextlib.ExitStack() as stack:
        stack.callback(_stop, procs, conns)
        for rank, role in enumerate(roles):
            mine, theirs = ctx.Pipe()
            procs.append(ctx.Process(target=_peer_main, args=(rank, role, numel, peers, theirs)))
            procs[-1].start()
            theirs.close()
            conns.append(mine)
        t0 = time.perf_counter()
        conns[0].send([])
        maddrs = _expect(conns[:1], "maddrs", 120)[0][1]
        for c in conns[1:]:
            c.send(maddrs)
        _expect(conns, "ready", 120)
        log(f"hivemind: {len(roles)} peers ready in {time.perf_counter() - t0:.1f}s")
        return body(conns)


def interleave(a: Callable[[], object], b: Callable[[], object], n: int) -> None:
    """Run `a` and `b` `n` times each in the order a b, b a, a b, ...: a machine that speeds up or slows down over
    the run moves both sides of a comparison alike."""
    for i in range(n):
        for f in (a, b) if i % 2 == 0 else (b, a):
            f()


def hivemind_allreduce_s(numel: int = 25_000_000, peers: int = 4, repeats: int = 3,
                         alongside: Callable[[], object] | None = None) -> float:
    """Median over `repeats` rounds of the slowest peer's all-reduce time, matchmaking excluded, after one
    warm-up round that is not counted (see module docstring). `alongside`: one round of another measurement,
    run `repeats` times interleaved with these in the order A B, B A, A B, ... (A = `alongside`, B = a
    hivemind round), so that both sides of a comparison see the same drift of a shared machine."""

    def body(conns):
        def one(label: str) -> float:
            for attempt in range(1, 5):
                for c in conns:
                    c.send(("step",))
                mm = [m[1] for m in _expect(conns, "grouped", 90)]
                for c in conns:
                    c.send(("go",))
                done = _expect(conns, "done", 300)
                sizes, err = [d[2] for d in done], [f"{d[3]:.4f}" for d in done if d[3] is not None]
                log(
                    f"hivemind: round {label} (attempt {attempt}): matchmaking {max(mm):.2f}s, all-reduce per "
                    f"peer {[round(d[1], 2) for d in done]}s, group sizes {sizes}, rel. RMS error vs exact mean {err}"
                )
                if all(s == peers for s in sizes):
                    return max(d[1] for d in done)
            raise RuntimeError(f"round {label} formed no group of {peers} in 4 attempts")

        one("warm-up")
        times: list[float] = []
        interleave(alongside or (lambda: None), lambda: times.append(one(str(len(times) + 1))), repeats)
        return statistics.median(times)

    return _with_peers(["avg"] * peers, numel, peers, body)


def hivemind_load_state_s(numel: int = 25_000_000, peers: int = 4, repeats: int = 1) -> float:
    """Time of load_state_from_peers() in a fifth peer, from call to return (see module docstring); the
    median of `repeats` loads by the same peer (fresh for the first only)."""

    def body(conns):
        times = []
        for _ in range(repeats):
            conns[-1].send(("load",))
            _, dt, ok = _expect(conns[-1:], "done", 300)[0]
            if not ok:
                raise RuntimeError("loaded state is missing or differs from the source tensors")
            log(f"hivemind: load_state_from_peers of {numel * 4 / 1e6:.0f} MB took {dt:.2f}s, verified")
            times.append(dt)
        return statistics.median(times)

    return _with_peers(["src"] * peers + ["dst"], numel, peers, body)


def _raw_receiver(nbytes: int, repeats: int, conn) -> None:
    view = memoryview(bytearray(nbytes))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn.send(srv.getsockname()[1])
        times = []
        for _ in range(repeats):
            s, _ = srv.accept()
            with s:
                t0, got = time.perf_counter(), 0
                while got < nbytes:
                    n = s.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                    got += n
                times.append(time.perf_counter() - t0)
                s.sendall(b"k")
        conn.send(times)


def _raw_sender(nbytes: int, repeats: int, port: int) -> None:
    data = os.urandom(nbytes)  # built before any connection, so never timed
    for _ in range(repeats):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(data)
            s.recv(1)


def raw_transfer_s(nbytes: int = 100_000_000, repeats: int = 3) -> float:
    """Median over repeats of accept() -> last byte received for nbytes over one loopback TCP socket."""
    with _spawn_context() as ctx, contextlib.ExitStack() as stack:
        mine, theirs = ctx.Pipe()
        procs = [ctx.Process(target=_raw_receiver, args=(nbytes, repeats, theirs))]
        stack.callback(_stop, procs, [mine, theirs])
        procs[0].start()
        if not mine.poll(60):
            raise TimeoutError("receiver did not start")
        procs.append(ctx.Process(target=_raw_sender, args=(nbytes, repeats, mine.recv())))
        procs[1].start()
        if not mine.poll(120):
            raise TimeoutError("raw transfer did not finish")
        times = mine.recv()
        log(f"raw: {nbytes / 1e6:.0f} MB per run: {[round(t, 3) for t in times]}s")
        return statistics.median(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nbytes", type=int, default=100_000_000)
    args = parser.parse_args()
    result, wall = {}, {}
    for name, fn in [
        ("raw_transfer_s", lambda: raw_transfer_s(args.nbytes, args.repeats)),
        ("hivemind_allreduce_s", lambda: hivemind_allreduce_s(args.numel, args.peers, args.repeats)),
        ("hivemind_load_state_s", lambda: hivemind_load_state_s(args.numel, args.peers)),
    ]:
        t0 = time.perf_counter()
        result[name] = fn()
        wall[name] = time.perf_counter() - t0
        log(f"{name}: {result[name]:.3f}s (function took {wall[name]:.1f}s)")
    print(json.dumps({**result, "wall_s": wall}))
