"""Checkpointing: DCP round trips, crash safety, bad inputs, async modes, FSDP resharding and Hugging Face export."""

import contextlib
import copy
import dataclasses
import errno
import json
import multiprocessing
import os
import pickle
import random
import re
import stat as stat_module
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from scripts import convert_checkpoint
from tests.unit.forked_ranks import in_environment, join_forked
from torchtitan.components.checkpoint import integrity as checkpoint_integrity
from torchtitan.components.checkpoint import manager as manager_module
from torchtitan.components.checkpoint import resume as resume_module
from torchtitan.components.checkpoint import (CHECKSUMS_FILE, CheckpointManager, TrainState, complete_steps,
                                              read_full_checkpoint, read_full_model, read_metadata)
from torchtitan.components.checkpoint.hf_folder import INDEX_FILE, load_hf, save_hf
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for, model_shape
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.tools.logging import logger

SEQ_LEN = 32
MODEL_ARGS = model_args_for("tiny", SEQ_LEN)
ADAPTER = Llama3StateDictAdapter(MODEL_ARGS)


class FakeLoader(Stateful):
    """Stands in for the data loader: its state is whatever position it reached."""

    def __init__(self):
        self.position = 0
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch, "seen": [self.position] * 3}

    def load_state_dict(self, state_dict: dict) -> None:
        self.position, self.epoch = state_dict["position"], state_dict["epoch"]


@dataclasses.dataclass
class Components:
    model: torch.nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    loader: FakeLoader
    train_state: TrainState


def build_model(seed: int, args=MODEL_ARGS) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed)
    return model


def build_components(seed: int, model: torch.nn.Module | None = None) -> Components:
    model = model if model is not None else build_model(seed)
    optimizers = OptimizersContainer([model], OptimizerConfig(lr=1e-3, implementation="foreach"))
    return Components(model, optimizers, LRSchedulersContainer(optimizers, LRSchedulerConfig(warmup_steps=2), 10),
                      FakeLoader(), TrainState())


def train_step(c: Components, step: int) -> float:
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step))
    logits = c.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    c.optimizers.step()
    c.lr_schedulers.step()
    c.optimizers.zero_grad()
    c.loader.position += 2
    c.train_state.step = step
    c.train_state.tokens_seen += 2 * SEQ_LEN
    return loss.item()


def make_manager(root: Path, c: Components, peer_folders: tuple[Path, ...] = (), **options) -> CheckpointManager:
    config = CheckpointConfig(**{"enable": True, "folder": "ckpt", "interval": 1, **options})
    return CheckpointManager(config, str(root), [c.model], c.optimizers, c.lr_schedulers, c.loader, c.train_state,
                             model_shape(MODEL_ARGS), ADAPTER, peer_folders=peer_folders)


def snapshot(c: Components) -> dict:
    """Copies of every component's state (state dicts hold live tensors that the next step changes)."""
    return copy.deepcopy({"model": c.model.state_dict(), "optimizer": c.optimizers.state_dict(),
                          "lr": c.lr_schedulers.state_dict(), "loader": c.loader.state_dict(),
                          "train_state": c.train_state.state_dict()})


def assert_same(actual, expected, where: str = "") -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def step_folders(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "ckpt").iterdir())


@contextlib.contextmanager
def single_process_group(tmp_path: Path):
    """A 1-rank gloo group, as the trainer always has one; destroyed after the test so that later tests can fork."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg_store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def pg(tmp_path):
    with single_process_group(tmp_path):
        yield


# ----------------------------------------------------------------------------------------------------------------
# Single process


def test_round_trip_restores_every_component(pg, tmp_path):
    saved = build_components(seed=0)
    train_step(saved, 1)
    random.seed(5)
    torch.manual_seed(5)
    manager = make_manager(tmp_path, saved)
    manager.save(1)
    expected = snapshot(saved)
    next_draws = (random.random(), torch.rand(3))
    expected_next_loss = train_step(saved, 2)

    resumed = build_components(seed=1)
    assert make_manager(tmp_path, resumed).load()
    assert_same(snapshot(resumed), expected)
    assert random.random() == next_draws[0]
    assert torch.equal(torch.rand(3), next_draws[1])
    assert train_step(resumed, 2) == expected_next_loss
    assert step_folders(tmp_path) == ["step-1"]


def test_resume_picks_latest_or_load_step(pg, tmp_path):
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, interval=2)
    for step in range(1, 5):
        c.train_state.step = step
        manager.save(step)
    assert step_folders(tmp_path) == ["step-2", "step-4"]

    for load_step, expected in [(-1, 4), (2, 2)]:
        fresh = build_components(seed=1)
        make_manager(tmp_path, fresh, load_step=load_step).load()
        assert fresh.train_state.step == expected
    with pytest.raises(UserError, match=r"load_step: step 3 .*available steps: 2, 4"):
        make_manager(tmp_path, build_components(seed=1), load_step=3).load()


def test_a_replica_group_resumes_from_a_peer_groups_newer_checkpoint(pg, tmp_path):
    """Replica groups (fault tolerance) hold equal states at every committed step: a group whose own checkpoint is
    older, or missing, resumes from the newest full checkpoint of the others, so that it neither starts behind nor,
    training alone while they are down, overwrites their progress when they heal from it."""
    groups = [tmp_path / f"replica_{i}" for i in range(3)]
    c = build_components(seed=0)
    for step in (1, 2, 3):
        train_step(c, step)
        if step == 1:
            make_manager(groups[0], c).save(step)  # group 0 saved only step 1
        elif step == 2:
            make_manager(groups[2], c).save(step)
    resumed = build_components(seed=1)
    make_manager(groups[2], resumed).load()
    expected_at_2 = snapshot(resumed)
    make_manager(groups[1], c, last_save_model_only=True).save(3, last_step=True)  # newer, but weights only

    for own in (groups[0], groups[1]):  # an older checkpoint of its own; none but a model-only one
        fresh = build_components(seed=2)
        peers = tuple(g / "ckpt" for g in groups if g != own)
        assert make_manager(own, fresh, peer_folders=peers).load()
        assert fresh.train_state.step == 2
        assert_same(snapshot(fresh), expected_at_2)
    # Its own checkpoint wins a tie, and without peers nothing changes.
    fresh = build_components(seed=2)
    assert make_manager(groups[0], fresh).load() and fresh.train_state.step == 1


def test_nothing_to_load_and_disabled(pg, tmp_path):
    assert not make_manager(tmp_path, build_components(seed=0)).load()
    c = build_components(seed=0)
    make_manager(tmp_path, c, enable=False).save(1, last_step=True)
    make_manager(tmp_path, c, load_only=True).save(1, last_step=True)
    assert not (tmp_path / "ckpt").exists()


def test_save_schedule(pg, tmp_path):
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, interval=5, enable_first_step_checkpoint=True, keep_latest_k=0)
    for step in range(1, 8):
        manager.save(step, last_step=step == 7, force=step == 3)
    assert step_folders(tmp_path) == ["step-1", "step-3", "step-5", "step-7"]


def test_saves_log_their_cost_and_a_forced_save_its_estimate(pg, tmp_path, monkeypatch):
    messages = []
    monkeypatch.setattr(manager_module.logger, "info", messages.append)
    monkeypatch.setattr(manager_module.logger, "warning", messages.append)
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, interval=2)
    manager.save(2)
    assert len(manager.save_s) == len(manager.publish_cost) == len(manager.metadata_cost) == 1
    assert any(re.search(r"step-2: rank 0 wrote \d+\.\d+ MiB .* every rank had written after \d+\.\d+ s, publishing "
                         r"took \d+\.\d+ s \(\d+\.\d+ s CPU\), DCP's \.metadata \d+\.\d+ s before it", message)
               for message in messages), messages
    manager.save(3, force=True)
    assert any(re.fullmatch(rf"Preemption: saving a full checkpoint of step 3 now; the previous save of this run "
                            rf"took {manager.save_s[0]:.2f} s until every rank had written", message)
               for message in messages), messages


def test_keep_latest_k_and_leftovers(pg, tmp_path):
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, keep_latest_k=2)
    manager.save(1)
    manager.save(2)
    leftover = tmp_path / "ckpt" / "step-9.incomplete"
    leftover.mkdir()
    (leftover / "junk").write_text("x")
    fresh = build_components(seed=1)
    make_manager(tmp_path, fresh).load()
    assert fresh.train_state.step == c.train_state.step  # step-9.incomplete is not a checkpoint
    manager.save(3)
    # step-9.incomplete went at the start of the save; step-1 is out of the resume's reach at once, and deleted at
    # the next save or at close.
    assert step_folders(tmp_path) == ["step-1.deleted.incomplete", "step-2", "step-3"]
    manager.close()
    assert step_folders(tmp_path) == ["step-2", "step-3"]


def save_steps(manager: CheckpointManager, c: Components, steps: range, last: int = -1) -> None:
    for step in steps:
        c.train_state.step = step
        manager.save(step, last_step=step == last)


def test_keep_latest_k_counts_only_full_checkpoints(pg, tmp_path):
    """A model-only last save does not evict the full checkpoint that a relaunch resumes from."""
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, interval=2, keep_latest_k=1)
    manager.save_seed()
    save_steps(manager, c, range(1, 4), last=3)
    manager.close()
    # step-0 (the seed, model-only) went once a newer full checkpoint was kept.
    assert step_folders(tmp_path) == ["step-2", "step-3"]
    relaunched = build_components(seed=1)
    manager = make_manager(tmp_path, relaunched, interval=2, keep_latest_k=1)
    assert manager.load()
    assert relaunched.train_state.step == 2
    save_steps(manager, relaunched, range(3, 5))
    manager.close()
    # step-3 was replaced by a full checkpoint, then deleted with step-2 when step-4 was kept.
    assert step_folders(tmp_path) == ["step-4"]


@pytest.mark.parametrize("keep_latest_k", [2, 0])
def test_rollback_retires_the_abandoned_checkpoints_after_its_first_save(pg, tmp_path, keep_latest_k):
    c = build_components(seed=0)
    save_steps(make_manager(tmp_path, c, interval=2), c, range(1, 7))
    assert step_folders(tmp_path) == ["step-2", "step-4", "step-6"]

    rollback = build_components(seed=1)
    manager = make_manager(tmp_path, rollback, load_step=2, keep_latest_k=keep_latest_k)
    assert manager.load()
    assert rollback.train_state.step == 2
    # Nothing is lost while the rollback run has no checkpoint of its own: if it died now, step-6 would resume.
    assert step_folders(tmp_path) == ["step-2", "step-4", "step-6"]
    save_steps(manager, rollback, range(3, 4))
    manager.close()
    retired = [] if keep_latest_k else ["step-4.abandoned", "step-6.abandoned"]
    assert step_folders(tmp_path) == sorted(["step-2", "step-3", *retired])

    restarted = build_components(seed=2)
    make_manager(tmp_path, restarted, keep_latest_k=keep_latest_k).load()
    assert restarted.train_state.step == 3


def test_resume_without_train_state_keeps_the_checkpoint_it_loaded(pg, tmp_path):
    """Excluding train_state restarts at step 0 from the latest checkpoint: that run's first save retires the newer
    trajectory, but the checkpoint it loaded is renamed aside, not deleted."""
    c = build_components(seed=0)
    save_steps(make_manager(tmp_path, c, interval=2), c, range(1, 5))
    assert step_folders(tmp_path) == ["step-2", "step-4"]
    restarted = build_components(seed=1)
    manager = make_manager(tmp_path, restarted, interval=2, exclude_from_loading=["train_state"])
    assert manager.load()
    assert restarted.train_state.step == 0
    save_steps(manager, restarted, range(1, 3))
    manager.close()
    assert step_folders(tmp_path) == ["step-2", "step-4.abandoned"]
    # The kept folder is still a loadable checkpoint of step 4.
    (tmp_path / "ckpt" / "step-4.abandoned").rename(tmp_path / "elsewhere")
    fresh = build_components(seed=2)
    make_manager(tmp_path, fresh, initial_load_path=str(tmp_path / "elsewhere"),
                 initial_load_model_only=False, folder="other").load()
    assert fresh.train_state.step == 4


def test_saving_an_existing_step_replaces_it_once_complete(pg, tmp_path):
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c)
    manager.save(2)
    c.train_state.tokens_seen = 1234
    manager.save(2)
    assert step_folders(tmp_path) == ["step-2", "step-2.stale.incomplete"]
    manager.close()
    assert step_folders(tmp_path) == ["step-2"]
    fresh = build_components(seed=1)
    make_manager(tmp_path, fresh).load()
    assert fresh.train_state.tokens_seen == 1234


def test_exclude_from_loading(pg, tmp_path):
    saved = build_components(seed=0)
    train_step(saved, 1)
    make_manager(tmp_path, saved).save(1)
    fresh = build_components(seed=1)
    before = snapshot(fresh)
    make_manager(tmp_path, fresh, exclude_from_loading=["optimizer", "dataloader"]).load()
    after = snapshot(fresh)
    # The learning rates in param_groups come from the (loaded) scheduler; the moments must stay.
    moments = {key: value for key, value in after["optimizer"].items() if key.startswith("state.")}
    assert moments and all(torch.equal(value, before["optimizer"][key]) for key, value in moments.items())
    assert_same(after["loader"], before["loader"])
    assert_same(after["model"], snapshot(saved)["model"])


def files_and_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def assert_manifest_matches(folder: Path) -> None:
    """checksums.json lists every file DCP wrote, with its size and CRC32."""
    written = sorted(p.name for p in folder.iterdir() if p.name == ".metadata" or p.suffix == ".distcp")
    assert any(name.endswith(".distcp") for name in written)
    manifest = json.loads((folder / CHECKSUMS_FILE).read_text())
    assert manifest["algorithm"] == "crc32"
    assert manifest["files"] == {name: {"size": (folder / name).stat().st_size,
                                        "crc32": f"{zlib.crc32((folder / name).read_bytes()):08x}"}
                                 for name in written}


def flip_middle_bytes(path: Path) -> None:
    """Damage that keeps the size: 8 bytes in the middle of the file inverted."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(byte ^ 0xFF for byte in data[middle:middle + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_every_save_writes_a_manifest_of_its_files(pg, tmp_path, monkeypatch, mode):
    read_back = []
    file_checksum = checkpoint_integrity._file_checksum
    monkeypatch.setattr(checkpoint_integrity, "_file_checksum", lambda path: read_back.append(path.name)
                        or file_checksum(path))
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, async_mode=mode)
    manager.save(1)
    manager.save(2, last_step=True)  # model-only
    manager.close()
    for step in ("step-1", "step-2"):
        assert_manifest_matches(tmp_path / "ckpt" / step)
    # Every file was hashed as it was written, `.metadata` too: nothing is read back.
    assert read_back == []


def two_checkpoints(tmp_path: Path) -> tuple[dict[str, bytes], Path, Path]:
    """Saves step-1 and step-2; returns step-1's files (to check they stay untouched), step-2's folder and a shard."""
    manager = make_manager(tmp_path, build_components(seed=0))
    manager.save(1)
    manager.save(2)
    step2 = tmp_path / "ckpt" / "step-2"
    return files_and_bytes(tmp_path / "ckpt" / "step-1"), step2, next(step2.glob("*.distcp"))


def test_flipped_bytes_in_a_shard_name_the_file(pg, tmp_path):
    """Same size, other bytes: DCP would load them as weights. Resuming reports the damage of the latest checkpoint
    rather than pass it over, and neither it nor the previous one is touched."""
    first, step2, shard = two_checkpoints(tmp_path)
    recorded = json.loads((step2 / CHECKSUMS_FILE).read_text())["files"][shard.name]
    flip_middle_bytes(shard)
    damaged = files_and_bytes(step2)
    size, crc = recorded["size"], recorded["crc32"]
    actual_crc = f"{zlib.crc32(shard.read_bytes()):08x}"
    pattern = (rf"checkpoint {re.escape(str(step2))} cannot be loaded \(corrupt\): {re.escape(str(shard))} has "
               rf"{size} bytes with CRC32 {actual_crc}, but checksums\.json records {size} bytes with CRC32 {crc}")
    with pytest.raises(UserError, match=pattern):
        make_manager(tmp_path, build_components(seed=1)).load()
    with pytest.raises(UserError, match=pattern):
        read_full_model(step2)
    with pytest.raises(UserError, match=pattern):
        read_full_checkpoint(step2)
    assert step_folders(tmp_path) == ["step-1", "step-2"]
    assert files_and_bytes(step2) == damaged
    assert files_and_bytes(tmp_path / "ckpt" / "step-1") == first


def test_checkpoint_without_manifest_loads_with_a_warning(pg, tmp_path, monkeypatch):
    """As one saved by an older version, `scripts/convert_checkpoint.py hf-to-dcp` or a plain dcp.save."""
    saved = build_components(seed=0)
    train_step(saved, 1)
    make_manager(tmp_path, saved).save(1)
    (tmp_path / "ckpt" / "step-1" / CHECKSUMS_FILE).unlink()
    warned = []
    monkeypatch.setattr(checkpoint_integrity, "warn_once", warned.append)
    fresh = build_components(seed=1)
    assert make_manager(tmp_path, fresh).load()
    assert_same(snapshot(fresh), snapshot(saved))
    assert warned == [f"checkpoint {tmp_path / 'ckpt' / 'step-1'} has no checksums.json (saved by an older "
                      f"version or another tool): its files are loaded without an integrity check"]


def test_corrupt_checkpoints_raise_user_errors(pg, tmp_path):
    first, step2, shard = two_checkpoints(tmp_path)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(UserError, match=rf"step-2 cannot be loaded \(corrupt\): {re.escape(str(shard))} has "
                                        rf"{size // 2} bytes with CRC32 [0-9a-f]{{8}}, but checksums\.json records "
                                        rf"{size} bytes"):
        make_manager(tmp_path, build_components(seed=1)).load()
    (step2 / CHECKSUMS_FILE).write_text('{"algorithm": "crc32", "files": {"../step-1/.metadata": {}}}')
    with pytest.raises(UserError, match=r"step-2/checksums\.json cannot be read \(ValueError: an entry is not a "
                                        r"plain file name"):
        make_manager(tmp_path, build_components(seed=1)).load()
    (step2 / ".metadata").unlink()
    with pytest.raises(UserError, match=r"step-2 has no \.metadata file; the folder is incomplete or corrupt"):
        make_manager(tmp_path, build_components(seed=1)).load()
    (step2 / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match=r"step-2: \.metadata cannot be read"):
        make_manager(tmp_path, build_components(seed=1)).load()
    assert files_and_bytes(tmp_path / "ckpt" / "step-1") == first


class _RunsCodeWhenUnpickled:
    """What a crafted file holds: unpickling it calls a function of the attacker's choosing."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_crafted_metadata_is_refused_without_running_it(pg, tmp_path):
    make_manager(tmp_path, build_components(seed=0)).save(1)
    marker = tmp_path / "payload_ran"
    step = tmp_path / "ckpt" / "step-1"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(marker)))
    with pytest.raises(UserError, match=r"step-1: \.metadata cannot be read .*pathlib.Path.write_text is not part "
                                        r"of a DCP checkpoint's metadata"):
        make_manager(tmp_path, build_components(seed=1)).load()
    with pytest.raises(UserError, match="is not part of a DCP checkpoint's metadata"):
        convert_checkpoint.dcp_to_torch(step, tmp_path / "all.pt")
    assert not marker.exists()


def test_crafted_entry_is_refused_without_running_it(pg, tmp_path):
    """Non-tensor entries (the data loader's state, ...) are unpickled weights-only."""
    c = build_components(seed=0)
    marker = tmp_path / "payload_ran"
    c.loader.state_dict = lambda: {"payload": _RunsCodeWhenUnpickled(marker)}
    make_manager(tmp_path, c).save(1)
    with pytest.raises(UserError, match=r"step-1: its dataloader state is refused \(.*Weights only load failed"):
        make_manager(tmp_path, build_components(seed=1)).load()
    assert not marker.exists()


def test_checkpoint_of_another_model_shape(pg, tmp_path):
    make_manager(tmp_path, build_components(seed=0)).save(1)
    other_args = dataclasses.replace(MODEL_ARGS, vocab_size=2000)
    other = build_components(seed=0, model=build_model(0, other_args))
    with pytest.raises(UserError, match=r"tok_embeddings\.weight was saved with shape \[2304, 64\], the model "
                                        r"expects \[2000, 64\]"):
        make_manager(tmp_path, other).load()


def test_missing_initial_load_path(pg, tmp_path):
    with pytest.raises(UserError, match=r"initial_load_path: .*nowhere does not exist"):
        make_manager(tmp_path, build_components(seed=0), initial_load_path=str(tmp_path / "nowhere")).load()


def test_initial_load_model_only(pg, tmp_path):
    source = build_components(seed=0)
    train_step(source, 1)
    make_manager(tmp_path / "pretrain", source).save(1)
    fresh = build_components(seed=1)
    optimizer_before = fresh.optimizers.state_dict()
    initial = tmp_path / "pretrain" / "ckpt" / "step-1"
    assert make_manager(tmp_path, fresh, initial_load_path=str(initial)).load()
    assert_same(snapshot(fresh)["model"], snapshot(source)["model"])
    assert_same(fresh.optimizers.state_dict(), optimizer_before)
    assert fresh.train_state.step == 0


def test_initial_load_of_the_whole_training_state(pg, tmp_path):
    """initial_load_model_only = false takes over the optimizer, schedule, step and data position as well."""
    source = build_components(seed=0)
    train_step(source, 1)
    train_step(source, 2)
    make_manager(tmp_path / "pretrain", source).save(2)
    expected = snapshot(source)
    expected_next_loss = train_step(source, 3)
    options = {"initial_load_path": str(tmp_path / "pretrain" / "ckpt" / "step-2"), "initial_load_model_only": False}
    fresh = build_components(seed=1)
    manager = make_manager(tmp_path / "run", fresh, **options)
    assert manager.load()
    assert_same(snapshot(fresh), expected)
    assert fresh.train_state.step == 2 and fresh.loader.position == 4
    assert train_step(fresh, 3) == expected_next_loss
    # Once the run has a checkpoint of its own, a relaunch resumes it and ignores initial_load_path.
    manager.save(3)
    relaunched = build_components(seed=2)
    assert make_manager(tmp_path / "run", relaunched, **options).load()
    assert relaunched.train_state.step == 3


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def disk_full_inside_torch_save(*args, **kwargs):
    """What torch.save raises when the disk fills under it: closing its zip writer fails in turn, and the OSError
    is only the context of that RuntimeError."""
    try:
        disk_full()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("write_item", [disk_full, disk_full_inside_torch_save])
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_disk_full_keeps_earlier_checkpoints(pg, tmp_path, monkeypatch, mode, write_item):
    c = build_components(seed=0)
    manager = make_manager(tmp_path, c, async_mode=mode)
    manager.save(1)
    manager.close()
    first = files_and_bytes(tmp_path / "ckpt" / "step-1")
    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    with pytest.raises(UserError, match=r"step-2\.incomplete failed: rank 0: OSError: \[Errno 28\] No space left"):
        manager.save(2)
        manager.close()
    assert step_folders(tmp_path) == ["step-1"]
    assert files_and_bytes(tmp_path / "ckpt" / "step-1") == first


def test_model_only_last_save_in_bf16(pg, tmp_path):
    saved = build_components(seed=0)
    make_manager(tmp_path, saved, export_dtype="bfloat16").save(3, last_step=True)
    entries = read_metadata(tmp_path / "ckpt" / "step-3").state_dict_metadata
    assert entries and all(key.startswith("model.") for key in entries)
    assert {entry.properties.dtype for entry in entries.values()} == {torch.bfloat16}
    fresh = build_components(seed=1)
    assert make_manager(tmp_path, fresh).load()
    for name, value in fresh.model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, saved.model.state_dict()[name].bfloat16().float()), name


def test_seed_checkpoint(pg, tmp_path):
    seed = build_components(seed=0)
    make_manager(tmp_path, seed, create_seed_checkpoint=True).save_seed()
    assert_manifest_matches(tmp_path / "ckpt" / "step-0")
    entries = read_metadata(tmp_path / "ckpt" / "step-0").state_dict_metadata
    assert all(key.startswith("model.") for key in entries)
    fresh = build_components(seed=1)
    assert make_manager(tmp_path, fresh).load()
    assert_same(snapshot(fresh)["model"], snapshot(seed)["model"])


def test_async_thread_save_stages_a_copy(pg, tmp_path):
    saved = build_components(seed=0)
    train_step(saved, 1)
    manager = make_manager(tmp_path, saved, async_mode="async")
    manager.save(1)
    expected = snapshot(saved)
    # The copy runs beside the next forward and backward; the trainer waits for it before the optimizer step.
    manager.wait_for_staging()
    with torch.no_grad():
        for param in saved.model.parameters():
            param.add_(1.0)  # the training loop goes on while the checkpoint is written
    manager.close()
    fresh = build_components(seed=1)
    make_manager(tmp_path, fresh).load()
    assert_same(snapshot(fresh), expected)


def test_trainer_waits_for_staging_before_the_optimizer_step(tmp_path, monkeypatch):
    """An async save's copy may still run during the next step: the weights must not change before it ends."""
    from torchtitan.config import parse_args
    from torchtitan.train import Trainer

    trainer = Trainer(parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size",
                                  "2", "--job.dump_folder", str(tmp_path), "--validation.enable", "false"]))
    try:
        staging: Future = Future()
        trainer.checkpointer._staging = staging
        optimizer_step = trainer.optimizers.step
        monkeypatch.setattr(trainer.optimizers, "step", lambda: (calls.append(staging.done()), optimizer_step()))
        calls: list[bool] = []
        threading.Timer(0.2, staging.set_result, (None,)).start()
        trainer.train_step(trainer._next_batches(iter(trainer.dataloader)))
        assert calls == [True], "the optimizer step ran before the checkpoint's copy of the state had finished"
    finally:
        trainer.close()


def test_invalid_options():
    c = build_components(seed=0)
    for options, pattern in [({"async_mode": "threads"}, r"async_mode: 'threads' is not one of disabled"),
                             ({"interval": 0}, r"interval: 0 must be"),
                             ({"keep_latest_k": -1}, r"keep_latest_k: -1"),
                             ({"export_dtype": "fp8"}, r"export_dtype: 'fp8'"),
                             ({"exclude_from_loading": ["weights"]}, r"exclude_from_loading: 'weights' is not one"),
                             ({"enable": False, "create_seed_checkpoint": True}, r"needs checkpoint\.enable")]:
        with pytest.raises(UserError, match=pattern):
            make_manager(Path("/nonexistent"), c, **options)


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face format


def test_hf_export_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = build_model(seed=0)
    save_hf(tmp_path / "hf", model.state_dict(), ADAPTER)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert_same(load_hf(tmp_path / "hf", ADAPTER), model.state_dict())


def test_from_hf_inverts_to_hf():
    state_dict = build_model(seed=0).state_dict()
    hf = ADAPTER.to_hf(state_dict)
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], state_dict["layers.0.attention.wq.weight"])
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == state_dict["layers.0.attention.wk.weight"].shape
    assert_same(ADAPTER.from_hf(hf), state_dict)
    with pytest.raises(UserError, match=r"'layers\.0\.attention\.bias' is not a Llama 3 parameter"):
        ADAPTER.to_hf({"layers.0.attention.bias": torch.zeros(1)})


def test_hf_sharded_index_and_config_mismatch(tmp_path):
    state_dict = build_model(seed=0).state_dict()
    save_hf(tmp_path / "hf", state_dict, ADAPTER, max_shard_bytes=200_000)
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
    assert_same(load_hf(tmp_path / "hf", ADAPTER), state_dict)
    with pytest.raises(UserError, match=r"config\.json: num_hidden_layers is 4, but the model .* needs 2"):
        load_hf(tmp_path / "hf", Llama3StateDictAdapter(dataclasses.replace(MODEL_ARGS, n_layers=2)))
    with pytest.raises(UserError, match=r"already exists"):
        save_hf(tmp_path / "hf", state_dict, ADAPTER)


def test_folder_saved_by_transformers_loads_with_equal_logits(tmp_path):
    """A sharded folder written by transformers itself (its own initialisation, its config.json layout) loads
    through load_hf into a model that computes transformers' logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # A larger initialisation than transformers' 0.02, so that attention is far from uniform: loading without the
    # RoPE row permutation gives logits 0.3 off (with 0.02, 0.007), loading right about 1e-6.
    config = transformers.LlamaConfig(**ADAPTER.hf_config(), initializer_range=0.05)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="200KB")
    assert (tmp_path / "hf" / INDEX_FILE).is_file()
    model = build_model(seed=1).eval()
    model.load_state_dict(load_hf(tmp_path / "hf", ADAPTER))
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    assert theirs.abs().max().item() > 1.0  # logits large enough for the bound below to mean something
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def transformers5_layout(config: dict) -> None:
    """transformers 5 writes rope_theta inside rope_parameters, which replaces rope_scaling."""
    config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}


@pytest.mark.parametrize("edit, pattern", [
    (lambda c: c.update(rope_theta=10000.0), r"rope_theta is 10000\.0, but the model uses 500000"),
    (lambda c: c.pop("rope_theta"), r"rope_theta is 10000\.0 \(absent: transformers' default\), but the model "
                                    r"uses 500000"),
    (lambda c: (transformers5_layout(c), c["rope_parameters"].update(rope_theta=1e6)),
     r"rope_theta is 1000000\.0, but the model uses 500000"),
    (lambda c: c.update(rms_norm_eps=1e-6), r"rms_norm_eps is 1e-06, but the model uses 1e-05"),
    (lambda c: c.pop("rms_norm_eps"), r"rms_norm_eps is 1e-06 \(absent: transformers' default\), but"),
    (lambda c: c.update(rope_scaling=None), r"it has no rope_scaling, but the model uses Llama 3\.1 RoPE scaling "
                                            r"with factor 8, low_freq_factor 1, high_freq_factor 4, "
                                            r"original_max_position_embeddings 8192;"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 8.0}),
     r"rope_scaling's rope_type is 'linear', but the model uses rope_type 'llama3'"),
    (lambda c: c["rope_scaling"].update(factor=32.0), r"rope_scaling's factor is 32\.0, but .* with factor 8,"),
    (lambda c: c["rope_scaling"].update(low_freq_factor=2.0),
     r"rope_scaling's low_freq_factor is 2\.0, but .* low_freq_factor 1,"),
    (lambda c: c["rope_scaling"].update(high_freq_factor=8.0),
     r"rope_scaling's high_freq_factor is 8\.0, but .* high_freq_factor 4,"),
    (lambda c: (transformers5_layout(c), c["rope_parameters"].update(original_max_position_embeddings=4096)),
     r"rope_scaling's original_max_position_embeddings is 4096, but .*_embeddings 8192;"),
])
def test_hf_config_rope_and_norm_mismatch(tmp_path, edit, pattern):
    """These leave every shape as it is: without the check the weights would load and give other logits."""
    state_dict = build_model(seed=0).state_dict()
    save_hf(tmp_path / "hf", state_dict, ADAPTER)
    edit_config(tmp_path / "hf", transformers5_layout)
    assert_same(load_hf(tmp_path / "hf", ADAPTER), state_dict)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(ADAPTER.hf_config()))
    edit_config(tmp_path / "hf", edit)
    with pytest.raises(UserError, match=r"config\.json: " + pattern):
        load_hf(tmp_path / "hf", ADAPTER)


def test_hf_config_scaling_for_an_unscaled_model(tmp_path):
    unscaled = dataclasses.replace(MODEL_ARGS, use_scaled_rope=False)
    state_dict = build_model(seed=0, args=unscaled).state_dict()
    save_hf(tmp_path / "unscaled", state_dict, Llama3StateDictAdapter(unscaled))
    assert_same(load_hf(tmp_path / "unscaled", Llama3StateDictAdapter(unscaled)), state_dict)
    edit_config(tmp_path / "unscaled", lambda c: c.update(rope_scaling=None, rope_theta=None,
                                                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert_same(load_hf(tmp_path / "unscaled", Llama3StateDictAdapter(unscaled)), state_dict)
    with pytest.raises(UserError, match=r"it has no rope_scaling, but the model uses Llama 3\.1 RoPE scaling"):
        load_hf(tmp_path / "unscaled", ADAPTER)
    save_hf(tmp_path / "scaled", state_dict, ADAPTER)
    with pytest.raises(UserError, match=r"rope_scaling is \{'rope_type': 'llama3'.*but the model does not scale"):
        load_hf(tmp_path / "scaled", Llama3StateDictAdapter(unscaled))


def test_last_save_in_hf_then_resume_and_initial_load(pg, tmp_path):
    saved = build_components(seed=0)
    make_manager(tmp_path, saved, last_save_in_hf=True).save(4, last_step=True)
    export = tmp_path / "ckpt" / "step-4"
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((export / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    assert step_folders(tmp_path) == ["step-4"]
    for options, root in [({}, tmp_path), ({"initial_load_path": str(export), "initial_load_in_hf": True},
                                           tmp_path / "elsewhere")]:
        fresh = build_components(seed=1)
        assert make_manager(root, fresh, **options).load()
        assert_same(snapshot(fresh)["model"], snapshot(saved)["model"])


def test_convert_script(pg, tmp_path, capsys, monkeypatch):
    # The script configures the logger to print to stdout, which here is pytest's capture of this test only.
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    saved = build_components(seed=0)
    make_manager(tmp_path, saved).save(1)
    step = tmp_path / "ckpt" / "step-1"
    assert convert_checkpoint.main(["dcp-to-hf", str(step), str(tmp_path / "hf"), "--flavor", "tiny",
                                    "--dtype", "float32"]) == 0
    assert_same(load_hf(tmp_path / "hf", ADAPTER), snapshot(saved)["model"])
    assert convert_checkpoint.main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--flavor", "tiny"]) == 0
    fresh = build_components(seed=1)
    make_manager(tmp_path / "run2", fresh, initial_load_path=str(tmp_path / "dcp")).load()
    assert_same(snapshot(fresh)["model"], snapshot(saved)["model"])
    assert convert_checkpoint.main(["dcp-to-torch", str(step), str(tmp_path / "all.pt")]) == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert torch.equal(everything["model"]["norm.weight"], saved.model.norm.weight)
    assert_same(everything["optimizer"], snapshot(saved)["optimizer"])
    assert everything["train_state"] == saved.train_state.state_dict()
    assert everything["dataloader"] == saved.loader.state_dict()

    # The shape comes from the checkpoint's model.json, on top of the flavor; without one, from the flavor alone.
    assert convert_checkpoint.main(["dcp-to-hf", str(step), str(tmp_path / "hf2"), "--flavor", "debugmodel",
                                    "--dtype", "float32"]) == 0
    assert_same(load_hf(tmp_path / "hf2", ADAPTER), snapshot(saved)["model"])
    (step / "model.json").unlink()
    assert convert_checkpoint.main(["dcp-to-hf", str(step), str(tmp_path / "hf3"), "--flavor", "debugmodel"]) == 2
    assert "--flavor debugmodel expects" in capsys.readouterr().err
    assert convert_checkpoint.main(["dcp-to-torch", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Several processes


def run_forked(worker, world_size: int, *args, timeout: float = 120) -> None:
    join_forked(worker, (world_size, *args), world_size, timeout, worker.__name__)


def fsdp_model(seed: int, mesh) -> Transformer:
    model = build_model(seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(c: Components) -> dict:
    """Unsharded model and optimizer state on rank 0 (a collective; other ranks get empty dicts)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    return {"model": get_model_state_dict(c.model, options=options),
            "optimizer": get_optimizer_state_dict(c.model, c.optimizers.optimizers[0], options=options)}


def join_gloo(rank: int, world_size: int, tmp: str) -> None:
    """One thread per process, joined through a file store in `tmp`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world_size), rank=rank,
                            world_size=world_size)


def fsdp_worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo(rank, world_size, tmp)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        saved = build_components(0, fsdp_model(0, mesh))
        train_step(saved, 1)
        make_manager(Path(tmp), saved).save(1)
        reference = full_state(saved)
        if rank == 0:
            torch.save(reference, f"{tmp}/reference.pt")
        resumed = build_components(1, fsdp_model(1, mesh))
        make_manager(Path(tmp), resumed).load()
        loaded = full_state(resumed)
        if rank == 0:
            assert_same(loaded, reference)
        # Rank r checks files r, r + 2, ... in name order: the damage that rank 1 finds is every rank's error.
        step = Path(tmp) / "ckpt" / "step-1"
        victim = step / sorted(json.loads((step / CHECKSUMS_FILE).read_text())["files"])[1]
        size = victim.stat().st_size
        dist.barrier()  # every rank has its size before rank 0 rewrites it
        if rank == 0:
            original = victim.read_bytes()
            flip_middle_bytes(victim)
        dist.barrier()
        with pytest.raises(UserError, match=rf"{re.escape(str(victim))} has {size} bytes with CRC32 [0-9a-f]{{8}}, "
                                            rf"but checksums\.json records {size} bytes"):
            make_manager(Path(tmp), resumed).load()
        # Both ranks have read their files: the check ends in a collective.
        if rank == 0:
            victim.write_bytes(original)
    finally:
        dist.destroy_process_group()


def test_fsdp_save_reloads_on_two_ranks_and_one(tmp_path):
    run_forked(fsdp_worker, 2, str(tmp_path))
    # The two ranks hashed a share of the files each.
    assert_manifest_matches(tmp_path / "ckpt" / "step-1")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    with single_process_group(tmp_path):
        plain = build_components(seed=1)
        assert make_manager(tmp_path, plain).load()
        assert_same({"model": plain.model.state_dict(),
                     "optimizer": get_optimizer_state_dict(plain.model, plain.optimizers.optimizers[0],
                                                           options=StateDictOptions(
                                                               flatten_optimizer_state_dict=True))},
                    reference)
        assert plain.train_state.step == 1 and plain.loader.position == 2


def disagreeing_listing_worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo(rank, world_size, tmp)
    try:
        c = build_components(seed=0)
        save_steps(make_manager(Path(tmp), c, interval=2), c, range(1, 5))
        listing = resume_module.complete_steps
        # Rank 1's view of the shared folder differs from rank 0's: first it shows a step-6 that rank 0 does not
        # list, then it lags behind, without step-4.
        for seen_by_rank1 in ([2, 4, 6], [2]):
            resume_module.complete_steps = (lambda folder: seen_by_rank1) if rank == 1 else listing
            resumed = build_components(seed=1)
            manager = make_manager(Path(tmp), resumed)
            if 4 in seen_by_rank1:
                assert manager.load() and resumed.train_state.step == 4
            else:
                with pytest.raises(UserError, match=r"rank 0 resumes from checkpoint step-4 in .*ckpt, which "
                                                    r"rank\(s\) 1 cannot see there"):
                    manager.load()
        resume_module.complete_steps = listing
    finally:
        dist.destroy_process_group()


def test_every_rank_resumes_from_the_step_rank_0_chose(tmp_path):
    run_forked(disagreeing_listing_worker, 2, str(tmp_path))


def slow_writer_worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo(rank, world_size, tmp)
    try:
        c = build_components(seed=0)
        manager = make_manager(Path(tmp), c, timeout_seconds=60)
        # After the first step the trainer bounds every collective by the training timeout; the checkpoint's
        # collectives keep theirs, and wait for a rank whose writes take longer than a step.
        dist_utils.set_train_timeout(1)
        if rank == 1:
            time.sleep(2.5)
        manager.save(1)
        assert complete_steps(Path(tmp) / "ckpt") == [1]
    finally:
        dist.destroy_process_group()


def test_checkpoint_collectives_outlast_the_training_timeout(tmp_path):
    run_forked(slow_writer_worker, 2, str(tmp_path))


def failed_publish_worker(rank: int, world_size: int, tmp: str) -> None:
    join_gloo(rank, world_size, tmp)
    try:
        c = build_components(seed=0)
        manager = make_manager(Path(tmp), c, async_mode="async", timeout_seconds=20)
        if rank == 0:
            def disk_full_on_publish(step: int, full: bool) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            manager._publish = disk_full_on_publish
        manager.save(1)
        # Rank 0's background publish failed; every rank learns it at the next save, as that storage error.
        with pytest.raises(UserError, match=r"saving the checkpoint of step 1 into .*step-1.incomplete failed.*"
                                            r"No space left on device"):
            manager.save(2)
    finally:
        dist.destroy_process_group()


def test_a_failed_background_publish_reaches_every_rank(tmp_path):
    run_forked(failed_publish_worker, 2, str(tmp_path), timeout=60)


class FileOperations:
    """The file operations this process makes while `tracing` is set: opens (for reading or writing), listings,
    renames, removals (Python's audit events) and stats."""

    def __init__(self):
        self.tracing = False
        self.operations: list[tuple[str, str]] = []
        self._stat, self._lstat = os.stat, os.lstat
        sys.addaudithook(self._audit)
        os.stat, os.lstat = self._counted(self._stat), self._counted(self._lstat)

    def _counted(self, stat):
        def counted(path, *args, **kwargs):
            if self.tracing:
                self.operations.append(("stat", os.path.basename(os.fspath(path))))
            return stat(path, *args, **kwargs)
        return counted

    def _audit(self, event: str, args: tuple) -> None:
        if not self.tracing or not event.startswith(("open", "os.", "shutil.")):
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):  # os.fdopen of a file already opened
                return
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & (os.O_WRONLY | os.O_RDWR)
            directory = not writes and stat_module.S_ISDIR(self._stat(path).st_mode)
            event = "open to write" if writes else "open a directory" if directory else "open to read"
        self.operations.append((event, os.path.basename(os.fspath(args[0])) if args and isinstance(
            args[0], (str, bytes, os.PathLike)) else ""))

    def during(self, function):
        def traced(*args, **kwargs):
            self.tracing = True
            try:
                return function(*args, **kwargs)
            finally:
                self.tracing = False
        return traced


def publish_trace_worker(rank: int, world_size: int, tmp: str) -> None:
    """Saves 4 steps of an FSDP model, keeping 2; rank 0 records its file operations while it writes `.metadata`
    and the manifest, publishes (pruning included) and removes the checkpoints that pruning superseded."""
    join_gloo(rank, world_size, tmp)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        c = build_components(0, fsdp_model(0, mesh))
        train_step(c, 1)
        manager = make_manager(Path(tmp), c, keep_latest_k=2)
        manager._group()  # created before the trace: joining a group reads the store's file
        if rank == 0:
            trace = FileOperations()
            checkpoint_integrity.ChecksummedFileWriter.finish = trace.during(
                checkpoint_integrity.ChecksummedFileWriter.finish)
            manager._publish = trace.during(manager._publish)
            manager._remove_leftovers = trace.during(manager._remove_leftovers)
        save_steps(manager, c, range(1, 5))
        manager.close()
        if rank == 0:
            Path(f"{tmp}/trace.json").write_text(json.dumps(trace.operations))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank_0s_publish_does_not_grow_with_the_ranks(tmp_path):
    """What rank 0 alone does after every rank has written (DCP's `.metadata`, the manifest, the rename, pruning
    old checkpoints, then deleting them) makes the same file operations under 2 and 4 ranks, never touches another
    rank's data files and reads no file back (a `.metadata` lists every rank's chunks)."""
    traces = {}
    for world_size in (2, 4):
        folder = tmp_path / f"world{world_size}"
        folder.mkdir()
        run_forked(publish_trace_worker, world_size, str(folder))
        assert step_folders(folder) == ["step-3", "step-4"]
        assert len(list((folder / "ckpt" / "step-4").glob("*.distcp"))) == world_size
        traces[world_size] = [tuple(operation) for operation in json.loads((folder / "trace.json").read_text())]
    for trace in traces.values():
        assert ("os.remove", "__0_0.distcp") in trace  # its own share of step-1
        assert not [(op, name) for op, name in trace if name.endswith(".distcp") and not name.startswith("__0_")], trace
        assert not [operation for operation in trace if operation[0] == "open to read"], trace
    assert Counter(event for event, _ in traces[2]) == Counter(event for event, _ in traces[4])


def save_until_killed(root: Path, marker: Path) -> None:
    """Runs in a child process: saves step 1, then hangs in the middle of writing step 2 until it is killed."""
    c = build_components(seed=0)
    manager = make_manager(root, c)
    c.train_state.step = 1
    manager.save(1)
    write_item = dcp_filesystem._write_item

    def write_then_hang(*args, **kwargs):
        result = write_item(*args, **kwargs)
        marker.touch()
        time.sleep(120)
        return result

    dcp_filesystem._write_item = write_then_hang
    c.train_state.step = 2
    manager.save(2)


def run_single_threaded(rank: int, target, *args) -> None:
    torch.set_num_threads(1)  # the test process runs beside it on the same cores
    target(*args)


def forked(target, *args) -> multiprocessing.Process:
    """A child forked from the tests' fork server (tests/unit/forked_ranks.py says why not from this process), not a
    spawned one, which would import torch again: seconds on two cores. `target` and `args` are pickled."""
    process = multiprocessing.get_context("forkserver").Process(
        target=in_environment, args=(0, dict(os.environ), run_single_threaded, target, *args))
    process.start()
    return process


def test_kill_during_save_leaves_no_checkpoint_to_load(tmp_path):
    marker = tmp_path / "writing"
    child = forked(save_until_killed, tmp_path, marker)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.is_alive(), "the saving process exited before it was killed"
            assert time.monotonic() < deadline, "the saving process never started writing step 2"
            time.sleep(0.05)
    finally:
        child.kill()
        child.join()
    assert step_folders(tmp_path) == ["step-1", "step-2.incomplete"]
    assert any((tmp_path / "ckpt" / "step-2.incomplete").iterdir())
    with single_process_group(tmp_path):
        fresh = build_components(seed=1)
        manager = make_manager(tmp_path, fresh)
        assert manager.load()
        assert fresh.train_state.step == 1
        manager.save(3)
    assert step_folders(tmp_path) == ["step-1", "step-3"]


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_modes_refuse_a_torch_older_than_2_13_at_start_up(pg, tmp_path, monkeypatch, mode):
    """torch 2.11's DCP stager stages once (pytorch/pytorch#183413): seen on an H100, the second async save of a run
    failed. The manager says so when it is built, not at that save."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(UserError, match=rf"option checkpoint.async_mode: '{mode}' needs torch 2.13 or newer.*"
                                        rf"this is torch 2\.11\.0\+cu130.*set checkpoint.async_mode = 'disabled'"):
        make_manager(tmp_path, build_components(seed=0), async_mode=mode)
    make_manager(tmp_path, build_components(seed=0), async_mode="disabled")


def save_with_pinned_memory(root: Path) -> None:
    with single_process_group(root):
        saved = build_components(seed=0)
        train_step(saved, 1)
        messages = []
        log = manager_module.logger.info
        manager_module.logger.info = lambda message: (messages.append(message), log(message))
        manager = make_manager(root, saved, async_mode="async_with_pinned_mem")
        manager.save(1)
        expected = snapshot(saved)
        manager.wait_for_staging()
        train_step(saved, 2)  # while the checkpoint process writes what save() staged
        assert multiprocessing.active_children(), "DCP started no checkpoint process"
        manager.close()
        # Stopped by close(): left to interpreter exit, it printed an EOFError traceback as its pipe closed.
        assert not multiprocessing.active_children()
        assert_manifest_matches(root / "ckpt" / "step-1")
        # The checkpoint process writes the files; this process still reports their size.
        (data_file,) = (root / "ckpt" / "step-1").glob("__0_*.distcp")
        assert any(f"rank 0 wrote {data_file.stat().st_size / 2**20:.1f} MiB" in m for m in messages), messages
        fresh = build_components(seed=1)
        make_manager(root, fresh).load()
        assert_same(snapshot(fresh), expected)


def test_checkpoint_process_bounds_its_collectives_by_the_checkpoint_timeout(pg, tmp_path, monkeypatch):
    """async_with_pinned_mem: DCP's checkpoint process runs a pickled copy of the writer, and the save's collectives
    on a gloo group that torch starts there with its 30-minute default. The copy sets checkpoint.timeout_seconds on
    that group before the save's first collective (DCP's reset); in the process that made the writer, whose DCP call
    gets the manager's own group, it changes no group."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    before = backend.options._timeout
    writer = checkpoint_integrity.ChecksummedFileWriter(tmp_path / "step-1", collective_timeout_s=42)
    writer.reset(tmp_path / "step-1")
    assert backend.options._timeout == before
    in_checkpoint_process = pickle.loads(pickle.dumps(writer))
    pid = os.getpid()
    monkeypatch.setattr(checkpoint_integrity.os, "getpid", lambda: pid + 1)
    in_checkpoint_process.reset(tmp_path / "step-1")
    assert backend.options._timeout.total_seconds() == 42 != before.total_seconds()


@pytest.mark.slow
def test_async_with_pinned_mem_process_save(tmp_path):
    """In a child process: the checkpoint process that DCP starts lives as long as its parent and must not outlive
    the test. DCP spawns it, so it imports the parent's `__main__` module: a training script must guard its entry
    point with `if __name__ == "__main__":` (pytest's own does)."""
    child = forked(save_with_pinned_memory, tmp_path)
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the async_with_pinned_mem save did not finish within 120 s")
    assert child.exitcode == 0, "the async_with_pinned_mem child failed; see its output above"


def test_diloco_part_is_saved_and_loaded_with_or_without_outer_momentum(pg, tmp_path):
    """The `diloco` part (fault_tolerance.semi_sync_method = diloco) through the manager: DiLoCo's last-sync weights
    (here older than the weights: a step was taken after the sync) come back. A run with outer_momentum = 0 saves
    no momentum; a run with momentum resuming from its checkpoint starts the momentum at zero."""
    from tests.unit.test_fault_tolerance import diloco_group, inner_steps_then_sync

    saved = build_components(seed=0)
    group = diloco_group(saved.model, lr=0.7, momentum=0.0, sync_steps=3)
    parameters = list(saved.model.parameters())
    inner_steps_then_sync(group, saved.model, [torch.randn_like(p) for p in parameters],
                          [torch.randn_like(p) for p in parameters], 3)
    train_step(saved, 4)
    manager = make_manager(tmp_path, saved)
    manager.diloco = group.diloco_state
    manager.save(4)

    resumed = build_components(seed=1)
    resumed_group = diloco_group(resumed.model, lr=0.7, momentum=0.9, sync_steps=3)
    restarted = make_manager(tmp_path, resumed)
    restarted.diloco = resumed_group.diloco_state
    assert restarted.load() and resumed_group.diloco_state.loaded
    for key, value in group.diloco_state.last_sync.items():
        assert torch.equal(resumed_group.diloco_state.last_sync[key], value), key
    assert not any(torch.equal(value, p.detach()) for value, p in zip(group.diloco_state.last_sync.values(),
                                                                      parameters))
    assert not resumed_group.diloco_state.outer.state
