"""The torchft lighthouse that joins replica groups (docs/resilience.md), as the trainer and the launchers see it.

Torch-free, so that the launchers can run it before a group's torchrun:

    python -m torchtitan.distributed.lighthouse flags [trainer options]
        the command-line flags that start `torchft_lighthouse` with the job's settings (fault_tolerance.
        min_replica_size, join_timeout_seconds, heartbeat_timeout_seconds): run_train.sh and multinode_trainer.slurm
        start the lighthouse with them
    python -m torchtitan.distributed.lighthouse check GROUP[,GROUP...] [trainer options]
        wait for the lighthouse (fault_tolerance.connect_timeout_seconds) and refuse replica groups that are live
        already: one error line and exit code 2, before torchrun (which would restart the failed group, and repeat
        the line, FT_MAX_RESTARTS times)

(Both parse the trainer's options as the trainer does, which imports torch: seconds.)

A group is known to the lighthouse by its heartbeats, every 0.1 s from the group's rank 0 (torchft's manager),
under the id `torchtitan_ft_<replica_id>:<uuid>` (a new uuid for every process). The lighthouse lists them, with the
time since each one's last heartbeat, on its status page.
"""

import dataclasses
import os
import re
import socket
import sys
import time
import urllib.request
from urllib.parse import urlparse

from torchtitan.config.job_config import FaultTolerance as FaultToleranceConfig
from torchtitan.errors import UserError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# torchft's manager heartbeats every 100 ms: a group whose last heartbeat is older after this long has stopped.
_HEARTBEAT_SAMPLE_S = 0.5
# A line of the lighthouse's status page (torchft 0.2): "<replica id>: seen <seconds>s ago".
_HEARTBEAT_LINE = re.compile(r"^\s*(\S+): seen ([0-9.e+-]+)s ago\s*$", re.MULTILINE)


def group_prefix(replica_id: int) -> str:
    """The id a replica group gives torchft, before the uuid of its process (torchft derives the group's global
    ranks from its trailing digits: TorchTitan's naming)."""
    return f"torchtitan_ft_{replica_id}"


def lighthouse_address(config: FaultToleranceConfig, environ: dict[str, str]) -> str:
    """fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE (the variable torchft and TorchTitan read)."""
    address = config.lighthouse or environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise UserError(f"option fault_tolerance.lighthouse: not set and {LIGHTHOUSE_ENV} is not in the environment; "
                        f"give the lighthouse's address (http://host:port), or launch with run_train.sh and FT_GROUPS "
                        f"(docs/resilience.md)")
    return address


def _host_port(address: str) -> tuple[str, int]:
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        raise UserError(f"option fault_tolerance.lighthouse: {address!r} is not an address of the form "
                        f"http://host:port")
    return url.hostname, url.port


def connect_to_lighthouse(address: str, timeout_s: float) -> None:
    """Open and close a TCP connection to the lighthouse (OSError if none is accepted)."""
    socket.create_connection(_host_port(address), timeout=timeout_s).close()


def wait_for_lighthouse(address: str, timeout_s: float) -> None:
    """Return once the lighthouse accepts a TCP connection; one error line if it does not within `timeout_s`.
    torchft itself would retry its heartbeats forever and fail only at the first quorum's timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connect_to_lighthouse(address, min(5.0, timeout_s))
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UserError(f"option fault_tolerance.lighthouse: no torchft lighthouse reachable at {address} "
                                f"within {timeout_s:g} s (fault_tolerance.connect_timeout_seconds): {e}; start it "
                                f"first (torchft_lighthouse, or run_train.sh with FT_GROUPS)") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def lighthouse_flags(config: FaultToleranceConfig) -> list[str]:
    """The flags of `torchft_lighthouse` for this job (the launchers add --bind)."""
    return ["--min_replicas", str(config.min_replica_size),
            "--join_timeout_ms", str(round(1000 * config.join_timeout_seconds)),
            "--heartbeat_timeout_ms", str(round(1000 * config.heartbeat_timeout_seconds))]


def survivor_pause_bound_s(config: FaultToleranceConfig) -> float:
    """The longest a live group waits between two of its steps when another group fails, before the steps' own
    time: the failed step's collective gives up after process_group_timeout_ms; the lighthouse counts the failed
    group dead once its heartbeats are heartbeat_timeout_seconds old (a group stops heartbeating when its process
    dies or, stopped by a signal while it waited for a quorum, at once); and it forms a quorum without a group that
    heartbeats but does not join (a hung one) after join_timeout_seconds."""
    return config.process_group_timeout_ms / 1000 + config.heartbeat_timeout_seconds + config.join_timeout_seconds


def heartbeats(address: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """The groups the lighthouse has heard from: id -> seconds since its last heartbeat; None if its status page
    cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{':'.join(map(str, _host_port(address)))}/status",
                                    timeout=timeout_s) as page:
            text = page.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    return {replica: float(age) for replica, age in _HEARTBEAT_LINE.findall(text)}


def live_copies(config: FaultToleranceConfig, address: str) -> list[str]:
    """The processes that heartbeat to the lighthouse as this replica group now: ids whose heartbeat arrived while
    this waited. A copy that stopped (a crashed or restarted group's earlier process) is waited for until the
    lighthouse drops it (its last heartbeat heartbeat_timeout_seconds old), so that no quorum holds both it and
    this process."""
    prefix = group_prefix(config.replica_id) + ":"
    first = heartbeats(address)
    if first is None:
        return []
    mine = {replica: age for replica, age in first.items() if replica.startswith(prefix)}
    if not mine:
        return []
    started = time.monotonic()
    time.sleep(_HEARTBEAT_SAMPLE_S)
    later = heartbeats(address) or {}
    elapsed = time.monotonic() - started
    live = [replica for replica, age in mine.items() if replica in later and later[replica] < age + elapsed / 2]
    stopped_ages = [later.get(replica, age + elapsed) for replica, age in mine.items() if replica not in live]
    wait = max([config.heartbeat_timeout_seconds - age for age in stopped_ages], default=0.0)
    if not live and wait > 0:
        time.sleep(wait)
    return live


def refuse_a_second_copy(config: FaultToleranceConfig, address: str) -> None:
    """One error line if replica group `config.replica_id` is live at the lighthouse already: a second copy would
    read the same data slice, write the same metrics and checkpoints, and count in every quorum as a group more
    (each update would count that slice twice)."""
    live = live_copies(config, address)
    if live:
        raise UserError(
            f"option fault_tolerance.replica_id: replica group {config.replica_id} is running already (the "
            f"lighthouse at {address} hears from {', '.join(live)}); this copy stops without joining. Stop the "
            f"running one first (its launcher and workers), or start another group id below fault_tolerance."
            f"group_size = {config.group_size}")


def main(argv: list[str]) -> int:
    from torchtitan.config import parse_args

    command = argv[0] if argv else ""
    groups = argv[1] if command == "check" and len(argv) > 1 else ""
    if command not in ("flags", "check") or (command == "check" and not re.fullmatch(r"\d+(,\d+)*", groups)):
        print("usage: python -m torchtitan.distributed.lighthouse flags [trainer options]\n"
              "       python -m torchtitan.distributed.lighthouse check GROUP[,GROUP...] [trainer options]",
              file=sys.stderr)
        return 2
    try:
        config = parse_args(argv[2:] if command == "check" else argv[1:]).fault_tolerance
        if command == "flags":
            print(" ".join(lighthouse_flags(config)))
            return 0
        address = lighthouse_address(config, dict(os.environ))
        wait_for_lighthouse(address, config.connect_timeout_seconds)
        for group in map(int, groups.split(",")):
            refuse_a_second_copy(dataclasses.replace(config, replica_id=group), address)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
