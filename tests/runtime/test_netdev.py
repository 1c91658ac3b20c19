"""A network namespace's interface counters, as a refresh round reads them on each index node."""

from __future__ import annotations

from pathlib import Path

from ragtrain.runtime.netdev import interface_bytes, parse_net_dev

TABLE = """Inter-|   Receive                                                |  Transmit
 face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo colls carrier compressed
    lo: 5000 50    0    0    0     0          0         0 5000 50    0    0    0     0       0          0
  eth0: 1200 10    0    0    0     0          0         0 340 4    0    0    0     0       0          0
  veth1:    30 1    0    0    0     0          0         0 7 1    0    0    0     0       0          0
"""


def test_received_and_sent_bytes_add_up_every_interface_but_loopback() -> None:
    assert parse_net_dev(TABLE) == (1230, 347)


def test_this_namespace_has_counters_and_a_missing_table_is_none(tmp_path: Path) -> None:
    got = interface_bytes()
    assert got is not None and all(isinstance(x, int) and x >= 0 for x in got)
    assert interface_bytes(tmp_path / "absent") is None
