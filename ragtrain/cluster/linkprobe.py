"""Measure one direction of an emulated link: a TCP receiver in one namespace, a sender in another.

Run as a script inside a namespace (it imports nothing from ragtrain, so it starts in a fraction of a second):
`python linkprobe.py recv ADDRESS PORT` prints `ready` once listening, then one JSON line {"bytes", "seconds"} timed
from the first byte to the end of the stream; `python linkprobe.py send ADDRESS PORT BYTES` sends that many bytes.
`measure` drives the pair from the host.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

__all__ = ["measure", "transfer_bytes"]

CHUNK = 1 << 20  # few system calls: a sender starved of CPU on a loaded machine still keeps the link busy


def transfer_bytes(bits: int | None, seconds: float = 0.8) -> int:
    """Bytes that take about `seconds` at `bits`/s (1 to 32 MB; unshaped: 32 MB). The tbf burst (1 % of a second)
    is then a few % of the transfer at most."""
    if bits is None:
        return 32 << 20
    return int(min(max(bits / 8 * seconds, 1 << 20), 32 << 20))


def _receive(address: str, port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port))
    server.listen(1)
    print("ready", flush=True)
    conn, _ = server.accept()
    first = conn.recv(CHUNK)
    start, got = time.perf_counter(), 0  # the first chunk only starts the clock: the rate is of what follows
    while True:
        data = conn.recv(CHUNK)
        if not data:
            break
        got += len(data)
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - start, "first": len(first)}), flush=True)


def _send(address: str, port: int, n: int) -> None:
    conn = socket.create_connection((address, port), timeout=60)
    block = b"\0" * CHUNK
    while n > 0:
        conn.sendall(block[: min(n, CHUNK)])
        n -= CHUNK
    conn.close()


def measure(src_ns: str, dst_ns: str, dst_address: str, bits: int | None, port: int = 47123) -> float:
    """Achieved bits/s of a transfer from namespace `src_ns` to `dst_address` in `dst_ns`."""
    me = [sys.executable, __file__]
    recv = subprocess.Popen(
        ["ip", "netns", "exec", dst_ns, *me, "recv", dst_address, str(port)], stdout=subprocess.PIPE, text=True
    )
    out = recv.stdout
    assert out is not None  # stdout=PIPE: Popen gives the pipe's reading end
    try:
        if out.readline().strip() != "ready":
            raise RuntimeError(f"the link probe's receiver in {dst_ns} did not start")
        n = transfer_bytes(bits)
        subprocess.run(["ip", "netns", "exec", src_ns, *me, "send", dst_address, str(port), str(n)], check=True)
        res = json.loads(out.readline())
        recv.wait(timeout=30)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    return res["bytes"] * 8 / max(res["seconds"], 1e-9)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        _receive(sys.argv[2], int(sys.argv[3]))
    else:
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
