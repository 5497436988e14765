"""Communication-efficient recipes on two emulated hosts joined by a slow link: bytes, speed and loss per recipe.

From the repository root (as root, for the network namespaces; without root the same runs go over loopback,
unthrottled and without link counters, and the report says so):

    python benchmarks/comm_bench.py --out docs/comm_bench --steps 300 --rate 1000
    python benchmarks/comm_bench.py --out /tmp/slow --steps 20 --rate 100 --recipes fsdp,loco4
    python benchmarks/comm_bench.py --out /tmp/err --quantization-error-only

Each recipe trains the debug model (train_configs/debug_model.toml, seed 0, same data) as one job over two hosts of
`--nproc-per-host` processes. Per recipe it reports the bytes per step by ring arithmetic (what NCCL's ring
collectives send: the baseline's collectives counted by a dry run of it, the compressed ones by the trainer's own
counters), the bytes that crossed the inter-host link per step as gloo sent them (the veth pair's own counters,
sampled while it runs and read at the first and last logged step, so start-up traffic is left out; gloo's
reduce-scatter sends about twice a ring's), the step time and tokens/s per device (median over the logged steps after the fifth), and the loss: final
(mean of the last 10 steps) and relative to the recipe's baseline, which has the same layout, seed and data.
Recipes and their baselines:

    fsdp            FSDP over both hosts, AdamW (the baseline of loco4, loco4_hadamard, ef4, qsdp8, qsdp8_hadamard)
    loco4           + comm.gradient_compression = loco, 4-bit gradients, LoCo's moving-average compensation
    ef4             + comm.gradient_compression = error_feedback, 4-bit gradients, classic error feedback
    loco4_hadamard  + the Hadamard rotation
    qsdp8           + 8-bit weights (stochastic rounding) and 8-bit stochastically rounded gradients
    qsdp8_hadamard  + the Hadamard rotation
    ddp             one replica per host, AdamW, gradients all-reduced (the baseline of flexdemo)
    flexdemo        one replica per host, FlexDeMo (DeMo's step: each 64 x 64 DCT tile's top 32 exchanged)
    muon            FSDP, Muon (its Newton-Schulz spread over the ranks, the results all-gathered)
    galore          FSDP, GaLore-AdamW (galore.scale 2, a subspace refresh every 75 steps)
    ranger21        FSDP, Ranger21 (weight decay 1e-4: its stable decay is in other units than AdamW's)
    rtp             rotated tensor parallelism over both hosts instead of FSDP (its bytes from a dry run of its own)
(The optimizers' recipes are for their bytes and speed on the link; their losses at their own learning rates,
over seeds, are in docs/recipes.md's optimizer section.)

Writes OUT/results.json, OUT/comm_bench.md (also printed) and the plots OUT/loss_vs_step.png,
OUT/loss_vs_bytes.png and OUT/throughput.png. `--quantization-error-only` measures the relative L2 error of the
wire format on the debug model's real weights and gradients, with and without the rotation (OUT/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchtitan.tools.dry_run_report import read_report  # noqa: E402
from torchtitan.tools.emulated_cluster import Hosts, launch_on_hosts, two_hosts  # noqa: E402

CONFIG = "train_configs/debug_model.toml"
FSDP = ["--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "-1"]
# The replicate degree ("2") is --replicas (recipe_options).
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "-1"]
LOCO4 = ["--comm.gradient_compression", "loco", "--comm.gradient_bits", "4"]
EF4 = ["--comm.gradient_compression", "error_feedback", "--comm.gradient_bits", "4"]
QSDP8 = ["--comm.weight_quantization", "qsdp", "--comm.weight_bits", "8", "--comm.gradient_compression", "qsdp",
         "--comm.gradient_bits", "8"]
HADAMARD = ["--comm.quantization_rotation", "hadamard"]
# name -> (baseline, trainer options)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "fsdp": ("fsdp", FSDP),
    "loco4": ("fsdp", [*FSDP, *LOCO4]),
    "loco4_hadamard": ("fsdp", [*FSDP, *LOCO4, *HADAMARD]),
    "ef4": ("fsdp", [*FSDP, *EF4]),
    "qsdp8": ("fsdp", [*FSDP, *QSDP8]),
    "qsdp8_hadamard": ("fsdp", [*FSDP, *QSDP8, *HADAMARD]),
    "ddp": ("ddp", DDP),
    "flexdemo": ("ddp", [*DDP, "--optimizer.name", "FlexDeMo"]),
    "muon": ("fsdp", [*FSDP, "--optimizer.name", "Muon"]),
    "galore": ("fsdp", [*FSDP, "--optimizer.name", "GaLore-AdamW", "--optimizer.galore.scale", "2",
                        "--optimizer.galore.update_gap", "75"]),
    "ranger21": ("fsdp", [*FSDP, "--optimizer.name", "Ranger21", "--optimizer.weight_decay", "1e-4"]),
    "rtp": ("fsdp", [*FSDP, "--parallelism.data_parallel_shard_method", "rotated"]),
}
# Recipes that replace their baseline's collectives by others (not by compressed ones the trainer counts beside
# them): their ring bytes come from a dry run of their own.
OWN_COLLECTIVES = {"rtp"}


def recipe_options(name: str, args: argparse.Namespace) -> list[str]:
    """The recipe's trainer options, its replicated layouts with --replicas replicas (each sharded over the rest)."""
    options = list(RECIPES[name][1])
    if options[:len(DDP)] == DDP:
        options[1] = str(args.replicas)
    return options


# Bytes one rank sends in NCCL's ring algorithms per byte of a collective's buffer (what a dry run counts: the
# gathered output of an all-gather, the unreduced input of a reduce-scatter, the tensor of an all-reduce, the whole
# buffer of an all-to-all), in a group of n ranks.
RING_SHARE = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
              # Point-to-point (rotated tensor parallelism's shifts): a rank sends what it sends, once.
              "send": lambda n: 1.0, "recv": lambda n: 0.0}


def ring_bytes_per_step(baseline: str, args: argparse.Namespace, out: Path) -> float:
    """Bytes all ranks together send per step in the baseline's data-parallel collectives, as NCCL's ring
    algorithms send them: a dry run of the baseline (one fake rank of the same world; every rank of these layouts
    issues the same collectives) counts one step's collectives and their buffers."""
    import subprocess

    world = 2 * args.nproc_per_host
    dump = out / "dry_runs" / baseline
    subprocess.run([sys.executable, "-m", "torchtitan.train", "--job.config_file", CONFIG, "--comm.mode",
                    "fake_backend", "--comm.fake_world_size", str(world), "--comm.no_fake_other_end",
                    "--job.dump_folder", str(dump), "--training.local_batch_size", str(args.local_batch_size),
                    *recipe_options(baseline, args)], cwd=REPO, check=True, capture_output=True)
    report = read_report(dump)
    per_rank = 0.0
    for collective in report["collectives"]:
        group = report["layout"][collective["mesh_dim"]] if collective["mesh_dim"] in report["layout"] else world
        per_rank += RING_SHARE[collective["kind"]](group) * collective["bytes"]
    return per_rank * world


class LinkSampler:
    """Samples the link's byte counter every `interval` seconds while a job runs."""

    def __init__(self, hosts: Hosts, interval: float = 0.2):
        self.hosts, self.interval = hosts, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.hosts.link_bytes()))
            self._stop.wait(self.interval)

    def __enter__(self) -> LinkSampler:
        if self.hosts.emulated:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def at(self, when: float) -> float:
        """The counter at time `when`, interpolated between the samples around it."""
        before = max((s for s in self.samples if s[0] <= when), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= when), default=self.samples[-1])
        if after[0] == before[0]:
            return float(before[1])
        return before[1] + (after[1] - before[1]) * (when - before[0]) / (after[0] - before[0])


def run_recipe(name: str, hosts: Hosts, args: argparse.Namespace, out: Path, seed: int = 0) -> dict:
    dump = out / "runs" / (name if seed == 0 else f"{name}_seed{seed}")
    trainer_args = ["--job.config_file", CONFIG, "--training.steps", str(args.steps), "--metrics.log_freq", "1",
                    "--validation.no_enable", "--debug.seed", str(seed), "--metrics.disable_color_printing",
                    "--training.local_batch_size", str(args.local_batch_size), *recipe_options(name, args)]
    if dump.exists():
        for leftover in dump.glob("*"):
            if leftover.is_file():
                leftover.unlink()
    dump.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with LinkSampler(hosts) as sampler:
        agents = launch_on_hosts(hosts, args.nproc_per_host, trainer_args, dump, REPO, timeout=args.timeout)
    (dump / "train.log").write_text("\n\n".join(agent.stdout for agent in agents))
    for node, agent in enumerate(agents):
        if agent.returncode != 0:
            raise SystemExit(f"recipe {name}: host {node} exited {agent.returncode}; see {dump / 'train.log'}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "loss" in row]
    world = 2 * args.nproc_per_host
    steady = [row for row in rows if row["step"] > 5] or rows
    tps = statistics.median(row["tps"] for row in steady)
    tokens_per_step = args.local_batch_size * 256 * world  # debug_model.toml: seq_len 256
    result = {
        "recipe": name, "baseline": RECIPES[name][0], "seed": seed, "steps": len(rows), "wall_s": time.time() - began,
        "peak_memory_gib": max(row.get("memory_gib", 0.0) for row in rows),
        "losses": [row["loss"] for row in rows], "final_loss": statistics.mean(row["loss"] for row in rows[-10:]),
        "tps_per_device": tps, "step_time_s": tokens_per_step / (tps * world),
        "link_bytes_per_step": None, "link_bytes_cumulative": None,
        # What the compressed collectives (or FlexDeMo's exchange) sent per step, all ranks, and what the
        # full-precision collectives they replace would have, both by ring arithmetic (the trainer's counters).
        "ring_sent_minus_replaced_per_step": world * 2**20 * statistics.mean(
            row.get("comm_sent_mib_per_step", 0.0) - row.get("comm_full_precision_mib_per_step", 0.0)
            for row in steady),
    }
    if hosts.emulated and len(rows) > 1:
        first, last = rows[0], rows[-1]
        counted = sampler.at(last["time"]) - sampler.at(first["time"])
        result["link_bytes_per_step"] = counted / (last["step"] - first["step"])
        start = sampler.at(first["time"])
        result["link_bytes_cumulative"] = [sampler.at(row["time"]) - start for row in rows]
    return result


def quantization_errors(out: Path) -> str:
    """Relative L2 error of one trip through the wire format, over the debug model's weights and its gradients
    after 20 AdamW steps on the embedded corpus (one process), per bits and rotation."""
    import torch
    import torch.nn.functional as F

    from torchtitan.components.datasets import build_dataloader
    from torchtitan.components.tokenizer import build_model_tokenizer
    from torchtitan.config.job_config import Model
    from torchtitan.distributed.compression.quantize import relative_error
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    torch.manual_seed(0)
    tokenizer = build_model_tokenizer(Model())
    model = Transformer(model_args_for("debugmodel", 256, tokenizer.vocab_size))
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = build_dataloader(dataset="embedded", dataset_path=None, text_field="text", tokenizer=tokenizer,
                              seq_len=256, local_batch_size=8, dp_rank=0, dp_degree=1, infinite=True,
                              config_section="training")
    batches = iter(loader)
    for _ in range(20):
        inputs, labels = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
        optimizer.step()
    lines = ["| tensors | bits | rounding | no rotation | Hadamard rotation |", "|---|---|---|---|---|"]
    for kind, stochastic, bits in (("gradients", False, 4), ("gradients", False, 8), ("weights", True, 8),
                                   ("weights", True, 4)):
        errors = {}
        for rotate in (False, True):
            total_error = total_norm = 0.0
            for param in model.parameters():
                values = (param.grad if kind == "gradients" else param.detach()).reshape(1, -1)
                norm = float(values.norm()) ** 2
                total_error += (relative_error(values, bits, stochastic, rotate) ** 2) * norm
                total_norm += norm
            errors[rotate] = (total_error / total_norm) ** 0.5
        lines.append(f"| {kind} | {bits} | {'stochastic' if stochastic else 'nearest'} | {errors[False]:.4f} | "
                     f"{errors[True]:.4f} |")
    table = "\n".join(lines) + "\n"
    (out / "quantization.md").write_text(table)
    return table


def report(results: list[dict], hosts_note: str, args: argparse.Namespace, out: Path) -> str:
    by_name = {r["recipe"]: r for r in results}
    lines = [f"Debug model, {args.steps} steps, seed {results[0]['seed']}, 2 hosts x {args.nproc_per_host} process(es), "
             f"{args.replicas} replicas (ddp, flexdemo), local batch {args.local_batch_size}, {hosts_note}. Ring MB/step: what NCCL's ring collectives would send, all "
             f"ranks (the baseline's collectives from a dry run, the compressed ones from the trainer's counters); "
             f"link MB/step: what gloo sent over the link (its reduce-scatter sends about twice a ring's).", "",
             "| recipe | baseline | ring MB/step | vs baseline | link MB/step (gloo) | vs baseline | step time (s) | "
             "tokens/s/device | vs baseline | final loss | vs baseline |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = by_name.get(r["baseline"])
        ring, base_ring = r["ring_bytes_per_step"], base["ring_bytes_per_step"] if base else None
        lines.append(f"| {r['recipe']} | {r['baseline']} | {ring / 1e6:.2f} | "
                     f"{f'{ring / base_ring:.1%}' if base_ring else '-'} | ")
        mb = r["link_bytes_per_step"]
        bytes_ratio = (f"{mb / base['link_bytes_per_step']:.1%}"
                       if base and mb is not None and base["link_bytes_per_step"] else "-")
        tps_ratio = f"{r['tps_per_device'] / base['tps_per_device']:.2f}x" if base else "-"
        loss_ratio = f"{(r['final_loss'] / base['final_loss'] - 1):+.2%}" if base else "-"
        lines[-1] += f"{mb / 1e6:.2f} | {bytes_ratio} | " if mb is not None else "- | - | "
        lines[-1] += (f"{r['step_time_s']:.3f} | {r['tps_per_device']:.0f} | {tps_ratio} | {r['final_loss']:.4f} | "
                      f"{loss_ratio} |")
    return "\n".join(lines) + "\n"


def seeds_report(results: list[dict], args: argparse.Namespace) -> str:
    """Each recipe over the seeds: final loss and its change from the baseline run of the same seed (mean and
    sample standard deviation over the seeds), bytes, memory and step time."""
    seeds = sorted({r["seed"] for r in results})
    runs = {(r["recipe"], r["seed"]): r for r in results}
    lines = [f"Over seeds {', '.join(map(str, seeds))} (`--debug.seed`: the model's initialisation; the data is the "
             f"same): mean ± sample standard deviation; the change is each seed's against its own baseline run.", "",
             "| recipe | baseline | final loss | vs baseline | ring MB/step | vs baseline | peak memory per rank (GiB) "
             "| step time (s) |", "|---|---|---|---|---|---|---|---|"]

    def spread(values: list[float], fmt: str) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{format(statistics.mean(values), fmt)} ± {format(sd, fmt.replace('+', ''))}"

    for name in dict.fromkeys(r["recipe"] for r in results):
        mine = [runs[name, seed] for seed in seeds if (name, seed) in runs]
        bases = [runs.get((r["baseline"], r["seed"])) for r in mine]
        changes = [100 * (r["final_loss"] / b["final_loss"] - 1) for r, b in zip(mine, bases) if b]
        ring, base_ring = mine[0]["ring_bytes_per_step"], bases[0]["ring_bytes_per_step"] if bases[0] else None
        lines.append(f"| {name} | {mine[0]['baseline']} | {spread([r['final_loss'] for r in mine], '.4f')} | "
                     f"{spread(changes, '+.2f') + '%' if name != mine[0]['baseline'] and changes else '-'} | "
                     f"{ring / 1e6:.2f} | {f'{ring / base_ring:.1%}' if base_ring else '-'} | "
                     f"{spread([r['peak_memory_gib'] for r in mine], '.3f')} | "
                     f"{spread([r['step_time_s'] for r in mine], '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["recipe"], linewidth=1)
    ax.set(xlabel="step", ylabel="training loss", title="Loss vs step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_step.png", dpi=110)
    plt.close(fig)
    if all(r["link_bytes_cumulative"] for r in results):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in results:
            ax.plot([b / 1e9 for b in r["link_bytes_cumulative"]], r["losses"], label=r["recipe"], linewidth=1)
        ax.set(xlabel="GB sent over the inter-host link", ylabel="training loss", title="Loss vs bytes sent")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss_vs_bytes.png", dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar([r["recipe"] for r in results], [r["tps_per_device"] for r in results])
    ax.set(ylabel="tokens/s per device (median)", title="Throughput")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def earlier_runs(args: argparse.Namespace) -> list[dict]:
    """The runs an earlier invocation kept in OUT/results_partial.json, checked to be of the same length."""
    partial = args.out / "results_partial.json"
    if not partial.exists():
        raise SystemExit(f"--resume: {partial} does not exist; run without --resume to start a sweep there")
    results = json.loads(partial.read_text())["results"]
    other = sorted({r["steps"] for r in results} - {args.steps})
    if other:
        raise SystemExit(f"--resume: {partial} holds runs of {other} steps, not --steps {args.steps}; "
                         "resume with the same --steps or start another --out")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma separated, from: " + ", ".join(RECIPES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rate", type=float, default=0, help="link rate in Mbit/s each way; 0 = unthrottled")
    parser.add_argument("--nproc-per-host", type=int, default=1)
    parser.add_argument("--local-batch-size", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2,
                        help="replicas of ddp and flexdemo (a divisor of 2 x --nproc-per-host); 2: one per host")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per recipe")
    parser.add_argument("--seeds", default="0", help="comma separated --debug.seed values: every recipe runs with "
                        "each, and a table gives each recipe's mean and spread over them")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in OUT/results_partial.json (a sweep stopped early, or one "
                        "extended with more recipes or seeds) and run only the missing ones; every run must have "
                        "the same --steps")
    parser.add_argument("--quantization-error-only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quantization_error_only:
        print(quantization_errors(args.out))
        return 0
    if args.replicas < 2 or 2 * args.nproc_per_host % args.replicas:
        parser.error(f"--replicas: {args.replicas} must be at least 2 and divide 2 x --nproc-per-host "
                     f"({2 * args.nproc_per_host})")
    names = [name for name in args.recipes.split(",") if name]
    unknown = [name for name in names if name not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; valid: {', '.join(RECIPES)}")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma separated list of integers")
    results = earlier_runs(args) if args.resume else []
    done = {(r["recipe"], r["seed"]) for r in results}
    with two_hosts(args.rate or None) as hosts:
        note = (f"link {'throttled to ' + format(args.rate, 'g') + ' Mbit/s' if args.rate else 'unthrottled (veth)'}"
                if hosts.emulated else f"loopback, unthrottled, no link counters ({hosts.why_not})")
        for seed in seeds:
            for name in names:
                if (name, seed) in done:
                    continue
                print(f"running {name} (seed {seed}) ...", flush=True)
                results.append(run_recipe(name, hosts, args, args.out, seed))
                # Kept as each run ends: a long sweep stopped early still has what it measured.
                (args.out / "results_partial.json").write_text(json.dumps({"note": note, "results": results}))
    ring = {name: ring_bytes_per_step(name, args, args.out)
            for name in {r["baseline"] for r in results} | ({r["recipe"] for r in results} & OWN_COLLECTIVES)}
    for r in results:
        r["ring_bytes_per_step"] = ring[r["recipe"]] if r["recipe"] in OWN_COLLECTIVES else \
            ring[r["baseline"]] + r["ring_sent_minus_replaced_per_step"]
    table = report([r for r in results if r["seed"] == seeds[0]], note, args, args.out)
    if len(seeds) > 1:
        table += "\n" + seeds_report(results, args)
    (args.out / "results.json").write_text(json.dumps({"note": note, "results": results}, indent=1))
    (args.out / "comm_bench.md").write_text(table)
    plot([r for r in results if r["seed"] == seeds[0]], args.out)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
