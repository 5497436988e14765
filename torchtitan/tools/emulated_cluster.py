"""Two emulated hosts on one machine, joined by a rate-limited link, for measuring what crosses it.

Each host is a network namespace; a veth pair joins them (10.232.0.1 and 10.232.0.2 on interface `ttlink`), and
`tc qdisc ... tbf` limits each end's egress to the chosen rate (this kernel has tbf, not netem). Processes of one host
talk over the host's own stack, as on a real node; only traffic between the hosts crosses the veth pair, whose own
counters (`ip -s link`) say how many bytes it carried. Creating namespaces needs root and `ip`/`tc`: where they are
missing, `two_hosts` falls back to two loopback addresses, unthrottled and without link counters, and says so.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.232.0"
INTERFACE = "ttlink"


@dataclass
class Hosts:
    emulated: bool
    """True: namespaces joined by a veth pair (throttled if a rate was given). False: loopback addresses."""
    why_not: str
    """Why the fallback was taken (empty when emulated)."""
    addresses: list[str]
    interface: str
    """Gloo's interface on every host: without it gloo uses the address the host name resolves to."""
    prefixes: list[list[str]] = field(default_factory=list)
    """What runs a command on each host."""
    namespaces: list[str] = field(default_factory=list)

    def link_bytes(self) -> int | None:
        """Bytes sent so far by both ends of the link (each byte crossing it counts once); None without a link."""
        if not self.emulated:
            return None
        total = 0
        for namespace in self.namespaces:
            out = subprocess.run(["ip", "-n", namespace, "-j", "-s", "link", "show", INTERFACE], check=True,
                                 capture_output=True, text=True, timeout=10).stdout
            total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
        return total


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=10)


def _remove(tag: str, namespaces: list[str]) -> None:
    # Deleting a namespace deletes the veth end inside it, and with it the pair (and its qdisc).
    for namespace in namespaces:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
    subprocess.run(["ip", "link", "del", f"{tag}a0"], capture_output=True, timeout=10)


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ('' when they can, as far as can be told without trying)."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed" if missing else ""


@contextmanager
def two_hosts(rate_mbit: float | None = None) -> Iterator[Hosts]:
    """Two hosts joined by a link of `rate_mbit` Mbit/s each way (None: veth speed, unthrottled)."""
    reason = unavailable_reason()
    tag = f"tt{secrets.token_hex(3)}"
    namespaces = [f"{tag}a", f"{tag}b"]
    created: list[str] = []
    if not reason:
        try:
            for namespace in namespaces:
                _run("ip", "netns", "add", namespace)
                created.append(namespace)
            _run("ip", "link", "add", f"{tag}a0", "type", "veth", "peer", "name", f"{tag}b0")
            for i, namespace in enumerate(namespaces):
                end = f"{tag}{'ab'[i]}0"
                _run("ip", "link", "set", end, "netns", namespace)
                _run("ip", "-n", namespace, "link", "set", end, "name", INTERFACE)
                _run("ip", "-n", namespace, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", INTERFACE)
                _run("ip", "-n", namespace, "link", "set", INTERFACE, "up")
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
                if rate_mbit:
                    # A burst of 64 KiB and 50 ms of queue: a TCP stream measured 96 Mbit/s at 100mbit this way.
                    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf",
                         "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "50ms")
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            reason = f"could not build the namespaces ({err})"
            _remove(tag, created)
            created = []
    if reason:
        hosts = Hosts(False, reason, ["127.0.0.2", "127.0.0.3"], "lo", [[], []])
    else:
        hosts = Hosts(True, "", [f"{SUBNET}.1", f"{SUBNET}.2"], INTERFACE,
                      [["ip", "netns", "exec", namespace] for namespace in namespaces], namespaces)
    try:
        yield hosts
    finally:
        if created:
            _remove(tag, created)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_on_hosts(hosts: Hosts, nproc_per_host: int, trainer_args: list[str], dump_folder: Path,
                    repo: Path, timeout: float) -> list[subprocess.CompletedProcess]:
    """Run the trainer as one job over both hosts (a torchrun agent on each, c10d rendezvous on the first); returns
    each agent's finished process, output merged."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo), "GLOO_SOCKET_IFNAME": hosts.interface}
    agents = []
    for node, (prefix, address) in enumerate(zip(hosts.prefixes, hosts.addresses)):
        # torchrun takes the endpoint for its own only if the host name resolves to it, which a namespace's address
        # does not: is_host says which agent serves the rendezvous store.
        command = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                   str(nproc_per_host), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{hosts.addresses[0]}:{port}",
                   "--rdzv_id", "two-hosts", "--rdzv_conf", f"join_timeout=120,is_host={int(node == 0)}",
                   "--local_addr", address, "-m", "torchtitan.train", *trainer_args,
                   "--job.dump_folder", str(dump_folder)]
        agents.append(subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()
    return [subprocess.CompletedProcess(agent.args, agent.returncode, output)
            for agent, output in zip(agents, outputs)]
