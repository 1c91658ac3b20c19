"""Resident memory of this process (Linux /proc; empty elsewhere): peaks reported by actors and benchmarks."""

from __future__ import annotations

from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM) in MB (Linux; 0.0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def rss_breakdown_mb() -> dict[str, float]:
    """This process's resident set now, by kind (Linux; {} elsewhere): anonymous (heap: what the process itself
    holds), file (mapped libraries) and shmem (shared memory, e.g. Ray's object store pages it touched), in MB."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key[3:].lower()] = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return out
