"""torchrun, with the workers' exit code passed through and no launcher traceback when a worker fails.

`python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer options]` runs torchrun itself
(`torch.distributed.run`). When a worker exits with an error, the worker has already printed the reason (for a
user mistake, one `error:` line); torchrun would then raise `ChildFailedError` and print its own traceback over it,
and exit with 1 whatever the worker's code. Here the first failed rank's exit code becomes ours instead.

With `--tee`, torchrun prefixes every line it copies to the console with `[<role><local rank>]:`, and the trainer's
logger adds `[rankN]` of its own: here torchrun's prefix becomes `[rankN] ` with the global rank (right on every
node), and the workers leave theirs out. Workers then write to log files, not the console: they are told whether the
console is a terminal, so that colours appear there and nowhere else.
"""

import os
import sys

from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from torchtitan.distributed.utils import LAUNCHER_PID_ENV
from torchtitan.tools.logging import CONSOLE_IS_TTY_ENV, LAUNCHER_PREFIXES_RANK_ENV


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The workers stop when this agent dies, however it dies (torchtitan.distributed.utils.end_with_launcher).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    tee = Std.from_str(args.tee)  # a dict when set per local rank: then torchrun's prefixes are left as they are
    if isinstance(tee, Std) and tee & Std.ERR:
        # The workers inherit this environment. The template is torchrun's; ${rank} is the global rank.
        os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}] ")
        os.environ[LAUNCHER_PREFIXES_RANK_ENV] = "1"
        os.environ[CONSOLE_IS_TTY_ENV] = "1" if sys.stderr.isatty() else "0"
    try:
        run(args)
    except ChildFailedError as failed:
        # A worker that stops on its own (a refusal at start-up: 2) makes torchrun SIGTERM the others, which then
        # fail too, by the signal: the code that says why is the lowest rank's among those that exited themselves.
        rank, failure = min(failed.failures.items(), key=lambda item: (item[1].exitcode <= 0, item[0]))
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
