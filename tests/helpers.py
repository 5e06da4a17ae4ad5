"""Shared helpers for multi-peer tests: start real processes and always reap them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Read output until a line matches `pattern`; fail with what was seen if it never does."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        fd = self.popen.stdout.fileno()
        os.set_blocking(fd, False)
        buf = ""
        while time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 65536).decode("utf-8", "replace")
            except BlockingIOError:
                chunk = ""
            if chunk:
                buf += chunk
                *done, buf = buf.split("\n")
                for line in done:
                    self.lines.append(line)
                    if m := rx.search(line):
                        return m
            elif self.popen.poll() is not None:
                if chunk == "":
                    break
            time.sleep(0.05)
        raise AssertionError(f"waited {timeout}s for {pattern!r}; output was:\n" + "\n".join(self.lines + [buf]))

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
