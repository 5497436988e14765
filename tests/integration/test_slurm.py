"""multinode_trainer.slurm: its command line and preemption handling with stand-in SLURM commands, then for real on
a one-machine SLURM cluster (slurmctld + slurmd started by the test) where the job reaches its time limit, is
requeued, and resumes from its checkpoint.

The real cluster needs the Debian packages slurmctld, slurmd, slurm-client and munge (and root, as slurmd starts the
job steps); without them that test is skipped, saying why. It runs with the slow tests (`pytest -m slow`, about a
minute), so CI installs no SLURM.
"""

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import REPO, TINY, read_metrics
from torchtitan.components.checkpoint import complete_steps

pytestmark = pytest.mark.integration

SCRIPT = REPO / "multinode_trainer.slurm"
JOB_ID = "42"

# ---------------------------------------------------------------------------------------------------------------
# Dry runs: scontrol, scancel, srun and the launcher (python) replaced by scripts that record how they were called.

FAKE_COMMANDS = {
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$FAKE_DIR/calls"
if [ "$1 $2" = "show hostnames" ]; then printf 'node-a\\nnode-b\\n'; fi
""",
    "scancel": """#!/bin/bash
echo "scancel $*" >> "$FAKE_DIR/calls"
kill -TERM "$(cat "$FAKE_DIR/launcher.pid")"
""",
    # Records its own options, if any (the replica groups' job steps have some).
    "srun": """#!/bin/bash
options=()
while [[ "$1" == -* ]]; do options+=("$1" "$2"); shift 2; done
if [ ${#options[@]} -gt 0 ]; then echo "srun ${options[*]}" >> "$FAKE_DIR/calls"; fi
exec "$@"
""",
    "torchft_lighthouse": """#!/bin/bash
echo "torchft_lighthouse $*" >> "$FAKE_DIR/calls"
exec sleep 60
""",
    # The launcher (`python -m torchtitan.launch ...`): records its arguments one per line in launcher.args (the
    # last launch) and in a launch.* file of its own (with the lighthouse it was given); with FAKE_TRAIN_SECONDS it
    # trains until then or until SIGTERM. Asked for the lighthouse's flags (python -m torchtitan.distributed.lighthouse
    # flags, tested in tests/unit/test_fault_tolerance.py), records the options and answers a join timeout of 2 s.
    "python": """#!/bin/bash
if [ "$1 $2 $3" = "-m torchtitan.distributed.lighthouse flags" ]; then
  echo "lighthouse flags ${*:4}" >> "$FAKE_DIR/calls"
  echo "--min_replicas 1 --join_timeout_ms 2000 --heartbeat_timeout_ms 5000"
  exit 0
fi
printf '%s\\n' "$@" > "$FAKE_DIR/launcher.args"
{ printf '%s\\n' "$@"; echo "TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-}"
  echo "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-}"; } \\
  > "$(mktemp "$FAKE_DIR/launch.XXXXXX")"
if [ -n "${FAKE_TRAIN_SECONDS:-}" ]; then
  trap 'echo "launcher SIGTERM" >> "$FAKE_DIR/calls"; kill $!; exit 143' TERM
  echo $$ > "$FAKE_DIR/launcher.pid"
  sleep "$FAKE_TRAIN_SECONDS" &
  wait
fi
exit "${FAKE_EXIT:-0}"
""",
}


def clean_environment() -> dict[str, str]:
    """This process's environment without SLURM's variables (the tests may themselves run inside a job)."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "SBATCH_", "SRUN_"))}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_COMMANDS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**clean_environment(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2"}
    return tmp_path, env


def dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def calls(folder: Path) -> list[str]:
    path = folder / "calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("gpu_env,nproc", [
    ({}, "1"),
    ({"SLURM_GPUS_ON_NODE": "4"}, "4"),
    ({"SLURM_GPUS_ON_NODE": "4", "GPUS_PER_NODE": "2"}, "2"),
], ids=["no_gpus", "slurm_gpus", "override"])
def test_launcher_command_line(fake_slurm, gpu_env, nproc):
    folder, env = fake_slurm
    proc = dry_run({**env, **gpu_env}, "--training.steps", "5", "--job.description", "two words")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "launcher.args").read_text().splitlines() == [
        "-m", "torchtitan.launch", "--nnodes", "2", "--nproc_per_node", nproc, "--rdzv_id", JOB_ID, "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "node-a:29500", "--shutdown_timeout", "110", "--local-ranks-filter", "0",
        "--role", "rank", "--tee", "3", "-m", "torchtitan.train", "--job.config_file",
        "train_configs/debug_model.toml", "--training.steps", "5", "--job.description", "two words"]
    assert calls(folder) == ["scontrol show hostnames node-[a-b]"]


def test_failed_run_keeps_its_status_and_is_not_requeued(fake_slurm):
    folder, env = fake_slurm
    proc = dry_run({**env, "FAKE_EXIT": "3"})
    assert proc.returncode == 3
    assert not any("requeue" in call for call in calls(folder))


def start_training(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """The script, with a fake launcher that trains for a minute unless stopped; returns once that has started."""
    script = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env={**env, "FAKE_TRAIN_SECONDS": "60"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (folder / "launcher.pid").exists():
        if time.monotonic() > deadline or script.poll() is not None:
            script.kill()
            pytest.fail(f"the fake launcher did not start:\n{script.communicate()[0]}")
        time.sleep(0.05)
    return script


def test_time_limit_warning_stops_training_then_requeues(fake_slurm):
    folder, env = fake_slurm
    script = start_training(folder, env)
    try:
        script.send_signal(signal.SIGUSR1)
        output, _ = script.communicate(timeout=30)
    finally:
        script.kill()
    assert calls(folder)[1:] == [f"scancel --signal=TERM {JOB_ID}", "launcher SIGTERM", f"scontrol requeue {JOB_ID}"]
    assert f"requeueing job {JOB_ID}" in output
    assert script.returncode == 143


def test_cancelled_job_is_not_requeued(fake_slurm):
    """scancel sends SIGTERM to the batch script (and, by itself, to the job steps): no requeue."""
    folder, env = fake_slurm
    script = start_training(folder, env)
    launcher = int((folder / "launcher.pid").read_text())
    try:
        script.send_signal(signal.SIGTERM)
        # wait, not communicate: the orphaned launcher still holds the output pipe open.
        script.wait(timeout=30)
        made = calls(folder)
    finally:
        script.kill()
        os.kill(launcher, signal.SIGTERM)
        script.communicate(timeout=30)
    assert script.returncode == -signal.SIGTERM
    assert made == ["scontrol show hostnames node-[a-b]"]


def test_replica_groups_command_lines(fake_slurm):
    """FT_GROUPS=2 on 2 nodes: a lighthouse on the first node, with the job's join and heartbeat timeouts, and one
    job step per group, each a torchrun of its own node with its own rendezvous, restarting its workers, told its
    group and the lighthouse."""
    folder, env = fake_slurm
    proc = dry_run({**env, "FT_GROUPS": "2"}, "--training.steps", "5", "--fault_tolerance.join_timeout_seconds", "2")
    assert proc.returncode == 0, proc.stderr
    assert calls(folder)[:2] == [
        "scontrol show hostnames node-[a-b]",
        "lighthouse flags --job.config_file train_configs/debug_model.toml --fault_tolerance.enable "
        "--fault_tolerance.group_size 2 --fault_tolerance.min_replica_size 1 --training.steps 5 "
        "--fault_tolerance.join_timeout_seconds 2"]
    assert sorted(calls(folder)[2:]) == [f"srun --nodes 1 --ntasks 1 --relative {i}" for i in (0, 1)] + [
        "torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 --heartbeat_timeout_ms 5000 --bind [::]:29510"]
    launches = sorted((path.read_text().splitlines() for path in folder.glob("launch.*")), key=lambda a: a[7])
    for group, (args, host) in enumerate(zip(launches, ("node-a", "node-b"))):
        assert args == [
            "-m", "torchtitan.launch", "--nnodes", "1", "--nproc_per_node", "1", "--rdzv_id", f"{JOB_ID}_{group}",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:29500", "--shutdown_timeout", "110",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "--max-restarts", "3", "-m",
            "torchtitan.train", "--job.config_file", "train_configs/debug_model.toml", "--fault_tolerance.enable",
            "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "1",
            "--fault_tolerance.replica_id", str(group), "--training.steps", "5",
            "--fault_tolerance.join_timeout_seconds", "2", "TORCHFT_LIGHTHOUSE=http://node-a:29510",
            # Console lines name the group beside the rank (torchrun fills in ${rank}).
            f"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=[group{group} rank${{rank}}] "]


@pytest.mark.parametrize("change,message", [
    ({"SLURM_JOB_ID": ""}, "submit this script with sbatch"),
    ({"CONFIG_FILE": "missing.toml"}, "CONFIG_FILE missing.toml does not exist"),
    ({"GPUS_PER_NODE": "two"}, "GPUS_PER_NODE=two must be a positive integer"),
    ({"FT_GROUPS": "two"}, "FT_GROUPS=two must be a positive integer that divides the job's 2 node(s)"),
    ({"FT_GROUPS": "3"}, "FT_GROUPS=3 must be a positive integer that divides the job's 2 node(s)"),
], ids=["outside_slurm", "missing_config", "bad_gpus", "bad_ft_groups", "ft_groups_not_dividing"])
def test_errors(fake_slurm, change, message):
    folder, env = fake_slurm
    proc = dry_run({**env, **change})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert not (folder / "launcher.args").exists()


# ---------------------------------------------------------------------------------------------------------------
# A real one-machine SLURM cluster

STARTUP_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_auth_none() -> bool:
    # Slurm 23.11 removed auth/none; the Debian 12 package (22.05) still has it.
    patterns = ["/usr/lib/*/slurm-wlm/auth_none.so", "/usr/lib/slurm-wlm/auth_none.so", "/usr/lib*/slurm/auth_none.so",
                "/usr/local/lib/slurm/auth_none.so"]
    return any(glob.glob(pattern) for pattern in patterns)


class Cluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.env = {**clean_environment(), "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def start_daemon(self, *command: str) -> None:
        log = open(self.folder / f"{Path(command[0]).name}.out", "w")
        self.daemons.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True))
        log.close()

    def command(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                         for path in sorted(self.folder.glob("*.out")))

    def stop(self) -> None:
        jobs = self.command("squeue", "-h", "-o", "%i").stdout.split()
        if jobs:
            self.command("scancel", *jobs)
            deadline = time.monotonic() + 30
            while self.command("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def auth_settings(cluster: Cluster) -> str:
    """auth/none where this Slurm has it; else MUNGE with a key of the test's own, in a munged of its own."""
    if has_auth_none():
        return "AuthType=auth/none\nCredType=cred/none\nAuthInfo=cred_expire=5"
    if shutil.which("munged") is None:
        pytest.skip("this Slurm has no auth/none plugin and munged is not installed (apt-get install munge)")
    key = cluster.folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = cluster.folder / "munge.socket"
    cluster.start_daemon("munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                         f"--log-file={cluster.folder / 'munged.log'}", f"--pid-file={cluster.folder / 'munged.pid'}",
                         f"--seed-file={cluster.folder / 'munged.seed'}")
    return f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket_path},cred_expire=5"


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    missing = [name for name in ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun", "sinfo")
               if shutil.which(name) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurmctld slurmd "
                    f"slurm-client")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd runs as root (SlurmdUser=root), and this test is not root")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"this machine's host name {host!r} does not resolve; slurmd and the rendezvous need it to")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    for name in ("state", "spool"):
        (cluster.folder / name).mkdir()
    try:
        auth = auth_settings(cluster)
        # cred_expire (in auth_settings) is also how long a requeued job waits before it may start again (120 s by
        # default); sched_interval=1 lets the scheduler notice it at once.
        cluster.conf.write_text(f"""ClusterName=torchtitan-test
SlurmctldHost={host}(127.0.0.1)
{auth}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={cluster.folder / 'state'}
SlurmdSpoolDir={cluster.folder / 'spool'}
SlurmctldPidFile={cluster.folder / 'slurmctld.pid'}
SlurmdPidFile={cluster.folder / 'slurmd.pid'}
SlurmctldLogFile={cluster.folder / 'slurmctld.log'}
SlurmdLogFile={cluster.folder / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        cluster.start_daemon("slurmctld", "-D", "-f", str(cluster.conf))
        cluster.start_daemon("slurmd", "-D", "-f", str(cluster.conf), "-N", host)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while cluster.command("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            if time.monotonic() > deadline or any(daemon.poll() is not None for daemon in cluster.daemons):
                pytest.skip(f"slurmctld/slurmd did not bring the node up within {STARTUP_TIMEOUT} s in this "
                            f"container:\n{cluster.logs()}")
            time.sleep(0.5)
        yield cluster
    finally:
        cluster.stop()


def wait_for(condition, timeout: float, what: str, job: subprocess.Popen, output: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or job.poll() is not None:
            text = output.read_text(errors="replace")[-6000:] if output.exists() else "(no output)"
            pytest.fail(f"{what} did not happen within {timeout} s; the job's output:\n{text}")
        time.sleep(0.2)


@pytest.mark.slow
def test_job_at_time_limit_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """2 CPU processes on one node train until the time limit warning, checkpoint and requeue; the next run resumes
    from that checkpoint and trains to the end."""
    dump, output, config = tmp_path / "dump", tmp_path / "job.out", tmp_path / "train.toml"
    config.write_text("[training]\nsteps = 100000\n\n[checkpoint]\nenable = true\ninterval = 100000\n")
    env = {**slurm_cluster.env, "CONFIG_FILE": str(config), "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port()),
           "SHUTDOWN_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    job = subprocess.Popen(["sbatch", "--wait", "--nodes=1", "--gpus-per-node=0", f"--output={output}", str(SCRIPT),
                            *TINY, "--job.dump_folder", str(dump)],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = job.stdout.readline().split()[-1]
        # A logged step means the trainer's SIGTERM handler is installed.
        metrics = dump / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 300, "the first step", job, output)
        # What SLURM sends 120 s before the time limit (--signal=B:USR1@120), now.
        slurm_cluster.command("scancel", "--batch", "--signal=USR1", job_id)
        wait_for(lambda: complete_steps(dump / "checkpoint"), 120, "the checkpoint at the time limit warning", job,
                 output)
        preempted_at = complete_steps(dump / "checkpoint")[-1]
        # Before the requeued run starts (cred_expire = 5 s after the requeue), so that it ends 3 steps later.
        config.write_text(f"[training]\nsteps = {preempted_at + 3}\n\n[checkpoint]\nenable = true\n"
                          f"interval = 100000\n")
        job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    log = output.read_text(errors="replace")
    assert job.returncode == 0, log[-6000:]
    assert "run 0: 1 node(s) x 2 process(es)" in log and "run 1: 1 node(s) x 2 process(es)" in log
    assert f"requeueing job {job_id}" in log
    # Every step once: the first run's up to the checkpoint, then the resumed run's (a restart from scratch would
    # log step 1 again).
    steps = [row["step"] for row in read_metrics(dump) if "loss" in row]
    assert steps == list(range(1, preempted_at + 4))
