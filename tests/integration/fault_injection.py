"""Run the real trainer with faults injected, for the fault-tolerance tests (fault injection never ships in the
product: it lives here and patches the Trainer from outside).

    python -m torch.distributed.run ... -m tests.integration.fault_injection --job.dump_folder D ...

Environment:
    FAULT_PLAN        comma-separated `kind@step:rank` entries (`rank` may be `*` for every rank), e.g.
                      `sigkill@5:1`; `kind@step:rank/group` injects only in that replica group (fault tolerance:
                      the groups of one launch share the plan). Kinds, each at the start of that step's
                      forward-backward:
                        nan           the loss (hence every gradient) of that rank becomes NaN for that step
                        inf           the loss of that rank becomes +Inf for that step
                        spike         the loss of that rank is multiplied by FAULT_SPIKE_FACTOR for that step (a
                                      finite loss spike; its gradients, and the gradient norm, grow alike), once:
                                      a re-run of the step (health.rerun_bad_steps) does not see it, as after a
                                      transient hardware fault
                        bad_batch     as spike, in every forward-backward of that step, a re-run included: a
                                      batch whose loss really spikes
                        inf_grad      the loss stays finite, but one gradient (this rank's shard of the first
                                      parameter) becomes +Inf after the backward, so only the gradient norm is
                                      non-finite
                        grad_spike    the loss stays as it is, and this rank's gradients are multiplied by
                                      FAULT_SPIKE_FACTOR after the backward, once (a finite gradient spike; where
                                      replicas keep their own gradients, FlexDeMo, only this rank's replica has it)
                        sleep         the rank stalls for FAULT_SLEEP_SECONDS
                        slow          from that step on, the rank's data loading takes FAULT_SLOW_SECONDS longer
                                      every step (a straggler: a slow host or input pipeline)
                        sigkill       the rank SIGKILLs itself (a crashed process, a lost node)
                        sigterm       the rank SIGTERMs itself (a scheduler signalling the workers)
                        sigint        the rank SIGINTs itself (Ctrl-C in the terminal)
                        sigterm_agent the rank SIGTERMs its parent, the torchrun agent (a scheduler signalling
                                      the launcher, which forwards the signal to every worker)
                      and one in that step's checkpoint save:
                        sigkill_in_save  the rank SIGKILLs itself once DCP has written the checkpoint, before it
                                         is published (renamed from step-N.incomplete to step-N)
                      and one before that step's quorum (replica groups, per-step mode), after the previous step's
                      commit vote:
                        sigkill_at_quorum  the rank SIGKILLs itself
    SIGUSR1 sent to a rank from outside stalls it for FAULT_SLEEP_SECONDS wherever its main thread is (a hang at
    a moment chosen by the test, not by step number; the process's other threads, torchft's heartbeats among them,
    run on). Installed on every rank.
    SIGUSR2 sent to a rank from outside makes it SIGKILL itself in its next checkpoint save, as sigkill_in_save
    does (a kill during a save, whichever step the test finds it at).
    FAULT_ATTEMPT     inject only in this torchrun attempt (TORCHELASTIC_RESTART_COUNT); default: every attempt
    FAULT_SPIKE_FACTOR   the loss factor of a `spike` and `bad_batch`, the gradients' of a `grad_spike` (default 100)
    FAULT_SLEEP_SECONDS  length of a `sleep` stall (default 60)
    FAULT_SLOW_SECONDS   extra data-loading time per step of a `slow` rank (default 0.2)
    FAULT_REPORT_DIR  if set (`{group}` in it is the replica group), each rank appends JSON lines to
                      events-rank<R>-attempt<A>.jsonl there: every fault
                      it injects (written before acting, so a SIGKILL is recorded too), a digest of its local
                      parameter shards after each step (and whether torchft committed it) and at each logged step (after the
                      step's end), a replica group's first quorum request (`first_quorum`, per-step mode), and its exit
                      code
"""

import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from torchtitan import train
from torchtitan.distributed.fault_tolerance import ReplicaGroup

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEP_KINDS = ("nan", "inf", "spike", "bad_batch", "inf_grad", "grad_spike", "sleep", "sigkill", "sigterm", "sigint",
              "sigterm_agent")
KILL_IN_NEXT_SAVE = False
KINDS = (*STEP_KINDS, "sigkill_in_save", "sigkill_at_quorum", "slow")


def replica_group(argv: list[str]) -> str:
    """This process's replica group (--fault_tolerance.replica_id), or "" without one."""
    return argv[argv.index("--fault_tolerance.replica_id") + 1] if "--fault_tolerance.replica_id" in argv else ""


GROUP = replica_group(sys.argv)


def parse_plan(text: str) -> dict[int, str]:
    """This rank's faults: step -> kind."""
    faults = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = entry.partition("@")
        where, _, group = where.partition("/")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or not (rank == "*" or rank.isdigit()) or \
                not (group == "" or group.isdigit()):
            raise SystemExit(f"fault_injection: bad FAULT_PLAN entry {entry!r}; expected kind@step:rank or "
                             f"kind@step:rank/group with kind in {', '.join(KINDS)}")
        if (rank == "*" or int(rank) == RANK) and group in ("", GROUP):
            faults[int(step)] = kind
    return faults


def report(event: dict) -> None:
    folder = os.environ.get("FAULT_REPORT_DIR")
    if not folder:
        return
    path = Path(folder.replace("{group}", GROUP)) / f"events-rank{RANK}-attempt{ATTEMPT}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"rank": RANK, "attempt": ATTEMPT, "time": time.time(), **event}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def parameter_digest(trainer: train.Trainer) -> str:
    digest = hashlib.sha256()
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            digest.update(name.encode())
            digest.update(local.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def install(faults: dict[int, str]) -> None:
    forward_backward = train.Trainer.forward_backward
    train_step = train.Trainer.train_step
    dcp_save = dcp.save
    fired: set[int] = set()
    current = {"step": 0}

    def faulty_forward_backward(self, inputs, labels):
        step = current["step"] = self.train_state.step + 1
        kind = faults.get(step)
        # Gradient accumulation calls forward_backward several times per step, and a re-run again: inject once,
        # except a bad batch.
        if kind not in STEP_KINDS or (step in fired and kind != "bad_batch"):
            return forward_backward(self, inputs, labels)
        fired.add(step)
        report({"event": "inject", "kind": kind, "step": step})
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "sigint":
            # As in a terminal: a process started in the background (CI, nohup) inherits SIGINT ignored.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), signal.SIGINT)
        elif kind == "sigterm_agent":
            os.kill(os.getppid(), signal.SIGTERM)
        elif kind == "sleep":
            time.sleep(float(os.environ.get("FAULT_SLEEP_SECONDS", "60")))
        elif kind in ("nan", "inf", "spike", "bad_batch"):
            factor = float(os.environ.get("FAULT_SPIKE_FACTOR", "100")) if kind in ("spike", "bad_batch") \
                else float(kind)
            loss_fn = self.loss_fn
            self.loss_fn = lambda pred, labels: loss_fn(pred, labels) * factor
            try:
                return forward_backward(self, inputs, labels)
            finally:
                self.loss_fn = loss_fn
        elif kind == "inf_grad":
            loss = forward_backward(self, inputs, labels)
            grad = next(p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None)
            (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(float("inf"))
            return loss
        elif kind == "grad_spike":
            loss = forward_backward(self, inputs, labels)
            for grad in (p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None):
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(
                    float(os.environ.get("FAULT_SPIKE_FACTOR", "100")))
            return loss
        return forward_backward(self, inputs, labels)

    def faulty_dcp_save(*args, **kwargs):
        result = dcp_save(*args, **kwargs)
        if faults.get(current["step"]) == "sigkill_in_save" or KILL_IN_NEXT_SAVE:
            report({"event": "inject", "kind": "sigkill_in_save", "step": current["step"]})
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def reporting_train_step(self, batches):
        result = train_step(self, batches)
        # A replica group's step that torchft did not commit left the weights as they were; it is run again.
        committed = self.fault_tolerance is None or self.fault_tolerance.committed
        report({"event": "step", "step": self.train_state.step + 1, "loss": result[0],
                "digest": parameter_digest(self), "committed": committed})
        return result

    log_step = train.Trainer._log_step

    def reporting_log_step(self, step, *args):
        # Logged steps are past the step's end (LocalSGD's averaging included): the weights as the step left them.
        report({"event": "logged", "step": step, "digest": parameter_digest(self)})
        return log_step(self, step, *args)

    slow_from = min((step for step, kind in faults.items() if kind == "slow"), default=None)
    next_batches = train.Trainer._next_batches

    def slow_next_batches(self, data_iterator):
        step = self.train_state.step + 1
        if step == slow_from:
            report({"event": "inject", "kind": "slow", "step": step})
        if slow_from is not None and step >= slow_from:
            time.sleep(float(os.environ.get("FAULT_SLOW_SECONDS", "0.2")))
        return next_batches(self, data_iterator)

    start_step = ReplicaGroup.start_step
    asked = []

    def reporting_start_step(self):
        step = self.states["train_state"].step + 1
        # When this process first asks the lighthouse for a quorum: a restarted group's start-up is over.
        if not asked:
            asked.append(True)
            report({"event": "first_quorum", "step": step})
        if faults.get(step) == "sigkill_at_quorum" and step not in fired:
            fired.add(step)
            report({"event": "inject", "kind": "sigkill_at_quorum", "step": step})
            os.kill(os.getpid(), signal.SIGKILL)
        return start_step(self)

    train.Trainer.forward_backward = faulty_forward_backward
    train.Trainer._next_batches = slow_next_batches
    dcp.save = faulty_dcp_save
    if os.environ.get("FAULT_REPORT_DIR") or "sigkill_at_quorum" in faults.values():
        ReplicaGroup.start_step = reporting_start_step
    if os.environ.get("FAULT_REPORT_DIR"):
        train.Trainer.train_step = reporting_train_step
        train.Trainer._log_step = reporting_log_step


def kill_in_next_save(signum, frame) -> None:
    global KILL_IN_NEXT_SAVE
    KILL_IN_NEXT_SAVE = True


def stall(signum, frame) -> None:
    report({"event": "inject", "kind": "stall"})
    time.sleep(float(os.environ.get("FAULT_SLEEP_SECONDS", "60")))
    report({"event": "stall_end"})


def main() -> int:
    wanted_attempt = os.environ.get("FAULT_ATTEMPT")
    faults = parse_plan(os.environ.get("FAULT_PLAN", ""))
    if wanted_attempt is not None and int(wanted_attempt) != ATTEMPT:
        faults = {}
    install(faults)
    signal.signal(signal.SIGUSR1, stall)
    signal.signal(signal.SIGUSR2, kill_in_next_save)
    code = train.main(sys.argv[1:])
    report({"event": "exit", "code": code})
    return code


if __name__ == "__main__":
    # As torchtitan.train's: a process exits without joining threads (torchft's quorum thread may still wait on a
    # request when a group left its quorum).
    exit_code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
