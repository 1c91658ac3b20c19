"""`python -m ragtrain.cluster run|up|status|exec|down`: an emulated multi-node Ray cluster on this machine.

    python -m ragtrain.cluster run --nodes 2 --bandwidth 100mbit -- python -m ragtrain experiment=quickstart

brings the cluster up, runs the command on the head node with RAY_ADDRESS set and tears everything down whatever
happens (exit, error, SIGINT, SIGTERM); the exit code is the command's. docs/cluster.md, "An emulated cluster".
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from ragtrain.cluster import emulated, netns

NAME = re.compile(r"^[a-z0-9]{1,12}$")
BUILT_IN = {"CPU", "GPU", "memory", "object_store_memory"}


def _rate(text: str) -> int:
    try:
        return netns.parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _node_resources(text: str) -> tuple[int, dict[str, float]]:
    """'1:index_node=1,pool_node=0.5' -> (1, {"index_node": 1.0, "pool_node": 0.5})."""
    node, _, pairs = text.partition(":")
    try:
        resources = {k.strip(): float(v) for k, v in (pair.split("=") for pair in pairs.split(","))}
    except ValueError:
        resources = {}
    if not node.isdigit() or not resources or not all(resources) or min(resources.values()) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODE:NAME=AMOUNT[,NAME=AMOUNT...] (e.g. 1:index_node=1)")
    if set(resources) & BUILT_IN:  # `ray start --resources` refuses them: they have options of their own
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(sorted(BUILT_IN))} are not custom resources")
    return int(node), resources


def _name(text: str) -> str:
    if not NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r}: 1-12 characters of a-z and 0-9")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ragtrain.cluster", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    for verb in ("run", "up"):
        s = sub.add_parser(verb)
        s.add_argument("--name", type=_name, default=None, help="default: random (run), 'default' (up)")
        s.add_argument("--nodes", type=_positive, required=True)
        s.add_argument("--cpus-per-node", type=_positive, default=1)
        s.add_argument("--bandwidth", type=_rate, default=None, help="between machines, e.g. 100mbit (unshaped)")
        s.add_argument("--intra", type=_rate, default=None, help="between nodes of one machine (unshaped)")
        s.add_argument(
            "--workers-per-node",
            "--nodes-per-machine",
            dest="nodes_per_machine",
            type=_positive,
            default=1,
            help="Ray nodes per emulated machine: nodes K*i .. K*i+K-1 form machine i (default 1)",
        )
        s.add_argument("--storage", default=None, help="a folder every node sees (default outputs/cluster/NAME)")
        s.add_argument(
            "--links-json",
            default=None,
            help="also write the measured links (src, dst, asked_bits, achieved_bits per direction) to this JSON file",
        )
        s.add_argument(
            "--node-resources",
            type=_node_resources,
            action="append",
            default=[],
            metavar="NODE:NAME=AMOUNT[,...]",
            help="custom resources of node NODE (0 is the head), e.g. 1:index_node=1; repeatable",
        )
        if verb == "run":
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    for verb in ("status", "down", "exec"):
        s = sub.add_parser(verb)
        s.add_argument("--name", type=_name, default="default")
        if verb == "exec":
            s.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    return p


def _spec(args: argparse.Namespace, p: argparse.ArgumentParser) -> emulated.ClusterSpec:
    storage = Path(args.storage or Path("outputs") / "cluster" / args.name).resolve()
    if storage == Path("/tmp"):
        p.error("--storage /tmp: each node has its own /tmp; give a folder (under /tmp is fine)")
    if args.intra is not None and args.nodes_per_machine == 1:
        p.error("--intra needs --workers-per-node > 1 (nodes grouped into machines)")
    node_resources: dict[int, dict[str, float]] = {}
    for node, resources in args.node_resources:
        if node >= args.nodes:
            p.error(f"--node-resources {node}:...: there are nodes 0..{args.nodes - 1}")
        node_resources.setdefault(node, {}).update(resources)
    return emulated.ClusterSpec(
        name=args.name,
        nodes=args.nodes,
        storage=str(storage),
        cpus_per_node=args.cpus_per_node,
        bandwidth=args.bandwidth,
        intra=args.intra,
        nodes_per_machine=args.nodes_per_machine,
        node_resources=node_resources,
    )


def _report(state: emulated.State) -> None:
    def mbit(bits: int | None) -> str:
        return "unshaped" if bits is None else f"{bits / 1e6:.1f} Mb/s"

    print(f"cluster {state.spec.name}: head {state.head_address}, storage {state.spec.storage}", file=sys.stderr)
    for i, n in enumerate(state.nodes):
        extra = "".join(f"  {k}={v:g}" for k, v in state.spec.node_resources.get(i, {}).items())
        print(f"  {n['ns']}  {n['address']}  machine {n['machine']}  pid {n['pid']}{extra}", file=sys.stderr)
    for m in state.measured:
        got, asked = m["achieved_bits"], m["asked_bits"]
        print(f"  {m['src']} -> {m['dst']}: {mbit(got)} (asked {mbit(asked)})", file=sys.stderr)


def write_links(state: emulated.State, path: str | None) -> None:
    """The measured links as JSON (what a script reads back: the printed report rounds them; state.json holds the
    auth token and goes at teardown)."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(state.measured, indent=1) + "\n")


def _command(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    return command


def _on_head(state: emulated.State, command: list[str]) -> int:
    env = {**emulated.command_env(state), "RAY_ADDRESS": state.head_address}
    return subprocess.run(emulated.exec_argv(state, command), env=env).returncode


def _interrupted(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run's finally: the teardown


def _run(spec: emulated.ClusterSpec, command: list[str], links_json: str | None = None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    try:
        state = emulated.up(spec)
        _report(state)
        write_links(state, links_json)
        return _on_head(state, command)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the teardown
            signal.signal(sig, signal.SIG_IGN)
        emulated.down(spec.name)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.verb in ("run", "up"):
        args.name = args.name or ("default" if args.verb == "up" else secrets.token_hex(3))
        spec = _spec(args, p)
        command = _command(args, p) if args.verb == "run" else []
    why = netns.missing_requirement()
    if why is not None:
        print(f"python -m ragtrain.cluster: {why}", file=sys.stderr)
        return 2
    if args.verb == "run":
        return _run(spec, command, args.links_json)
    if args.verb == "down":
        emulated.down(args.name)
        return 0
    if args.verb == "up" and emulated.load_state(args.name) is not None:
        p.error(f"cluster {args.name!r} is up already (`down --name {args.name}` first)")
    state = emulated.up(spec) if args.verb == "up" else emulated.load_state(args.name)
    if state is None:
        print(f"python -m ragtrain.cluster: no cluster named {args.name!r} is up", file=sys.stderr)
        return 1
    if args.verb == "up":
        write_links(state, args.links_json)
    if args.verb == "exec":
        return _on_head(state, _command(args, p))
    _report(state)
    if args.verb == "status":
        print(json.dumps({**asdict(state), "token": "<hidden>"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
