"""Network namespaces, veth links and tbf shaping for the emulated cluster (`python -m ragtrain.cluster`).

Every node is a network namespace `rtc-<name>-n<i>` whose only interface `eth0` is one end of a veth pair; the
other end sits on a bridge in the switch namespace `rtc-<name>-sw`. The subnet (SUBNET) exists only inside these
namespaces: no default route, no NAT, nothing in the host's root namespace. A link is shaped in both directions by
one tbf qdisc on each end of its veth pair (egress only is what tbf can shape; the two ends' egress are the two
directions). With machines (`nodes_per_machine` > 1), each machine is its own bridge in the switch namespace,
joined to the top bridge by an uplink veth pair shaped at the inter-machine rate, while the nodes' own links carry
the intra-machine rate: traffic between machines crosses both, traffic inside a machine only the nodes' links.

Processes are found by namespace (`ip netns pids`), never by name, so teardown touches only what runs inside.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "SUBNET",
    "Link",
    "NodeLink",
    "cluster_namespaces",
    "delete_network",
    "effective_capabilities",
    "make_network",
    "missing_requirement",
    "namespace_pids",
    "parse_rate",
    "stop_processes",
]

SUBNET = "10.237.0"  # /24, only ever configured inside the namespaces made here
HOST_OFFSET = 10  # node i is SUBNET.(10 + i)
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21  # network and mount namespaces, the private /tmp mount
TOOLS = ("ip", "tc", "unshare", "nsenter")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: str) -> int:
    """'100mbit' -> 100_000_000 bits/s (tc's decimal units); ValueError on anything else."""
    m = _RATE.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a rate like 100mbit, 1gbit, 500kbit")
    bits = int(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if bits < 8_000:
        raise ValueError(f"{text!r} is below 8kbit")
    return bits


def effective_capabilities() -> int:
    """This process's effective capability set (CapEff of /proc/self/status) as a bit mask."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def _tbf_works() -> str | None:
    """Try tbf and a veth pair inside a throw-away anonymous network namespace (gone when the probe exits): nothing
    named is created. None when both work, else why not."""
    probe = (
        "ip link set lo up && tc qdisc add dev lo root tbf rate 1mbit burst 16kb latency 50ms && "
        "ip link add rtcprobe0 type veth peer name rtcprobe1 && ip link add rtcprobebr type bridge"
    )
    r = subprocess.run(["unshare", "--net", "sh", "-c", probe], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["no detail"])[-1]


def missing_requirement(
    read_caps: Callable[[], int] = effective_capabilities,
    which: Callable[[str], str | None] = shutil.which,
    tbf_works: Callable[[], str | None] = _tbf_works,
) -> str | None:
    """One line saying why an emulated cluster cannot be made here, or None. Runs before anything is created."""
    for tool in TOOLS:
        if which(tool) is None:
            return f"`{tool}` is not on PATH (iproute2 and util-linux are needed)"
    caps = read_caps()
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not caps >> bit & 1:
            return f"needs root ({name} is missing): network namespaces, veth links and tbf need it"
    why = _fail_line(tbf_works)
    return None if why is None else f"the tbf qdisc, veth or bridge links are not available here: {why}"


def _fail_line(check: Callable[[], str | None]) -> str | None:
    try:
        return check()
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


def _shape(ns: str, dev: str, bits: int | None) -> None:
    """tbf at `bits`/s on `dev`'s egress. burst >= rate/HZ is tbf's floor; rate/100 is that for HZ >= 100."""
    if bits is None:
        return
    burst = max(bits // 8 // 100, 16 * 1024)
    cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf"]
    cmd += ["rate", f"{bits}bit", "burst", str(burst), "latency", "200ms"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


@dataclass(frozen=True)
class NodeLink:
    """One node's place in the network."""

    ns: str  # its network namespace
    address: str  # of eth0 in it
    machine: int  # which emulated machine it belongs to


@dataclass(frozen=True)
class Link:
    """A shaped link: its name (where it is) and the rate asked, bits/s (None: not shaped)."""

    name: str
    bits: int | None


def cluster_namespaces(name: str) -> list[str]:
    """Every namespace of cluster `name` that exists now (node namespaces first, the switch last)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in out.splitlines() if line.startswith(f"rtc-{name}-")]
    return sorted(found, key=lambda ns: ns.endswith("-sw"))


def make_network(
    name: str, nodes: int, per_machine: int, inter: int | None, intra: int | None
) -> tuple[list[NodeLink], list[Link]]:
    """Switch namespace, bridges, one namespace per node with its shaped veth. On a failure the caller tears down."""
    sw = f"rtc-{name}-sw"
    _ip("netns", "add", sw)
    _ip("link", "set", "lo", "up", ns=sw)
    _ip("link", "add", "br0", "type", "bridge", ns=sw)
    _ip("link", "set", "br0", "up", ns=sw)
    links: list[Link] = []
    machines = (nodes + per_machine - 1) // per_machine
    if per_machine > 1:  # a bridge per machine, uplinked to br0 at the inter-machine rate
        for m in range(machines):
            _ip("link", "add", f"m{m}", "type", "bridge", ns=sw)
            _ip("link", "set", f"m{m}", "up", ns=sw)
            _ip("link", "add", f"u{m}a", "type", "veth", "peer", "name", f"u{m}b", ns=sw)
            _ip("link", "set", f"u{m}a", "master", f"m{m}", "up", ns=sw)
            _ip("link", "set", f"u{m}b", "master", "br0", "up", ns=sw)
            _shape(sw, f"u{m}a", inter)
            _shape(sw, f"u{m}b", inter)
            links.append(Link(f"machine{m} uplink", inter))
    node_rate = intra if per_machine > 1 else inter
    out = []
    for i in range(nodes):
        ns, machine = f"rtc-{name}-n{i}", i // per_machine
        address = f"{SUBNET}.{HOST_OFFSET + i}"
        _ip("netns", "add", ns)
        _ip("link", "add", f"n{i}", "type", "veth", "peer", "name", "eth0", "netns", ns, ns=sw)
        _ip("link", "set", f"n{i}", "master", f"m{machine}" if per_machine > 1 else "br0", "up", ns=sw)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _shape(sw, f"n{i}", node_rate)  # toward the node
        _shape(ns, "eth0", node_rate)  # from the node
        links.append(Link(f"n{i}", node_rate))
        out.append(NodeLink(ns, address, machine))
    return out, links


def namespace_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(namespaces: list[str], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for ns in namespaces for p in namespace_pids(ns)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def _reaped(pids: set[int], timeout_s: float) -> None:
    """Until each pid is gone from /proc: a process that is exiting has left its namespace before its parent reaps
    it. Our own children (the nodes' `ray start`) are reaped here; the rest by their parent (init)."""
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours
                pass
            if not os.path.exists(f"/proc/{pid}"):
                pids.discard(pid)
        time.sleep(0.1)


def stop_processes(namespaces: list[str], term_wait_s: float = 2.0) -> None:
    """SIGTERM every process in these namespaces, wait, SIGKILL what is left, wait until none is. Ray's GCS and
    `ray start --block` outlast a SIGTERM by 10 s and more while the rest has gone; their state dies with the
    node's tmpfs anyway, so the wait is short (each test module that makes a cluster pays it)."""
    seen = {p for ns in namespaces for p in namespace_pids(ns)}
    _signal_all(sorted(seen), signal.SIGTERM)
    left = _wait_gone(namespaces, term_wait_s)
    for _ in range(5):  # processes forked between the scans are caught by the next one
        if not left:
            _reaped(seen, 10.0)
            return
        seen.update(left)
        _signal_all(left, signal.SIGKILL)
        left = _wait_gone(namespaces, 5.0)
    raise RuntimeError(f"processes {left} in {namespaces} survived SIGKILL")


def delete_network(name: str) -> None:
    """Stop every process in the cluster's namespaces, then delete them (their veths and bridges go with them).
    Idempotent: what is already gone is skipped."""
    namespaces = cluster_namespaces(name)
    stop_processes(namespaces)
    for ns in namespaces:  # a node namespace takes its veth pair with it; the switch its bridges
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
