"""Shared helpers for multi-peer tests: start real processes and always reap them."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Proc:
    """A child process whose stdout lines we can wait for, killed by pid when the test ends."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, cwd=REPO
        )
        self.lines: list[str] = []
        self.tail: collections.deque[str] | None = None  # the last lines, once `keep_reading` reads them
        self._buf = ""
        self._checked = 0

    def read_available(self) -> list[str]:
        """Lines printed since the last call, without blocking."""
        fd = self.popen.stdout.fileno()
        os.set_blocking(fd, False)
        new: list[str] = []
        while True:
            try:
                chunk = os.read(fd, 65536).decode("utf-8", "replace")
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
            *done, self._buf = self._buf.split("\n")
            new += done
        self.lines += new
        return new

    def keep_reading(self, keep: int = 400) -> None:
        """From now on a thread reads the output, for a child whose output no one waits on again: a full pipe
        would block it in its next `print` or log line. Only its last `keep` lines are kept (`tail`), for a
        failing test to show."""
        self.tail = collections.deque(self.lines[-keep:], maxlen=keep)

        def read() -> None:
            with contextlib.suppress(OSError, ValueError):
                os.set_blocking(self.popen.stdout.fileno(), True)
                for raw in self.popen.stdout:
                    self.tail.append(raw.decode("utf-8", "replace").rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()

    def last_lines(self) -> list[str]:
        """What it printed lately: `tail` once `keep_reading` started, else every line read so far."""
        return list(self.tail) if self.tail is not None else self.lines

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Read output until a line matches `pattern`; fail with what was seen if it never does."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        checked = self._checked
        while time.monotonic() < deadline:
            self.read_available()
            for i in range(checked, len(self.lines)):
                if m := rx.search(self.lines[i]):
                    self._checked = i + 1
                    return m
            checked = len(self.lines)
            if self.popen.poll() is not None and not self.read_available():
                break
            time.sleep(0.05)
        tail = "\n".join(self.lines[-40:] + [self._buf])
        raise AssertionError(f"waited {timeout}s for {pattern!r}; exit code {self.popen.poll()}; output ended:\n{tail}")

    def events(self, name: str | None = None) -> list[dict]:
        """JSON-line events printed so far (`join --json`)."""
        self.read_available()
        out = []
        for line in self.lines:
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if name is None or ev.get("event") == name:
                    out.append(ev)
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco.node.cli", *args]


def feed(sink, body: bytes, cuts: list[int] = ()) -> None:
    """Hand `body` to a `bulk.BodySink` as a socket would: reads of the sizes in `cuts` (the rest in one
    read), each split where the sink's buffer ends; a sink with no room for what is still due is refused."""
    from diloco.protocol.errors import Malformed

    sink.begin(len(body))
    at = 0
    for n in [*cuts, len(body)]:
        while n and at < len(body):
            view = sink.buffer()
            k = min(len(view), n, len(body) - at)
            if not k:
                raise Malformed("the sink has no room for what is still due")
            view[:k] = body[at : at + k]
            sink.advance(k)
            at, n = at + k, n - k
    sink.end()
