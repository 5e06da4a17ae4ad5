"""The emulated network of the multi-region example: a hub namespace, one namespace per region, a veth pair
and `tc tbf` on both ends of every region link, built with iproute2 and removed again.

Its own module because building and tearing down the network is one idea with one promise, apart from running
the learners on it (run.py): `Network.teardown()` deletes exactly the veth pairs and namespaces `build()`
created, by the names it recorded when it created them, never anything else. A deletion that fails is skipped,
not fatal, so it may run after a build that stopped half-way, and more than once. Nothing is added to, or
changed in, the machine's own network namespace.

Addresses: region i is 10.213.i.2 (`wan0`, in the region) and 10.213.i.1 (`r<i>`, in the hub). The hub does
not forward packets (checked), so a region reaches another region only via a process in the hub (relay.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

SUBNET = "10.213"  # region i: 10.213.i.2 (region side) — 10.213.i.1 (hub side); only inside our namespaces


class SetupError(Exception):
    """A one-line error for the user: what happened and what to do."""


def missing_requirements(which: Callable[[str], str | None] = shutil.which,
                         euid: Callable[[], int] = os.geteuid) -> str | None:
    """One line naming what is missing (root, `ip`, `tc`), or None when everything is there."""
    missing = []
    if euid() != 0:
        missing.append("root (run it with sudo)")
    for tool in ("ip", "tc"):
        if which(tool) is None:
            missing.append(f"`{tool}` on PATH (install iproute2)")
    if not missing:
        return None
    return ("multi_region: this example needs root and iproute2 (ip, tc) to build network namespaces; missing: "
            + ", ".join(missing))


def sh(*cmd: str) -> str:
    """Run a command to completion; its stdout, or a SetupError with the last line it wrote."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise SetupError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit {r.returncode}'}")
    return r.stdout


def hub_address(i: int) -> str:
    """Region i's address on the hub side of its link (where the relay listens for it)."""
    return f"{SUBNET}.{i}.1"


def region_address(i: int) -> str:
    """Region i's own address, inside its namespace."""
    return f"{SUBNET}.{i}.2"


class Network:
    """Namespaces `<prefix>-hub`, `<prefix>-r0` ...; each region linked to the hub at `rate_mbit` each way."""

    def __init__(self, prefix: str, regions: int, rate_mbit: float) -> None:
        self.n = regions
        self.rate_mbit = rate_mbit
        self.ip, self.tc = shutil.which("ip"), shutil.which("tc")
        self.hub = f"{prefix}-hub"
        self.regions = [f"{prefix}-r{i}" for i in range(regions)]
        self.created_ns: list[str] = []  # only these are ever deleted
        self.created_links: list[str] = []  # hub-side veth names (deleting one end deletes the pair)

    def exec_in(self, ns: str, cmd: list[str]) -> list[str]:
        """The command line that runs `cmd` inside namespace `ns`."""
        return [self.ip, "netns", "exec", ns, *cmd]

    def _add_ns(self, name: str) -> None:
        sh(self.ip, "netns", "add", name)
        self.created_ns.append(name)
        sh(self.ip, "-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        """Create the namespaces, links, addresses, routes and qdiscs; a SetupError on the first failure."""
        rate = f"{self.rate_mbit:g}mbit"
        burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.004))  # ≥ 4 ms of traffic, ≥ 32 KiB
        self._add_ns(self.hub)
        forwarding = sh(self.ip, "netns", "exec", self.hub, "cat", "/proc/sys/net/ipv4/ip_forward").strip()
        if forwarding != "0":  # a fresh namespace starts with forwarding off; all cross-region bytes use the relay
            raise SetupError(f"namespace {self.hub} forwards packets (ip_forward={forwarding}); expected 0")
        for i, ns in enumerate(self.regions):
            self._add_ns(ns)
            hub_if = f"r{i}"
            sh(self.ip, "-n", self.hub, "link", "add", hub_if, "type", "veth", "peer", "name", "wan0",
               "netns", ns)
            self.created_links.append(hub_if)
            sh(self.ip, "-n", self.hub, "addr", "add", f"{hub_address(i)}/24", "dev", hub_if)
            sh(self.ip, "-n", self.hub, "link", "set", hub_if, "up")
            sh(self.ip, "-n", ns, "addr", "add", f"{region_address(i)}/24", "dev", "wan0")
            sh(self.ip, "-n", ns, "link", "set", "wan0", "up")
            sh(self.ip, "-n", ns, "route", "add", f"{SUBNET}.0.0/16", "via", hub_address(i))
            for netns, dev in ((ns, "wan0"), (self.hub, hub_if)):  # both directions of the region's link
                sh(self.tc, "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", str(burst), "latency", "100ms")

    def teardown(self) -> None:
        """Delete the veth pairs, then the namespaces, that build() created (only those), newest first.

        Kill the processes running inside the namespaces first: `ip netns delete` only unmounts the name."""
        for hub_if in reversed(self.created_links):
            subprocess.run([self.ip, "-n", self.hub, "link", "del", hub_if], capture_output=True, timeout=30)
        self.created_links.clear()
        for ns in reversed(self.created_ns):
            subprocess.run([self.ip, "netns", "delete", ns], capture_output=True, timeout=30)
        self.created_ns.clear()
