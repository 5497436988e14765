"""torchrun, with the workers' exit code passed through and no launcher traceback when a worker fails.

`python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer options]` runs torchrun itself
(`torch.distributed.run`). When a worker exits with an error, the worker has already printed the reason (for a
user mistake, one `error:` line); torchrun would then raise `ChildFailedError` and print its own traceback over it,
and exit with 1 whatever the worker's code. Here the first failed rank's exit code becomes ours instead.
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as failed:
        rank, failure = min(failed.failures.items())
        print(f"torchrun: rank {rank} exited with code {failure.exitcode}; its output above says why",
              file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as signalled:
        # SLURM's preemption SIGTERM reaches the launcher too: the workers were signalled and have checkpointed.
        print(f"torchrun: stopped by signal {signalled.sigval.name}", file=sys.stderr)
        return 128 + signalled.sigval.value
    return 0


if __name__ == "__main__":
    sys.exit(main())
