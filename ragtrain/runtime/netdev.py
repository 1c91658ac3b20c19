"""Bytes through this process's network interfaces (Linux /proc: the counters of the network namespace the process
runs in, so an index shard on an emulated node reads its node's link). What a refresh round moved is measured here."""

from __future__ import annotations

from pathlib import Path

NET_DEV = Path("/proc/self/net/dev")


def parse_net_dev(text: str) -> tuple[int, int]:
    """(received, sent) bytes summed over every interface of a /proc/net/dev table except loopback."""
    rx = tx = 0
    for line in text.splitlines()[2:]:  # two header lines
        name, _, fields = line.partition(":")
        if name.strip() == "lo" or not fields.strip():
            continue
        cols = fields.split()
        rx, tx = rx + int(cols[0]), tx + int(cols[8])
    return rx, tx


def interface_bytes(path: Path = NET_DEV) -> tuple[int, int] | None:
    """(received, sent) bytes of this process's network namespace so far; None where there is no /proc/net/dev."""
    try:
        return parse_net_dev(path.read_text())
    except OSError:
        return None
