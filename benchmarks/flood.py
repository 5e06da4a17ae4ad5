"""Flood benchmark: does a stranger's junk slow a learner's training? (protocol/limits.py, docs/security.md)

    python benchmarks/flood.py [--quick]

A real swarm of 3 learner processes (`diloco-node join`, the built-in tiny-GPT task, an `allowlist` run: TLS
and signed reads, one torch thread each) trains; after a warm-up, a clean window; then two flooder processes
(this file, `--flooder`; one asyncio loop does not send 1,000 TLS requests a second here) send junk at one
learner (the target) for 30 s (10 s with --quick) while another learner (the control) is left alone; then,
once the flooders are gone, a second clean window as long as the first (clean, flood, clean: a drift of the
two learners' relative speed through the run, which on this machine moves it by up to 10%, cancels out
instead of counting for or against the flood). The
flood, every kind at once, from other loopback addresses (127.0.0.2 ... : distinct hosts to the limits, which
key on the source address):

  - RATE junk requests per second in all (1,000 by default) from 127.0.0.2-5, in turn: garbage bytes (not
    HTTP, not TLS: a fresh plain connection each), malformed envelopes, unsigned envelopes claiming a member's
    key (the run's keys are in its spec), wrong run id, non-member (a stranger's signed envelope), an unsigned
    read (GET of a fragment), an oversized declared Content-Length, and slow-loris bodies (a few bytes, then
    one a second; at most 50 at a time per flooder). All but garbage go over TLS, on connections the flooder
    keeps and reuses while the peer lets it (a new TLS connection per request would cost the flooder more than
    the peer);
  - 500 concurrent idle connections (100 from each of 127.0.0.6-10), reopened when closed.

Keys of the last JSON line:
  steps_per_s_clean / control_clean   the target's / the control's inner steps/s in the clean windows (mean of
                         the two)
  steps_per_s_flood / control_flood   the same during the flood
  ratio                  (target_flood / control_flood) / the mean of (target_clean / control_clean) over the
                         two clean windows: 1 = the flood costs the target nothing the control does not also
                         lose (the machine's shared CPU); >= 0.90. `clean_relation_before` and
                         `clean_relation_after` are the two windows' relations (an after-effect of the flood
                         would show in the second), `ratio_vs_before` the ratio against the first alone
  requests_sent          junk requests the flooder started (idle connections not counted)
  requests_refused       of those, answered with an error status or closed without an answer
  peak_rss_growth_mb     the target's peak RSS during the flood − its RSS when the flood started (MiB); <= 64
  (also: what the refusals were, the control's RSS growth, the honest requests per second a learner served and
  the connections it opened in the clean window, whether any learner logged a refusal of an honest peer
  (127.0.0.1), how many refusal lines the target logged, and CPU seconds per second of the target's threads:
  "main" trains, the busiest other one is the swarm's event loop)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NUMBA_NUM_THREADS": "1"}
LEARNERS = 3
JUNK_SOURCES = [f"127.0.0.{i}" for i in range(2, 6)]
IDLE_SOURCES = [f"127.0.0.{i}" for i in range(6, 11)]
IDLE = 500
SLOW_AT_ONCE = 50  # per flooder process
FLOODERS = 2  # processes: one asyncio loop does not send 1,000 TLS requests a second on this machine


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when this benchmark process dies, however it dies."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Child:
    """A child process whose JSON lines on stdout are collected by a thread; stderr goes to a file."""

    def __init__(self, args: list[str], stderr: Path) -> None:
        self.err = stderr.open("wb")
        self.proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=ENV, cwd=HERE.parent, preexec_fn=_die_with_parent)
        self.events: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                with self._cv:
                    self.events.append(ev)
                    self._cv.notify_all()

    def wait_event(self, name: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for ev in self.events:
                    if ev.get("event") == name:
                        return ev
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.proc.args[1:4]} gave no {name!r} event (exit {self.proc.poll()})")
                self._cv.wait(0.5)

    def steps_per_s(self, t0: float, t1: float) -> float:
        prog = [e for e in list(self.events) if e.get("event") == "progress" and t0 <= e["t"] <= t1]
        if len(prog) < 2:
            raise RuntimeError(f"fewer than 2 progress events in [{t0:.0f}, {t1:.0f}]")
        return (prog[-1]["step"] - prog[0]["step"]) / (prog[-1]["t"] - prog[0]["t"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class RssSampler:
    def __init__(self, pids: list[int], every_s: float = 0.2) -> None:
        self.samples: dict[int, list[tuple[float, float]]] = {p: [] for p in pids}
        self._stop = threading.Event()
        self._every = every_s
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, s in self.samples.items():
                try:
                    s.append((time.time(), rss_mb(pid)))
                except (OSError, AttributeError):
                    pass
            self._stop.wait(self._every)

    def growth(self, pid: int, t0: float, t1: float) -> float:
        s = self.samples[pid]
        before = [r for t, r in s if t <= t0]
        during = [r for t, r in s if t0 <= t <= t1]
        return max(during) - before[-1]

    def stop(self) -> None:
        self._stop.set()


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`: "main" (the training loop) and the others by tid
    (Python names no OS thread: the busiest other one is the swarm's loop)."""
    out: Counter[str] = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = "main" if int(tid) == pid else f"tid {tid}"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def cpu_per_s(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: round((b.get(k, 0.0) - a.get(k, 0.0)) / seconds, 3) for k in b if b.get(k, 0.0) - a.get(k, 0.0) > 0.01}


def served_requests(url: str, key: Path, spec: Path) -> tuple[int, dict[str, int], int]:
    """Requests the peer at `url` served so far, in all and per route (its /v1/status: a member's signed read)."""
    from diloco.coordinator.runspec import Genesis
    from diloco.protocol.identity import Identity
    from diloco.protocol.reads import ReadSigner
    from diloco.protocol.transport import PeerClient

    async def fetch() -> dict:
        signer = ReadSigner(Identity.load(key), Genesis.load(spec).spec.run_id)
        async with PeerClient(tls=True, read_signer=signer, retries=1) as client:
            return json.loads(await client.request("GET", url, "/v1/status", deadline_s=10))

    st = asyncio.run(fetch())
    served = st.get("bytes", {}).get("served", {})
    per_route = {route: c["requests"] for route, c in served.items()}
    return sum(per_route.values()), per_route, st.get("connections_opened", 0)


# -- the swarm -----------------------------------------------------------------------------------------------


def make_run(tmp: Path) -> tuple[Path, list[Path]]:
    from diloco.node.train import new_run
    from diloco.protocol.identity import Identity

    keys = [Identity.generate() for _ in range(LEARNERS)]
    paths = [k.save(tmp / f"learner{i}.pem") for i, k in enumerate(keys)]
    spec = tmp / "flood.spec"
    new_run(Identity.generate(), "flood-bench", membership="allowlist",
            allowlist=tuple(k.public_key for k in keys)).save(spec)
    return spec, paths


def start_swarm(tmp: Path, spec: Path, keys: list[Path]) -> list[Child]:
    def join(i: int, peers: list[str]) -> Child:
        args = ["-m", "diloco.node.cli", "join", "--run", str(spec), "--listen", "127.0.0.1:0", "--json",
                "--key", str(keys[i]), "--progress-every", "5", "--fast-membership",
                *[a for p in peers for a in ("--peers", p)]]
        return Child(args, tmp / f"learner{i}.log")

    first = join(0, [])
    url = first.wait_event("joined")["url"]
    rest = [join(i, [url]) for i in range(1, LEARNERS)]
    for c in rest:
        c.wait_event("joined")
    return [first, *rest]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows (about two minutes)")
    ap.add_argument("--rate", type=float, default=1000.0, help="junk requests per second")
    ap.add_argument("--flooder", nargs=4, metavar=("URL", "SPEC", "SECONDS", "IDLE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flooder:
        url, spec, seconds, idle = args.flooder
        asyncio.run(flood(url, Path(spec), float(seconds), args.rate, int(idle)))
        return
    warm_s, clean_s, flood_s = (20, 15, 10) if args.quick else (30, 30, 30)
    children: list[Child] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        try:
            spec, keys = make_run(tmp)
            children = start_swarm(tmp, spec, keys)
            target, control = children[1], children[2]
            turl = target.wait_event("joined")["url"]
            curl = control.wait_event("joined")["url"]
            sampler = RssSampler([target.proc.pid, control.proc.pid])
            log(f"swarm of {LEARNERS} up; target {turl}, control {curl}; warm-up {warm_s}s")
            time.sleep(warm_s)
            c0, _, k0 = served_requests(curl, keys[0], spec)
            t_clean0 = time.time()
            cpu0, w0 = thread_cpu_s(target.proc.pid), time.monotonic()
            time.sleep(clean_s)
            t_clean1 = time.time()
            cpu1, w1 = thread_cpu_s(target.proc.pid), time.monotonic()
            c1, routes, k1 = served_requests(curl, keys[0], spec)
            honest_rate = (c1 - c0) / (t_clean1 - t_clean0)
            honest_conns = (k1 - k0) / (t_clean1 - t_clean0)
            log(f"clean window: the control served {honest_rate:.1f} requests/s (all from 127.0.0.1); "
                f"per route so far: {routes}")
            flooders = [Child([str(Path(__file__).resolve()), "--rate", str(args.rate / FLOODERS), "--flooder", turl,
                               str(spec), str(flood_s), str(IDLE // FLOODERS)], tmp / f"flooder{i}.log")
                        for i in range(FLOODERS)]
            children += flooders
            started = max((f.wait_event("started", timeout=60) for f in flooders), key=lambda e: e["t"])
            cpu2, w2 = thread_cpu_s(target.proc.pid), time.monotonic()
            time.sleep(flood_s - 1)
            cpu3, w3 = thread_cpu_s(target.proc.pid), time.monotonic()
            reports = [f.wait_event("done", timeout=flood_s + 120) for f in flooders]
            for f in flooders:  # (their idle connections close with them)
                f.stop()
            time.sleep(2.0)
            t_after0 = time.time()
            time.sleep(clean_s)
            t_after1 = time.time()
            outcomes: Counter[str] = Counter()
            for r in reports:
                outcomes.update(r["outcomes"])
            report = {"t_start": started["t"], "t_end": min(r["t_end"] for r in reports),
                      "sent": sum(r["sent"] for r in reports), "refused": sum(r["refused"] for r in reports),
                      "idle_held": sum(r["idle_held"] for r in reports), "outcomes": dict(sorted(outcomes.items())),
                      "cpu_s": sum(r["cpu_s"] for r in reports)}
            t_flood0, t_flood1 = started["t"] + 1.0, report["t_end"]  # (1 s for the idle connections to settle)
            sampler.stop()
            tc, cc = target.steps_per_s(t_clean0, t_clean1), control.steps_per_s(t_clean0, t_clean1)
            ta, ca = target.steps_per_s(t_after0, t_after1), control.steps_per_s(t_after0, t_after1)
            tf, cf = target.steps_per_s(t_flood0, t_flood1), control.steps_per_s(t_flood0, t_flood1)
            clean_relation = (tc / cc + ta / ca) / 2
            for c in children:
                c.stop()
            logs = [(tmp / f"learner{i}.log").read_text() for i in range(LEARNERS)]
            honest_refusals = sum(len(re.findall(r"refused .* from 127\.0\.0\.1 ", text)) for text in logs)
            target_lines = len(re.findall(r"refused .* from 127\.0\.0\.", logs[1]))  # (one every 10 s at most)
            result = {
                "steps_per_s_clean": (tc + ta) / 2, "steps_per_s_flood": tf, "control_clean": (cc + ca) / 2,
                "control_flood": cf, "ratio": (tf / cf) / clean_relation, "requests_sent": report["sent"],
                "requests_refused": report["refused"],
                "peak_rss_growth_mb": sampler.growth(target.proc.pid, started["t"], t_flood1),
                "control_rss_growth_mb": sampler.growth(control.proc.pid, started["t"], t_flood1),
                "refusals": report["outcomes"], "idle_connections_held": report["idle_held"],
                "honest_requests_per_s": honest_rate, "honest_connections_opened_per_s": honest_conns, "honest_refusal_lines": honest_refusals,
                "target_refusal_log_lines": target_lines,
                "flood_s": report["t_end"] - report["t_start"],
                "target_cpu_per_s_clean": cpu_per_s(cpu0, cpu1, w1 - w0),
                "target_cpu_per_s_flood": cpu_per_s(cpu2, cpu3, w3 - w2),
                "flood_requests_per_s": sum(r["sent"] / (r["t_end"] - r["t_start"]) for r in reports),
                "flooder_cpu_per_s": report["cpu_s"] / (report["t_end"] - report["t_start"]),
                "clean_relation_before": tc / cc, "clean_relation_after": ta / ca,
                "ratio_vs_before": (tf / cf) / (tc / cc),
            }
        finally:
            for c in children:
                c.stop()
    log(f"ratio {result['ratio']:.3f} (target >= 0.90); peak RSS growth {result['peak_rss_growth_mb']:.1f} MiB "
        f"(target <= 64); {result['requests_refused']} of {result['requests_sent']} junk requests refused")
    print(json.dumps(result))


# -- the flooder (another process) ---------------------------------------------------------------------------


def junk_requests(host: str, spec_path: Path) -> dict[str, list[bytes]]:
    """Pre-built junk of every kind (timestamps are fresh for a minute: longer than a flood)."""
    from diloco.coordinator.runspec import Genesis
    from diloco.coordinator.wire import DELTA
    from diloco.protocol.envelope import _PREFIX, seal
    from diloco.protocol.identity import Identity

    spec = Genesis.load(spec_path).spec
    run_id, member = spec.run_id, spec.allowlist[0]
    stranger = Identity.generate()

    def post(path: str, body: bytes, length: int | None = None) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\n\r\n")
        return head.encode() + body

    def unsigned_as_member(i: int) -> bytes:  # a stranger's frame with a member's key and no valid signature
        env = seal(stranger, DELTA, run_id, {"p": 0}, os.urandom(64))
        from diloco.protocol import canonical

        h = canonical.unpackb(env.header)
        h["sender"] = member
        header = canonical.packb(h)
        return _PREFIX.pack(len(header)) + header + os.urandom(64) + bytes(env.payload)

    paths = ["/v1/delta", "/v1/update", "/v1/replicate", "/v1/dht", "/v1/reach"]
    return {
        "garbage": [os.urandom(300) for _ in range(16)],
        "malformed": [post(random.choice(paths), os.urandom(200)) for _ in range(16)],
        "unsigned": [post("/v1/delta", unsigned_as_member(i)) for i in range(16)],
        "wrong_run": [post("/v1/delta", seal(stranger, DELTA, os.urandom(32), {"p": 0}, os.urandom(64)).to_bytes())
                      for _ in range(16)],
        "non_member": [post("/v1/delta", seal(stranger, DELTA, run_id, {"p": 0}, os.urandom(64)).to_bytes())
                       for _ in range(16)],
        "oversized": [post("/v1/delta", os.urandom(1000), length=10**11) for _ in range(4)],
        "unsigned_read": [f"GET /v1/fragment/0 HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()],
        "slow_loris": [post("/v1/delta", b"\0\0", length=65536)],
    }


async def _answer(reader: asyncio.StreamReader, timeout: float) -> tuple[str, bool]:
    """The status of one HTTP answer (its body read), and whether the connection may carry another request."""
    try:
        async with asyncio.timeout(timeout):
            head = await reader.readuntil(b"\r\n\r\n")
            m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
            if not m:
                return "closed", False
            n = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            await reader.readexactly(int(n.group(1)) if n else 0)
            return m.group(1).decode(), b"connection: close" not in head.lower()
    except TimeoutError:
        return "no answer", False
    except asyncio.IncompleteReadError as e:
        return ("closed" if not e.partial else "closed mid-answer"), False
    except (ConnectionError, asyncio.LimitOverrunError, ssl.SSLError):
        return "reset", False


async def flood(url: str, spec: Path, seconds: float, rate: float, n_idle: int) -> None:
    from diloco.protocol.tls import client_context

    tls = client_context() if url.startswith("https://") else None  # (a private run: every kind but garbage in TLS)
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    junk = junk_requests(host, spec)
    kinds = [k for k in junk if k != "slow_loris"]
    outcomes: Counter[str] = Counter()
    sent = 0
    slow = 0
    held: list[asyncio.StreamWriter] = []
    stop = asyncio.Event()
    tasks: set[asyncio.Task] = set()
    # a flooder keeps its TLS connections and sends its junk on them one request after the other (a new TLS
    # connection per request would cost it more than the peer); garbage goes on a fresh plain connection each
    pools: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {s: [] for s in JUNK_SOURCES}

    async def one(kind: str, source: str) -> None:
        conn = pools[source].pop() if kind != "garbage" and pools[source] else None
        if conn is None:
            try:
                conn = await asyncio.wait_for(asyncio.open_connection(
                    host, int(port), local_addr=(source, 0), ssl=None if kind == "garbage" else tls), 2)
                outcomes["connections opened"] += 1
            except (OSError, TimeoutError) as e:
                outcomes[f"{kind} {'connect failed' if isinstance(e, TimeoutError) else 'closed at accept'}"] += 1
                return
        reader, writer = conn
        try:
            writer.write(random.choice(junk[kind]))
            status, keep = await _answer(reader, 5)
        except ConnectionError:
            status, keep = "reset", False
        outcomes[f"{kind} {status}"] += 1
        if keep and kind not in ("garbage", "oversized") and not stop.is_set():
            pools[source].append(conn)
        else:
            writer.transport.abort()

    async def slow_loris(source: str) -> None:
        nonlocal slow
        slow += 1
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port), local_addr=(source, 0), ssl=tls), 3)
        except (OSError, TimeoutError) as e:
            outcomes[f"slow_loris {'connect failed' if isinstance(e, TimeoutError) else 'closed at accept'}"] += 1
            slow -= 1
            return
        try:
            writer.write(junk["slow_loris"][0])
            status = None
            for _ in range(60):  # a byte a second, until the peer answers or closes
                try:
                    line = await asyncio.wait_for(reader.readline(), 1.0)
                    m = re.match(rb"HTTP/1\.[01] (\d{3})", line)
                    status = m.group(1).decode() if m else "closed"
                    break
                except TimeoutError:
                    writer.write(b"\0")
                except ssl.SSLError:
                    status = "reset"
                    break
            outcomes[f"slow_loris {status or 'held 60 s'}"] += 1
        except ConnectionError:
            outcomes["slow_loris reset"] += 1
        finally:
            slow -= 1
            writer.transport.abort()

    async def idle(source: str) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.5)
                continue
            held.append(writer)
            try:
                await reader.read(1)  # until the peer closes it
            except ConnectionError:
                pass
            held.remove(writer)
            writer.transport.abort()
            outcomes["idle closed by the peer"] += 1
            await asyncio.sleep(0.1)

    def spawn(coro) -> None:
        t = asyncio.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    idlers = [asyncio.create_task(idle(IDLE_SOURCES[i % len(IDLE_SOURCES)])) for i in range(n_idle)]
    await asyncio.sleep(1.0)
    t_start, cpu_start = time.time(), time.process_time()
    print(json.dumps({"event": "started", "t": t_start, "idle_held": len(held)}), flush=True)
    t0 = time.monotonic()
    i = 0
    while (now := time.monotonic()) - t0 < seconds:
        due = int((now - t0) * rate) - i
        for _ in range(max(0, due)):
            i += 1
            if len(tasks) > 8000:  # (the flooder's own sockets: do not run out of them)
                outcomes["not sent (flooder busy)"] += 1
                continue
            if i % 8 == 7:
                if slow < SLOW_AT_ONCE:
                    spawn(slow_loris(JUNK_SOURCES[i % len(JUNK_SOURCES)]))
                else:
                    spawn(one(kinds[i % len(kinds)], JUNK_SOURCES[i % len(JUNK_SOURCES)]))
            else:
                spawn(one(kinds[i % len(kinds)], JUNK_SOURCES[i % len(JUNK_SOURCES)]))
            sent += 1
        await asyncio.sleep(0.005)
    t_end = time.time()
    idle_held = len(held)
    stop.set()
    in_flight = list(tasks)
    if in_flight:  # (the answers still due: up to the 5 s an answer may take)
        await asyncio.wait(in_flight, timeout=6)
    outcomes["unfinished at the end"] += sum(not t.done() for t in in_flight)
    for t in idlers:
        t.cancel()
    for w in [*held, *(w for pool in pools.values() for _, w in pool)]:
        w.transport.abort()
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, *idlers, return_exceptions=True)
    refused = sum(n for k, n in outcomes.items() if re.search(r" ([45]\d\d|reset|closed|closed at accept|closed mid-answer)$", k))
    print(json.dumps({"event": "done", "t_start": t_start, "t_end": t_end, "sent": sent, "refused": refused,
                      "cpu_s": time.process_time() - cpu_start,
                      "idle_held": idle_held, "outcomes": dict(sorted(outcomes.items()))}), flush=True)


if __name__ == "__main__":
    main()
