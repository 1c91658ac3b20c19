"""The emulated cluster's checks that run anywhere: rates, the privilege check (with stand-in readers), arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ragtrain.cluster import __main__ as emulated_main
from ragtrain.cluster import emulated, netns
from ragtrain.cluster.__main__ import write_links
from tests.conftest import REPO

ALL_CAPS = (1 << netns.CAP_NET_ADMIN) | (1 << netns.CAP_SYS_ADMIN)


def _tools(name: str) -> str:
    return f"/usr/sbin/{name}"


def test_rates_parse_in_tc_units() -> None:
    assert netns.parse_rate("100mbit") == 100_000_000
    assert netns.parse_rate("1.5Gbit") == 1_500_000_000
    assert netns.parse_rate("500kbit") == 500_000
    for bad in ("100", "100mb", "fast", "1kbit"):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)


def test_what_is_missing_is_one_line_found_before_anything_is_made() -> None:
    def ok() -> None:
        return None

    def never() -> None:
        raise AssertionError("tbf is probed only once the tools and capabilities are there")

    assert netns.missing_requirement(lambda: ALL_CAPS, _tools, ok) is None
    no_tc = netns.missing_requirement(lambda: ALL_CAPS, lambda n: None if n == "tc" else _tools(n), never)
    assert no_tc == "`tc` is not on PATH (iproute2 and util-linux are needed)"
    no_net = netns.missing_requirement(lambda: 1 << netns.CAP_SYS_ADMIN, _tools, never)
    assert no_net == "needs root (CAP_NET_ADMIN is missing): network namespaces, veth links and tbf need it"
    no_sys = netns.missing_requirement(lambda: 1 << netns.CAP_NET_ADMIN, _tools, never)
    assert no_sys is not None and "CAP_SYS_ADMIN is missing" in no_sys
    no_tbf = netns.missing_requirement(lambda: ALL_CAPS, _tools, lambda: "Specified qdisc kind is unknown.")
    assert no_tbf == "the tbf qdisc, veth or bridge links are not available here: Specified qdisc kind is unknown."


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["run", "--nodes", "0", "--", "true"], "'0' is not a positive integer"),
        (["run", "--nodes", "2", "--bandwidth", "fast", "--", "true"], "'fast' is not a rate"),
        (["run", "--nodes", "2", "--intra", "1gbit", "--", "true"], "--intra needs --workers-per-node > 1"),
        (["run", "--nodes", "2", "--storage", "/tmp", "--", "true"], "each node has its own /tmp"),
        (["run", "--nodes", "2"], "give the command after --"),
        (["up", "--nodes", "2", "--name", "Bad-Name"], "1-12 characters"),
        (["run", "--nodes", "2", "--node-resources", "index_node=1", "--", "true"], "is not NODE:NAME=AMOUNT"),
        (["run", "--nodes", "2", "--node-resources", "1:index_node=0", "--", "true"], "is not NODE:NAME=AMOUNT"),
        (["run", "--nodes", "2", "--node-resources", "2:index_node=1", "--", "true"], "there are nodes 0..1"),
        (["run", "--nodes", "2", "--node-resources", "1:CPU=2", "--", "true"], "are not custom resources"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], why: str) -> None:
    r = subprocess.run([sys.executable, "-m", "ragtrain.cluster", *args], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert why in r.stderr.strip().splitlines()[-1]


def test_a_path_between_machines_is_paced_by_the_slower_of_its_links() -> None:
    """Nodes 2i and 2i+1 form machine i: between them only the intra rate applies, across machines the slower one."""
    spec = emulated.ClusterSpec(name="x", nodes=4, storage="/s", bandwidth=10**8, intra=10**9, nodes_per_machine=2)
    state = emulated.State(spec=spec, token="t", nodes=[{"machine": i // 2} for i in range(4)])
    assert emulated._path_bits(state, state.nodes[0], state.nodes[1]) == 10**9
    assert emulated._path_bits(state, state.nodes[1], state.nodes[2]) == 10**8
    flat = emulated.State(spec=emulated.ClusterSpec(name="x", nodes=2, storage="/s", bandwidth=5 * 10**7), token="t")
    assert emulated._path_bits(flat, {"machine": 0}, {"machine": 1}) == 5 * 10**7


def test_the_measured_links_are_written_for_a_script_to_read_without_the_token(tmp_path) -> None:
    """`run --links-json FILE`: every measured direction, unrounded (the printed report shows 0.1 Mb/s), and
    nothing else of the state (its auth token stays in state.json)."""
    measured = [
        {"src": "rtc-x-n0", "dst": "rtc-x-n1", "asked_bits": 10**8, "achieved_bits": 95_912_345},
        {"src": "rtc-x-n1", "dst": "rtc-x-n0", "asked_bits": 10**8, "achieved_bits": 96_187_001},
    ]
    spec = emulated.ClusterSpec(name="x", nodes=2, storage="/s")
    state = emulated.State(spec=spec, token="secret", measured=measured)
    out = tmp_path / "sub" / "links.json"
    write_links(state, str(out))
    assert json.loads(out.read_text()) == measured
    assert "secret" not in out.read_text()
    write_links(state, None)  # not asked: nothing written, nothing raised


def test_a_node_starts_with_its_custom_resources_and_the_state_keeps_them(tmp_path, monkeypatch) -> None:
    """`--node-resources 1:index_node=1,pool_node=0.5`: node 1's `ray start --resources`, none for the head; the
    state file (JSON: string keys) gives the node numbers back as numbers."""
    monkeypatch.setattr(emulated, "STATE_ROOT", tmp_path)
    args = emulated_main._parser().parse_args(
        ["up", "--nodes", "2", "--node-resources", "1:index_node=1,pool_node=0.5", "--storage", str(tmp_path)]
    )
    args.name = "x"
    spec = emulated_main._spec(args, emulated_main._parser())
    assert spec.node_resources == {1: {"index_node": 1.0, "pool_node": 0.5}}
    nodes = [{"ns": f"rtc-x-n{i}", "address": f"10.237.0.{10 + i}", "machine": i} for i in range(2)]
    state = emulated.State(spec=spec, token="t", nodes=nodes)
    assert '--resources={"index_node": 1.0, "pool_node": 0.5}' in emulated._node_argv(state, 1)
    assert not [a for a in emulated._node_argv(state, 0) if a.startswith("--resources")]
    emulated._save(state)
    loaded = emulated.load_state("x")
    assert loaded is not None and loaded.spec == spec
