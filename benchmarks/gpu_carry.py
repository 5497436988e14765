"""The Python packages that scripts/run_gpu_checks.sh needs on a GPU machine beyond what its image has, as wheels
carried there with the working tree, and their offline installation there.

The GPU machine (docs/gpu_checks.md) has Python 3.12 and torch 2.11 with CUDA, reaches no package index, and takes
the tracked files plus at most 8 ignored paths, 64 MiB in all. What its image lacks: for this project torchao
(Float8) and torchdata; for TorchTitan 0.2.2 (benchmarks/benchmark_torchtitan.py) TorchTitan itself, torchdata,
datasets with dill and multiprocess, and tyro with typeguard and docstring-parser. Here, with a package index:

    python benchmarks/gpu_carry.py prepare                       # wheels for Python 3.12 in .carry/wheels
    python benchmarks/gpu_carry.py prepare --python 3.11         # for this machine's Python (the CPU form)

`.carry` is ignored by git: name it in the device tool's carry. There, from the repository root:

    python3 benchmarks/gpu_carry.py install /tmp/gpu_carry      # offline: /tmp/gpu_carry/deps, /tmp/gpu_carry/torchtitan
    export PYTHONPATH=/tmp/gpu_carry/deps                    # both trainers' dependencies
    PYTHONPATH=/tmp/gpu_carry/torchtitan:$PYTHONPATH python3 benchmarks/benchmark_torchtitan.py ...

TorchTitan goes to a folder of its own: its package has this project's name, and only its process may see it.
`prepare` prints one JSON line (the wheels and their sizes, the tracked files' size, the limit) and stops with an
error line if the two together exceed the limit. Only the standard library is imported (the GPU image's Python
runs `install` before anything else is there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".carry" / "wheels"
DEVICE_PYTHON = "3.12"
CARRY_LIMIT_BYTES = 64 * 2 ** 20
# The wheel tags the GPU machine (x86-64, glibc 2.28 or later) takes.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# Pinned: one version of each (two of one package stop the whole install). torchao 0.18 and the rest run with
# torch 2.11 (checked on this machine: /work/venv211); datasets 5.2 wants huggingface_hub 1.31 or later, which the
# image has (1.33).
DEPENDENCIES = {
    "torchao": "0.18.0",
    "torchdata": "0.11.0",
    "datasets": "5.2.0",
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "tyro": "1.0.17",
    "typeguard": "4.6.1",
    "docstring-parser": "0.18.0",
}
TORCHTITAN = {"torchtitan": "0.2.2"}
FOLDERS = {"deps": DEPENDENCIES, "torchtitan": TORCHTITAN}


def _download(packages: dict[str, str], folder: Path, python: str) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "--dest", str(folder),
                    *(f"{name}=={version}" for name, version in packages.items())], check=True)


def tracked_bytes() -> int:
    """The size of the files git tracks here: they travel with the carried paths, within the same limit."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / name).stat().st_size for name in names.decode().split("\0")
               if name and (REPO / name).is_file())


def check_size(wheels: dict[str, int], tracked: int, limit: int = CARRY_LIMIT_BYTES) -> None:
    total = sum(wheels.values()) + tracked
    if total > limit:
        largest = sorted(wheels, key=wheels.get, reverse=True)[:3]
        sys.exit(f"error: the wheels ({sum(wheels.values()) / 2 ** 20:.1f} MiB) and the tracked files "
                 f"({tracked / 2 ** 20:.1f} MiB) exceed the {limit / 2 ** 20:.0f} MiB that travel; largest: "
                 f"{', '.join(largest)}")


def prepare(python: str, carry: Path = CARRY) -> dict:
    shutil.rmtree(carry, ignore_errors=True)
    for name, packages in FOLDERS.items():
        (carry / name).mkdir(parents=True)
        _download(packages, carry / name, python)
    wheels = {f"{path.parent.name}/{path.name}": path.stat().st_size for path in sorted(carry.glob("*/*.whl"))}
    tracked = tracked_bytes()
    check_size(wheels, tracked)
    return {"folder": str(carry), "python": python, "wheels": wheels,
            "wheels_mib": sum(wheels.values()) / 2 ** 20, "tracked_mib": tracked / 2 ** 20,
            "limit_mib": CARRY_LIMIT_BYTES / 2 ** 20}


def install(target: Path, carry: Path = CARRY) -> dict:
    """Each folder's wheels into target/<folder>, from the carried files alone (no index)."""
    installed = {}
    for name in FOLDERS:
        wheels = sorted((carry / name).glob("*.whl"))
        if not wheels:
            sys.exit(f"error: no wheels in {carry / name}: run `python benchmarks/gpu_carry.py prepare` where a "
                     f"package index is reachable, and carry .carry")
        shutil.rmtree(target / name, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(target / name), *map(str, wheels)], check=True)
        installed[name] = [wheel.name.split("-")[0] + " " + wheel.name.split("-")[1] for wheel in wheels]
    return {"target": str(target), "installed": installed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="download the wheels into .carry/wheels")
    prepare_parser.add_argument("--python", default=DEVICE_PYTHON,
                                help=f"the Python version they are for (default {DEVICE_PYTHON}, the GPU image's)")
    install_parser = commands.add_parser("install", help="install the carried wheels into TARGET, offline")
    install_parser.add_argument("target", type=Path)
    for command in (prepare_parser, install_parser):
        command.add_argument("--carry", type=Path, default=CARRY, help="the wheels' folder (default .carry/wheels)")
    args = parser.parse_args(argv)
    result = prepare(args.python, args.carry) if args.command == "prepare" else install(args.target, args.carry)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
