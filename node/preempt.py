"""Preemption notices: what tells a learner to drain (docs/preemption.md).

A spot or preemptible machine is told before it is taken away: SIGTERM from systemd, Kubernetes or the cloud's
agent, or a notice on the instance metadata endpoint (AWS: about two minutes ahead; GCP: about thirty
seconds). Each becomes one `Notice.request`; the training loop reads it at its next step boundary and drains
(`Learner.drain`: deltas sent, fragments handed over, `left` published, a final checkpoint). A second signal
while a notice is pending or the drain runs exits at once, with the shell's code for that signal (128 + its
number: 130 for SIGINT, 143 for SIGTERM).

The pollers run in a daemon thread with the standard library's HTTP client, apart from the swarm's loop: a
metadata endpoint that hangs or answers garbage delays nothing else. A poller error is logged once (and once
more when it recovers) and retried at the next poll; it never stops the learner.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

POLL_S = 5.0  # between two metadata reads
REQUEST_TIMEOUT_S = 2.0  # one metadata request (the endpoint is link-local: it answers in milliseconds)
AWS_TOKEN_TTL_S = 21600  # IMDSv2 session token lifetime asked for (the most AWS allows)
DEFAULT_METADATA_URL = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
METADATA_URL_ENV = "DILOCO_METADATA_URL"  # overrides the endpoint (tests run a fake one on loopback)


@dataclass
class DrainReport:
    """What a drain did, in order (the `drained` event of `join --json`, docs/preemption.md)."""

    reason: str = ""
    deltas_flushed: int = 0  # fragments whose unsent inner steps went out as deltas at the notice
    sends_waited: int = 0  # delta sends still in flight at the notice, waited for
    deltas_unmerged: int = 0  # deltas of this learner that an owner took but no version it received merged
    merged_steps: int = 0  # this learner's inner steps merged into versions (as `progress` reports it)
    final_rounds: int = 0  # outer steps its owned fragments took early, merging their pending deltas
    dropped_deltas: int = 0  # deltas its owned fragments took but neither merged nor got to their next owners
    passed_on: int = 0  # deltas taken after the early steps, forwarded to the fragments' next owners at the release
    handovers: list[dict] = field(default_factory=list)  # per fragment released: p, to, version, acked, skipped
    left: bool = False  # the member record marked `left` was stored
    checkpoint: bool | None = None  # the final checkpoint was written (None: no --checkpoint-dir)
    checkpoint_step: int | None = None
    skipped: list[str] = field(default_factory=list)  # what the deadline cut short
    seconds: float = 0.0  # from the notice to the end of the drain

    @property
    def handed_over(self) -> int:
        return sum(not h["skipped"] for h in self.handovers)

    @property
    def acked(self) -> int:
        return sum(bool(h["acked"]) for h in self.handovers)

    @property
    def complete(self) -> bool:
        return not self.skipped and self.checkpoint is not False

    def fields(self) -> dict:
        return {**asdict(self), "handed_over": self.handed_over, "acked": self.acked, "complete": self.complete}


class DrainIncomplete(Exception):
    """A drain ended without its final checkpoint: a restart resumes from the one before (and the journal)."""


class Notice:
    """A drain request, from a signal or a metadata poller: set once, read by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self.at: float | None = None  # time.monotonic() of the first request

    def request(self, reason: str) -> None:
        """Ask for a drain (any thread; a signal handler too). Only the first request counts."""
        if not self._event.is_set():
            self.reason, self.at = reason, time.monotonic()
            self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def exit_code(signum: int) -> int:
    """The exit status of a process ended by `signum` in a shell's terms: 128 + the signal's number."""
    return 128 + signum


ECHO_S = 5.0  # under torchrun: a signal this soon after the first is the same notice, forwarded


def install_signals(notice: Notice, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
                    echo_s: float = 0.0) -> Callable[[], None]:
    """SIGTERM and SIGINT become a drain request; a second one exits at once (`exit_code`), skipping every
    clean-up (the drain, the checkpoint, the summary). The first signal after a metadata notice only joins
    the drain that notice started (a preempted GCP machine is shut down, SIGTERM included, as the notice
    appears). A second signal within `echo_s` of the first is taken for the same one arriving twice (a rank
    under torchrun gets Ctrl-C's SIGINT, or systemd's SIGTERM to the whole group, and then the launcher's own
    SIGTERM): it is ignored. Main thread only (Python delivers signals there). A signal that is ignored now is
    left ignored. Returns a function that puts the previous handlers back."""
    first: list[float] = []

    def handler(signum: int, _frame: object) -> None:
        if first:
            if time.monotonic() - first[0] < echo_s:
                return
            os.write(2, f"second {signal.Signals(signum).name} during a drain: exiting now\n".encode())
            os._exit(exit_code(signum))
        first.append(time.monotonic())
        notice.request(signal.Signals(signum).name)

    # (a signal ignored when we started stays ignored: a shell's background job ignores SIGINT on purpose)
    old = {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) != signal.SIG_IGN}

    def undo() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return undo


class MetadataPoller:
    """Reads a cloud's instance metadata for a spot or preemption notice every `poll_s`, in a daemon thread,
    until it finds one (`notice.request`) or is stopped."""

    def __init__(self, cloud: str, notice: Notice, base_url: str | None = None, poll_s: float = POLL_S,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        if cloud not in DEFAULT_METADATA_URL:
            raise ValueError(f"unknown cloud {cloud!r}; choose one of {', '.join(DEFAULT_METADATA_URL)}")
        self.cloud, self.notice, self.poll_s, self.timeout_s = cloud, notice, poll_s, timeout_s
        self.base_url = (base_url or os.environ.get(METADATA_URL_ENV) or DEFAULT_METADATA_URL[cloud]).rstrip("/")
        self.polls = 0  # reads done (answered or not)
        self.errors = 0  # reads that failed
        self._token: str | None = None  # AWS IMDSv2 session token
        self._failing = False  # the last read failed (its error was logged)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MetadataPoller:
        self._thread = threading.Thread(target=self._run, name=f"diloco-{self.cloud}-notice", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s * 2 + 1)

    def _run(self) -> None:
        while not self._stop.is_set() and not self.notice.requested:
            found = self.poll_once()
            if found is not None:
                self.notice.request(found)
                return
            self._stop.wait(self.poll_s)

    def poll_once(self) -> str | None:
        """One read: the notice's description if there is one, else None. Never raises."""
        self.polls += 1
        try:
            found = self._aws() if self.cloud == "aws" else self._gcp()
        except Exception as e:  # noqa: BLE001 - a poller never stops the learner: logged once, retried
            self.errors += 1
            if not self._failing:
                log.warning("%s metadata at %s cannot be read (%s: %s); retrying every %.0f s", self.cloud,
                            self.base_url, type(e).__name__, e, self.poll_s)
            self._failing = True
            return None
        if self._failing:
            log.warning("%s metadata at %s answers again", self.cloud, self.base_url)
            self._failing = False
        return found

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.status, r.read(64 * 1024)
        except urllib.error.HTTPError as e:  # (an answer with an error status: the caller decides)
            with e:
                return e.code, e.read(64 * 1024)

    def _aws(self) -> str | None:
        """IMDSv2: a session token (PUT), then the spot instance action: 200 with JSON = a notice, 404 = none."""
        for _ in range(2):  # (a second try with a fresh token when the old one expired: 401)
            if self._token is None:
                status, body = self._request("PUT", "/latest/api/token",
                                             {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
                if status != 200:
                    raise RuntimeError(f"token request answered {status}")
                self._token = body.decode("ascii", "replace").strip()
            status, body = self._request("GET", "/latest/meta-data/spot/instance-action",
                                         {"X-aws-ec2-metadata-token": self._token})
            if status == 401:
                self._token = None
                continue
            if status == 404:
                return None
            if status != 200:
                raise RuntimeError(f"spot/instance-action answered {status}")
            action = json.loads(body)  # (a 200 that is not JSON is an error: retried, not taken as a notice)
            if not isinstance(action, dict):
                raise ValueError("spot/instance-action is not a JSON object")
            return f"aws spot interruption notice: {action.get('action', '?')} at {action.get('time', '?')}"
        raise RuntimeError("the metadata token was refused twice")

    def _gcp(self) -> str | None:
        """`instance/preempted` with `Metadata-Flavor: Google`: TRUE = preempted, FALSE = not."""
        status, body = self._request("GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if status != 200:
            raise RuntimeError(f"instance/preempted answered {status}")
        text = body.decode("ascii", "replace").strip().upper()
        if text not in ("TRUE", "FALSE"):
            raise ValueError(f"instance/preempted answered {text[:40]!r}, not TRUE or FALSE")
        return "gcp preemption notice" if text == "TRUE" else None


def watch(notice: Notice, cloud: str | None = None, metadata_url: str | None = None,
          echo_s: float = 0.0) -> Callable[[], None]:
    """What `join` listens to for a drain request: SIGTERM and SIGINT (from the main thread only: elsewhere
    Python cannot take signals, and Ctrl-C stays a KeyboardInterrupt; `echo_s`: `install_signals`), and
    `cloud`'s metadata endpoint if one is named. Returns the function that stops listening."""
    undo_signals = (install_signals(notice, echo_s=echo_s) if threading.current_thread() is threading.main_thread()
                    else None)
    poller = MetadataPoller(cloud, notice, metadata_url).start() if cloud else None

    def stop() -> None:
        if poller is not None:
            poller.stop()
        if undo_signals is not None:
            undo_signals()

    return stop
