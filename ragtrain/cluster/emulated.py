"""A Ray cluster in a box: each Ray node in its own network namespace, address, /tmp and shaped link (netns.py).

`up` makes the network, starts one `ray start --block` per node inside `ip netns exec NS unshare --mount --uts`,
with an overlay over /tmp (the host's /tmp below it, so a checkout or a venv kept there still runs; what a node
writes there no other node sees, and Ray's cached node address is the node's own) and a tmpfs over ~/.ray (so no
node reads the host's auth token), its namespace's name as host name and a hosts file naming every node
(gethostname() resolves to the node's own address, which is where gloo binds by default and what c10d looks up for
its peers), waits until every node has joined, measures every path from the head to another node in both
directions and writes the state (addresses, pids, asked and achieved rates) to STATE_ROOT/<name>/state.json. Every
process of the cluster (Ray's and the command's) gets one fresh auth token. Storage is a folder every node sees
(under /tmp too: bound through each overlay). `down` stops the processes by namespace and deletes the namespaces;
it is idempotent.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragtrain.cluster import linkprobe, netns

__all__ = ["STATE_ROOT", "ClusterSpec", "command_env", "down", "exec_argv", "load_state", "up"]

STATE_ROOT = Path(os.environ.get("RAGTRAIN_CLUSTER_STATE", "/run/ragtrain-cluster"))
GCS_PORT = 6379
JOIN_TIMEOUT_S = 300.0  # ray start of a node on a loaded 2-core machine takes 10-60 s
IFNAME = "eth0"  # the node's interface in every namespace: gloo binds to it (GLOO_SOCKET_IFNAME)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    storage: str  # a folder every node sees
    cpus_per_node: int = 1
    bandwidth: int | None = None  # bits/s between machines (None: unshaped)
    intra: int | None = None  # bits/s between the nodes of one machine
    nodes_per_machine: int = 1
    object_store_bytes: int = 200_000_000
    tmp_size: str = "2g"  # the tmpfs over each node's /tmp (Ray's session folder, spilled objects)
    # custom resources of node i (`ray start --resources`), e.g. {1: {"index_node": 1}}: where a job's placement
    # rules (resources=multi_node's index pool) can land
    node_resources: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass
class State:
    spec: ClusterSpec
    token: str
    nodes: list[dict] = field(default_factory=list)  # ns, address, machine, pid, log
    links: list[dict] = field(default_factory=list)  # name, asked_bits
    measured: list[dict] = field(default_factory=list)  # src, dst, asked_bits, achieved_bits

    @property
    def head_address(self) -> str:
        return f"{self.nodes[0]['address']}:{GCS_PORT}"


def state_file(name: str) -> Path:
    return STATE_ROOT / name / "state.json"


def _save(state: State) -> None:
    path = state_file(state.spec.name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # it holds the cluster's auth token
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    tmp.chmod(0o600)
    tmp.replace(path)


def hosts_file(name: str) -> Path:
    return STATE_ROOT / name / "hosts"


def _write_hosts(state: State) -> None:
    """The hosts file every node sees as /etc/hosts: loopback, and each node's name at its address; the IPv4-mapped
    form too, after it, because c10d's TCPStore listens on `::` and looks its peers up by that form (without it the
    lookup falls through to DNS, which no node can reach)."""
    lines = ["127.0.0.1 localhost"] + [f"{n['address']} {n['ns']}" for n in state.nodes]
    lines += [f"::ffff:{n['address']} {n['ns']}" for n in state.nodes]
    hosts_file(state.spec.name).write_text("\n".join(lines) + "\n")


def load_state(name: str) -> State | None:
    path = state_file(name)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    spec = raw["spec"]
    spec["node_resources"] = {int(i): r for i, r in spec.get("node_resources", {}).items()}  # JSON keys are strings
    return State(**{**raw, "spec": ClusterSpec(**spec)})


def command_env(state: State) -> dict[str, str]:
    """The environment of every process of the cluster: its auth token, gloo's interface, its head."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # Ray refuses multi-node on one host name without it
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=state.token,
        # gloo binds to gethostname()'s address unless told: the hosts file makes that the node's, this makes sure
        GLOO_SOCKET_IFNAME=IFNAME,
        RAGTRAIN_CLUSTER_NAME=state.spec.name,
        RAGTRAIN_CLUSTER_STORAGE=state.spec.storage,
    )
    return env


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


def _node_argv(state: State, i: int) -> list[str]:
    """`ray start --block` for node i, in its network namespace and a mount namespace with a private /tmp."""
    spec, node = state.spec, state.nodes[i]
    ray = [_ray(), "start", "--block", f"--node-ip-address={node['address']}", f"--num-cpus={spec.cpus_per_node}"]
    ray += [f"--object-store-memory={spec.object_store_bytes}", f"--temp-dir=/tmp/ray-{node['ns']}"]
    ray += ["--disable-usage-stats"]
    if spec.node_resources.get(i):
        ray += [f"--resources={json.dumps(spec.node_resources[i])}"]
    if i == 0:
        ray += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
    else:
        ray += [f"--address={state.head_address}"]
    private = (
        f"{private_tmp(spec, node['ns'])} && "
        '{ [ ! -d "$HOME/.ray" ] || mount -t tmpfs -o size=1m tmpfs "$HOME/.ray"; } && '
        f'hostname {node["ns"]} && mount --bind {hosts_file(spec.name)} /etc/hosts && exec "$@"'
    )
    unshare = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", private, "sh"]
    return ["ip", "netns", "exec", node["ns"], *unshare, *ray]


def private_tmp(spec: ClusterSpec, ns: str) -> str:
    """Shell that gives a node its own /tmp: an overlay whose lower layer is the host's /tmp (a checkout or a venv
    kept there still runs) and whose writes land in a tmpfs of the node's own (Ray's session folder, its cached
    node address, spilled objects: no other node sees them). Storage under /tmp is bound through, shared."""
    scratch = STATE_ROOT / spec.name / f"{ns}-tmp"  # mounted over inside the node's mount namespace only
    sh = (
        f"mkdir -p {scratch} && mount -t tmpfs -o size={spec.tmp_size},mode=1777 tmpfs {scratch} && "
        f"mkdir -p {scratch}/upper {scratch}/work {scratch}/host && chmod 1777 {scratch}/upper && "
        f"mount --bind /tmp {scratch}/host && "
        f"mount -t overlay overlay -o lowerdir=/tmp,upperdir={scratch}/upper,workdir={scratch}/work /tmp"
    )
    storage = Path(spec.storage)
    if Path("/tmp") in storage.parents:
        sh += f" && mount --bind {scratch}/host/{storage.relative_to('/tmp')} {storage}"
    return sh


def _start_node(state: State, i: int) -> None:
    node = state.nodes[i]
    log = open(node["log"], "ab")  # noqa: SIM115 - the node process owns it
    p = subprocess.Popen(
        _node_argv(state, i),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=command_env(state),
        start_new_session=True,  # a Ctrl-C at the terminal reaches the command; teardown stops the nodes
    )
    log.close()
    node["pid"] = p.pid  # ip -> unshare -> sh -> ray all exec: this pid is `ray start`, in the node's namespaces


def _exited(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid  # our child: reaped once it has exited
    except ChildProcessError:
        return not os.path.exists(f"/proc/{pid}")


def _wait_started(state: State, i: int, deadline: float, offset: int) -> bool:
    """True once node i's `ray start` says it started (in its log from `offset`: this attempt's part); False if it
    exited first; an error past the deadline."""
    node = state.nodes[i]
    log = Path(node["log"])
    while "Ray runtime started" not in log.read_text(errors="replace")[offset:]:
        if _exited(node["pid"]):
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray on {node['ns']} did not start in time:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return True


def _bring_up(state: State, i: int, deadline: float, attempts: int = 3) -> None:
    """Start node i, again if it exits: `ray start` gives a raylet 30 s to register, which a loaded 2-core machine
    can miss."""
    node, log = state.nodes[i], Path(state.nodes[i]["log"])
    for _ in range(attempts):
        offset = len(log.read_text(errors="replace")) if log.exists() else 0
        _start_node(state, i)
        if _wait_started(state, i, deadline, offset):
            return
        netns.stop_processes([node["ns"]])  # what the failed start left (a GCS, a raylet)
    raise RuntimeError(f"Ray on {node['ns']} exited {attempts} times:\n{Path(node['log']).read_text()[-2000:]}")


def exec_argv(state: State, argv: list[str], cwd: str | None = None) -> list[str]:
    """argv run on the head node: inside its network, mount (its /tmp holds Ray's sockets) and host-name
    namespaces."""
    pid = state.nodes[0]["pid"]
    return ["nsenter", "-t", str(pid), "-m", "-n", "-u", f"--wd={cwd or os.getcwd()}", "--", *argv]


def _wait_joined(state: State, deadline: float) -> None:
    """Until the head's GCS lists every node alive (one short driver on the head)."""
    code = (
        "import ray,sys,time\nray.init(logging_level='ERROR',log_to_driver=False)\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {state.spec.nodes}:\n"
        f"    time.sleep(0.5)\n    if time.time() > {time.time() + max(deadline - time.monotonic(), 1)}: sys.exit(1)\n"
    )
    env = {**command_env(state), "RAY_ADDRESS": state.head_address}
    r = subprocess.run(exec_argv(state, [sys.executable, "-c", code]), env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"not every node joined the cluster: {r.stderr[-2000:]}")


def _path_bits(state: State, a: dict, b: dict) -> int | None:
    """The asked rate of the path between two nodes: the slowest shaped link on it."""
    spec = state.spec
    if spec.nodes_per_machine == 1:
        return spec.bandwidth
    rates = [spec.intra] + ([spec.bandwidth] if a["machine"] != b["machine"] else [])
    shaped = [r for r in rates if r is not None]
    return min(shaped) if shaped else None


def _best_rate(src: dict, dst: dict, asked: int | None, tries: int = 3) -> float:
    """The best of up to `tries` transfers: on a loaded machine a starved sender measures its CPU, not the link
    (the link's rate is the most it carried); stops once one comes within 10 % of the asked rate."""
    best = 0.0
    for _ in range(tries):
        best = max(best, linkprobe.measure(src["ns"], dst["ns"], dst["address"], asked))
        if asked is None or best >= 0.9 * asked:
            break
    return best


def measure_links(state: State) -> None:
    """From the head to every other node and back: achieved beside asked bits/s."""
    head = state.nodes[0]
    state.measured = []
    for other in state.nodes[1:]:
        asked = _path_bits(state, head, other)
        for src, dst in ((head, other), (other, head)):
            got = _best_rate(src, dst, asked)
            state.measured.append(
                {"src": src["ns"], "dst": dst["ns"], "asked_bits": asked, "achieved_bits": round(got)}
            )


def up(spec: ClusterSpec) -> State:
    """Make the network, start and join the Ray nodes, measure the links, write the state. On any failure
    everything made is torn down before the error propagates."""
    state = State(spec=spec, token=secrets.token_hex(32))
    logs = Path(spec.storage) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        nodes, links = netns.make_network(spec.name, spec.nodes, spec.nodes_per_machine, spec.bandwidth, spec.intra)
        state.nodes = [{**asdict(n), "pid": None, "log": str(logs / f"{n.ns}.log")} for n in nodes]
        state.links = [{"name": link.name, "asked_bits": link.bits} for link in links]
        _save(state)  # from here `down` finds the namespaces even if this process dies
        _write_hosts(state)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for i in range(spec.nodes):  # one at a time: starting them together only makes each slower
            _bring_up(state, i, deadline)
        _save(state)
        _wait_joined(state, deadline)
        measure_links(state)
        _save(state)
    except BaseException:
        down(spec.name)
        raise
    return state


def down(name: str) -> None:
    """Stop every process of cluster `name` by its namespaces, delete them and the state. Idempotent."""
    netns.delete_network(name)
    shutil.rmtree(STATE_ROOT / name, ignore_errors=True)
