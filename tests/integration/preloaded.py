"""Trainer runs forked from a process that has already imported the trainer.

A trainer process spends about 3 s of CPU importing torch, its distributed packages and the trainer before it
builds anything, and torchrun's agent 1.5 s more: for the tiny models of the integration tests that is most of a run,
and the suite starts a few hundred such processes. Here one process (started on first use, kept for the session)
imports it all once; each launch forks a fresh copy of it that runs torchrun's own launch code
(`torch.distributed.run.parse_args` and `config_from_args`, then `elastic_launch`, the same rendezvous, environment,
failure report and shutdown) with the trainer's `main` as the workers' entry point and torchrun's `fork` start method,
so that the workers inherit the imports instead of repeating them. One process runs `main` in the forked copy itself,
as `python -m torchtitan.train` would. What the imports printed starts every run's output, as in a new process.

What still goes through a real `torchrun` command (harness.launch decides): launches with extra torchrun options or
another entry point (the fault-injection tests: restarts and signals are torchrun's). A server serves one
environment, the one it was started with, since modules read some variables at import. A forked run that crashed
(a Python fatal error in its output) or hung is repeated with the torchrun command, whose result stands
(harness.launch): a forked worker once died of a segmentation fault that no torchrun run has shown.
"""

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class PreloadedTrainer:
    """The client: one server process, one launch at a time."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.server = subprocess.Popen([sys.executable, "-m", "tests.integration.preloaded"], cwd=REPO, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._pending = b""
        assert self._reply(timeout=120) == {"ready": True}

    def alive(self) -> bool:
        return self.server.poll() is None

    def close(self) -> None:
        self.server.stdin.close()  # the server ends at the end of its input
        self.server.wait(timeout=60)

    def launch(self, nproc: int, trainer_args: list[str], output: Path, timeout: float) -> int:
        """Runs the trainer with `nproc` processes, their stdout and stderr to `output`; returns the exit code as
        torchrun's would be (or `python -m torchtitan.train`'s for one process). Raises TimeoutExpired after
        `timeout` seconds, with the run killed."""
        self.server.stdin.write(json.dumps({"nproc": nproc, "args": trainer_args, "output": str(output)}) + "\n")
        self.server.stdin.flush()
        launcher = self._reply(timeout=60)["pid"]
        try:
            return self._reply(timeout)["returncode"]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the launcher leads its own session: workers go with it
                os.killpg(launcher, signal.SIGKILL)
            self._reply(timeout=60)
            raise

    def _reply(self, timeout: float) -> dict:
        """The server's next line. Read from the descriptor, not a buffered file: a buffer could hold the next line
        already, where select would not see it."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.server.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("preloaded trainer", timeout)
            chunk = os.read(self.server.stdout.fileno(), 4096)
            assert chunk, f"the preloaded trainer process exited with {self.server.wait()}"
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


def _run_trainer(*trainer_args: str) -> None:
    """A worker's entry point: the trainer's main, ended as `python -m torchtitan.train` ends (see its __main__)."""
    from torchtitan import train

    sys.argv = [train.__file__, *trainer_args]
    exit_code = train.main(list(trainer_args))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_code:
        os._exit(exit_code)  # torchrun's agent reads the worker's exit code, as for a trainer process


def _launch(nproc: int, trainer_args: list[str]) -> int:
    """In a fresh fork of the server: what `torchrun --nproc_per_node=N --rdzv-backend=c10d
    --rdzv-endpoint=localhost:0 -m torchtitan.train ARGS` does, with forked workers."""
    if nproc == 1:
        _run_trainer(*trainer_args)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    @record
    def torchrun() -> None:
        args = parse_args([f"--nproc_per_node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                           "--start-method=fork", "-m", "torchtitan.train", *trainer_args])
        config, _, _ = config_from_args(args)
        elastic_launch(config=config, entrypoint=_run_trainer)(*trainer_args)

    try:
        torchrun()
    except Exception:
        sys.excepthook(*sys.exc_info())  # torchrun's own exit: its failure report, then status 1
        return 1
    return 0


def _serve() -> None:
    # What the imports print (a library's warning) belongs to every run's output, as it would in a new process.
    with tempfile.TemporaryFile() as import_output:
        stderr = os.dup(2)
        os.dup2(import_output.fileno(), 2)
        import torch.distributed.run  # noqa: F401  (the launcher's imports, once)

        import torchtitan.train  # noqa: F401  (the trainer's imports, once)

        sys.stderr.flush()
        os.dup2(stderr, 2)
        import_output.seek(0)
        printed_at_import = import_output.read()

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(output, printed_at_import)
            os.dup2(output, 1)
            os.dup2(output, 2)
            exit_code = 1
            try:
                exit_code = _launch(request["nproc"], request["args"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
