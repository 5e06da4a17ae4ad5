"""examples/multi_region: the latency relay on loopback, the requirement check, and (slow, root) a real run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multi_region"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"multi_region_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


relay_mod = _load("relay")
netns_mod = _load("netns")
sys.modules["netns"] = netns_mod  # run.py imports its sibling by name, as when run as a script
run_mod = _load("run")


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _within(coro, seconds: float, what: str):
    try:
        return await asyncio.wait_for(coro, seconds)
    except TimeoutError:
        pytest.fail(f"timed out after {seconds}s waiting for {what}")


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: bytes) -> float:
    start = time.monotonic()
    writer.write(msg)
    await writer.drain()
    got = await _within(reader.readexactly(len(msg)), 5, f"the echo of {msg!r}")
    assert got == msg
    return time.monotonic() - start


@pytest.mark.parametrize("latency,one_way_s", [(0.05, (0.05, 0.05)), (lambda host: (0.02, 0.08), (0.02, 0.08))])
async def test_relay_delays_each_direction_and_keeps_bytes_in_order(latency, one_way_s):
    server, port = await _echo_server()
    relay = relay_mod.Relay(("127.0.0.1", port), latency, max_buffer=64 * 1024)  # small: back-pressure kicks in
    _, rport = await relay.start("127.0.0.1", 0)
    rtt = sum(one_way_s)
    try:
        reader, writer = await _within(asyncio.open_connection("127.0.0.1", rport), 5, "connecting to the relay")
        first = await _round_trip(reader, writer, b"hello")  # also pays the emulated handshake
        assert first >= 2 * rtt - 0.005, f"first exchange took {first:.3f}s, expected ≥ {2 * rtt:.3f}s"
        for _ in range(3):
            took = await _round_trip(reader, writer, b"ping")
            assert rtt - 0.005 <= took < rtt + 0.5, f"round trip {took:.3f}s, expected about {rtt:.3f}s"

        payload = os.urandom(1024 * 1024 + 17)

        async def send() -> None:
            for i in range(0, len(payload), 50_000):  # many writes: chunks must not be reordered
                writer.write(payload[i:i + 50_000])
                await writer.drain()

        sender = asyncio.create_task(send())
        echoed = await _within(reader.readexactly(len(payload)), 30, "1 MiB echoed through the relay")
        await sender
        assert echoed == payload
        writer.write_eof()  # a half-close travels through the relay too
        assert await _within(reader.read(), 5, "EOF from the echo server through the relay") == b""
        writer.close()
    finally:
        await relay.close()
        server.close()
        await server.wait_closed()
    assert relay.connections == 1 and relay.failed == 0
    assert relay.bytes_up == relay.bytes_down == len(payload) + 5 + 3 * 4


def test_latency_matrix_forms():
    assert run_mod.parse_latency("40,80,120", 3) == [[0, 40, 80], [40, 0, 120], [80, 120, 0]]
    assert run_mod.parse_latency("25", 3) == [[0, 25, 25], [25, 0, 25], [25, 25, 0]]
    assert run_mod.parse_latency("0,10,20;30,0,40;50,60,0", 3) == [[0, 10, 20], [30, 0, 40], [50, 60, 0]]
    for bad in ("40,80", "a,b,c", "1,2;3,4", "-5"):
        with pytest.raises(run_mod.SetupError):
            run_mod.parse_latency(bad, 3)
    fn = relay_mod.matrix_latency({"10.0.0.2": 2}, [[0, 10, 20], [30, 0, 40], [50, 60, 0]], server_region=0)
    assert fn("10.0.0.2") == (0.05, 0.02) and fn("192.0.2.1") == (0.0, 0.0)


def test_requirements_are_named():
    assert netns_mod.missing_requirements(which=lambda t: f"/sbin/{t}", euid=lambda: 0) is None
    msg = netns_mod.missing_requirements(which=lambda t: None if t == "tc" else "/sbin/ip", euid=lambda: 1000)
    assert "root" in msg and "`tc`" in msg and "`ip`" not in msg and "\n" not in msg


def test_exits_with_one_line_when_ip_is_missing(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(EXAMPLE / "run.py"), "--seconds", "5"], capture_output=True, text=True,
                       env={**os.environ, "PATH": str(empty)}, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {r.stderr!r}"
    assert "`ip`" in lines[0] and "iproute2" in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _can_build_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return f"needs iproute2: {', '.join(missing)} not on PATH" if missing else None


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.skipif(_can_build_namespaces() is not None, reason=_can_build_namespaces() or "")
def test_real_run_reports_and_cleans_up(tmp_path):
    prefix = f"dnmr-test{os.getpid()}"
    assert not [n for n in _netns_names() if n.startswith(prefix)]
    proc = subprocess.Popen([sys.executable, str(EXAMPLE / "run.py"), "--seconds", "35", "--json", "--prefix", prefix,
                             "--workdir", str(tmp_path / "work")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the example cleans up on SIGTERM
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"run.py did not finish within 300s; stdout tail: {out[-2000:]} stderr: {err[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"run.py exited {proc.returncode}: {err[-3000:]}\n{out[-3000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary) == {"goodput", "bytes_per_step", "staleness_mean", "staleness_max", "regions", "rate_mbit",
                            "latency_ms", "seconds"}
    assert summary["regions"] == 3 and summary["rate_mbit"] == 20 and summary["seconds"] == 35
    assert summary["latency_ms"] == [[0, 40, 80], [40, 0, 120], [80, 120, 0]]
    assert 0 < summary["goodput"] <= 1
    assert summary["bytes_per_step"] > 0
    assert summary["staleness_mean"] is not None and 0 <= summary["staleness_mean"] <= summary["staleness_max"]
    left = [n for n in _netns_names() if n.startswith(prefix)]
    assert not left, f"namespaces left behind: {left}"
