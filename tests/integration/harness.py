"""Run the real trainer (one process, or torchrun with gloo) and read back what it logged."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.integration.preloaded import PreloadedTrainer

REPO = Path(__file__).resolve().parents[2]

# A tiny fp32 model, fixed seed and data: the base of every parity comparison.
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.mixed_precision_param", "float32",
        "--debug.seed", "0", "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1", "--validation.no_enable", "--metrics.disable_color_printing",
        # MFU against a fixed peak: the peak probe (over a second per process) is tested in tests/unit/test_metrics.py.
        "--metrics.peak_flops", "1e12"]


def launch(dump_folder: Path, nproc: int, args: list[str], timeout: int = 300,
           env: dict | None = None, module: str = "torchtitan.train",
           launcher_args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Start the trainer with `nproc` processes; returns the finished process (stdout and stderr merged).

    `module` replaces the entry point (the fault-injection wrapper); `launcher_args` go to torchrun. Launches of the
    trainer itself fork from a process that has it imported already (tests/integration/preloaded.py); the others
    run the torchrun command.
    """
    trainer = ["-m", module, *args, "--job.dump_folder", str(dump_folder)]
    if nproc == 1:
        cmd = [sys.executable, *trainer]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=localhost:0", *(launcher_args or []), *trainer]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    if module == "torchtitan.train" and not launcher_args:
        with tempfile.NamedTemporaryFile(prefix="trainer-output-", suffix=".log") as output, \
                tempfile.TemporaryDirectory(prefix="dump-before-") as before:
            # What a resumed run starts from, should the fast path's run have to be repeated (below).
            if Path(dump_folder).exists():
                shutil.copytree(dump_folder, Path(before) / "dump")
            try:
                returncode = _preloaded_trainer(full_env).launch(nproc, trainer[2:], Path(output.name), timeout)
                stdout = Path(output.name).read_text(errors="replace")
            except subprocess.TimeoutExpired:
                returncode, stdout = None, ""
            if returncode is None or "Fatal Python error" in stdout:
                shutil.rmtree(dump_folder, ignore_errors=True)
                if (Path(before) / "dump").exists():
                    shutil.copytree(Path(before) / "dump", dump_folder)
        # A forked worker once died of a segmentation fault mid-run (FSDP 2 x CP 2, step 6; once in about 300
        # launches, never seen under the torchrun command): a crash or a hang of the fast path is not the test's
        # verdict. The run is repeated with the torchrun command, whose result stands.
        if returncode is not None and "Fatal Python error" not in stdout:
            return subprocess.CompletedProcess(cmd, returncode, stdout)
        print(f"the forked launch crashed or hung; repeating it with the torchrun command:\n{stdout[-3000:]}",
              file=sys.stderr)
    # A session of its own, so that a timeout kills the workers too, not only the launcher (orphaned workers
    # would keep the CPU busy and hold ports).
    with subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


# The preloaded trainers by environment, most recently used last (modules read some variables at import, so a
# launch with other variables needs a server started with them). Two at most: a server holds a trainer's imports.
_preloaded: dict[tuple, PreloadedTrainer] = {}
MAX_PRELOADED = 2


def _preloaded_trainer(env: dict[str, str]) -> PreloadedTrainer:
    # pytest names the running test in the environment; nothing the trainer reads.
    key = tuple(sorted((name, value) for name, value in env.items() if name != "PYTEST_CURRENT_TEST"))
    server = _preloaded.pop(key, None)
    if server is None or not server.alive():
        server = PreloadedTrainer(env)
    _preloaded[key] = server
    while len(_preloaded) > MAX_PRELOADED:
        _preloaded.pop(next(iter(_preloaded))).close()
    return server


def train(dump_folder: Path, nproc: int, args: list[str], timeout: int = 300, env: dict | None = None,
          **launch_options) -> list[dict]:
    """Run to completion (failing the test with the output's tail otherwise); returns the metrics.jsonl rows."""
    proc = launch(dump_folder, nproc, args, timeout, env, **launch_options)
    assert proc.returncode == 0, f"trainer exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return read_metrics(dump_folder)


def read_metrics(dump_folder: Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows if "loss" in row]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"different numbers of steps: {len(a)} vs {len(b)}"
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
