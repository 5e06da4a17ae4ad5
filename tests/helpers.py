"""Shared helpers for multi-peer tests: start real processes and always reap them."""

from __future__ import annotations

import codecs
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
    """A child process whose stdout lines we can wait for, killed by pid when the test ends.

    A thread reads its output as it comes, whoever looks at it: a child whose pipe fills (64 KB: a few hundred
    progress lines, or a burst of info logs) blocks in its next `print` or log line, its event loop with it, and
    a test that polls its status instead of its output would wait on a pause of its own making."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, cwd=REPO
        )
        self.lines: list[str] = []
        self.tail: collections.deque[str] | None = None  # the last lines, once `keep_reading` asked for only those
        self._buf = ""
        self._checked = 0
        self._read: list[str] = []  # text the reader took from the pipe that `read_available` has not split yet
        self._lock = threading.Lock()
        self._eof = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        fd = self.popen.stdout.fileno()
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(fd, 65536):
                text = decode(chunk)
                with self._lock:
                    if self.tail is None:
                        self._read.append(text)
                        continue
                    *done, self._buf = (self._buf + text).split("\n")
                    self.tail.extend(done)
        self._eof.set()

    def read_available(self) -> list[str]:
        """Lines printed since the last call, without blocking."""
        with self._lock:
            text, self._read = "".join(self._read), []
        if not text:
            return []
        self._buf += text
        *new, self._buf = self._buf.split("\n")
        self.lines += new
        return new

    def keep_reading(self, keep: int = 400) -> None:
        """From now on keep only the last `keep` lines (`tail`), for a child whose output no one waits on again
        (a long-lived one), for a failing test to show."""
        self.read_available()
        with self._lock:  # (what came meanwhile, then the reader's own lines, go to `tail` from here on)
            *done, self._buf = (self._buf + "".join(self._read)).split("\n")
            self._read = []
            self.lines += done
            self.tail = collections.deque(self.lines[-keep:], maxlen=keep)

    def last_lines(self) -> list[str]:
        """What it printed lately: `tail` once `keep_reading` started, else every line read so far."""
        if self.tail is None:
            self.read_available()
            return self.lines
        with self._lock:
            return list(self.tail)

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
            if self.popen.poll() is not None:
                self._eof.wait(0.5)  # (the reader drains what the child wrote before it exited)
                if not self.read_available():
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
