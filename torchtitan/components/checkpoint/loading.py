"""Loading a checkpoint into the run: the parts wanted, checked against the model and the optimizer before DCP
reads them; a Hugging Face folder's weights."""

import pickle
import re
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.hf import load_hf_model
from torchtitan.components.checkpoint.hf_folder import is_hf_folder
from torchtitan.components.checkpoint.integrity import verify_checkpoint
from torchtitan.components.checkpoint.model_shape import check_model_shape
from torchtitan.components.checkpoint.options import LOADABLE_PARTS
from torchtitan.components.checkpoint.safe_io import METADATA_FILE, dcp_load, describe, deserialize, read_metadata
from torchtitan.components.checkpoint.state import _pack_param_groups, _unpack_param_groups
from torchtitan.distributed.compression import EXACT
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger


def exact_where_it_fits(template: dict[str, Any], saved: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`template` without the state saved verbatim for an exact resume (`exact.` keys: a replica's or a rank's own,
    see OptimizersContainer) that the checkpoint (`saved`, its metadata; keys under `prefix`) lacks or holds in
    another shape: it loads only into the layout that saved it, elsewhere its resharded form is used.

    An optimizer's replica state (`exact.<parameter>.<state>.replica<r>of<R>`, FlexDeMo's deltas) saved by another
    number of replicas R' loads from replica r mod R' (the template's key is renamed to it; the optimizer's load
    finds it by its stem): with more replicas each saved one continues and the new ones copy one, with fewer the
    replicas past R are dropped. Compression's verbatim state does not move between replicas (its residuals are
    owed to its own replica's reductions)."""

    def fits(key: str, value: Any) -> bool:
        entry = saved.get(prefix + key)
        return isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(value.shape)

    kept = {}
    for key, value in template.items():
        if key.startswith(EXACT) and not fits(key, value):
            key = _saved_replica(key, saved, prefix)
            if key is None or not fits(key, value):
                continue
        kept[key] = value
    return kept


_REPLICA = re.compile(r"^(?P<stem>.*\.replica)(?P<replica>\d+)of(?P<replicas>\d+)$")


def _saved_replica(key: str, saved: dict[str, Any], prefix: str) -> str | None:
    """The key of the saved replica an optimizer's replica-state `key` loads from (see exact_where_it_fits)."""
    match = _REPLICA.match(key)
    if match is None or key.startswith(f"{EXACT}compression."):
        return None
    stem, replica = match["stem"], int(match["replica"])
    for saved_key in saved:
        found = _REPLICA.match(saved_key.removeprefix(prefix))
        if found is not None and saved_key.startswith(prefix) and found["stem"] == stem:
            return f"{stem}{replica % int(found['replicas'])}of{found['replicas']}"
    return None


def require_saved_optimizer_state(checkpoint: Path, template: dict[str, Any], saved: dict[str, Any]) -> None:
    """One clear error for optimizer state the run expects and the checkpoint (`saved`, its metadata) lacks: it was
    written by another optimizer, or by a version of this one that kept other state (DCP's own error names the key
    as a corrupt or truncated checkpoint's)."""
    for key in template:
        if key.startswith(EXACT) or f"optimizer.{key}" in saved:
            continue
        hint = ""
        if key.startswith("compression."):
            hint = (" (gradient compression's state: the checkpoint was saved with another "
                    "comm.gradient_compression)")
        elif key.endswith(".delta") and f"optimizer.{key.removesuffix('delta')}momentum" in saved:
            hint = (" (it is an earlier FlexDeMo's: its momentum, in units of the gradient, became DeMo's delta, in "
                    "units of the learning-rate-scaled gradient, which cannot be derived without the learning rate "
                    "of every past step)")
        raise UserError(f"checkpoint {checkpoint} holds no optimizer.{key}: its optimizer state was saved by another "
                        f"optimizer or another version of it{hint}; resume with the optimizer that saved it, or start "
                        f"the optimizer state afresh with checkpoint.exclude_from_loading = ['optimizer']")


class Loading:
    """CheckpointManager's loading (manager.py holds the state it loads into)."""

    def load(self) -> bool:
        """Resume from the latest complete checkpoint (or `load_step`), else start from `initial_load_path`.

        Returns whether anything was loaded.
        """
        if not self.config.enable:
            return False
        with self._bounded():
            return self._load()

    def _load(self) -> bool:
        begin = time.perf_counter()
        wanted = [part for part in LOADABLE_PARTS if part not in self.config.exclude_from_loading
                  and (part != "diloco" or self.diloco is not None)]
        step = self._agreed_step_to_resume()
        if step is not None:
            source = self._resume_folder / f"step-{step}"
            if self.config.initial_load_path:
                logger.info(f"Resuming from {source}; checkpoint.initial_load_path is not used")
            loaded = self._load_from(source, wanted)
        elif self.config.initial_load_path:
            source = Path(self.config.initial_load_path)
            if not source.exists():
                raise UserError(f"option checkpoint.initial_load_path: {source} does not exist")
            if self.config.initial_load_in_hf:
                loaded = self._load_hf_model(source) if "model" in wanted else []
            else:
                loaded = self._load_from(source, ["model"] if self.config.initial_load_model_only else wanted)
        else:
            logger.info(f"No checkpoint in {self.folder} and no checkpoint.initial_load_path: starting from scratch")
            return False
        logger.info(f"Loaded {', '.join(loaded) or 'nothing'} from {source} in {time.perf_counter() - begin:.2f} s"
                    + (f" (step {self.train_state.step})" if "train_state" in loaded else ""))
        if step is not None and not self.config.load_only and self._resume_folder == self.folder:
            self._abandoned = self._newer_trajectory(self.train_state.step)
            self._resumed_from = step
        return bool(loaded)

    def _load_from(self, checkpoint: Path, wanted: list[str]) -> list[str]:
        if not (checkpoint / METADATA_FILE).exists() and is_hf_folder(checkpoint):
            logger.warning(f"{checkpoint} is a Hugging Face export: it holds only the model weights")
            return self._load_hf_model(checkpoint) if "model" in wanted else []
        saved = read_metadata(checkpoint).state_dict_metadata
        verify_checkpoint(checkpoint, distributed=True, group=self._group())
        present = [part for part in wanted if self._is_saved(part, saved)]
        skipped = [part for part in wanted if part not in present and part != "rng"]
        if skipped:
            logger.warning(f"Checkpoint {checkpoint} holds no {', '.join(skipped)}; they keep their initial state")
        if "model" in present:
            check_model_shape(checkpoint, self.model_shape)
            self._check_model_shapes(checkpoint, saved)
        state_dict = {self._key(part): self._load_template(part, saved) for part in present}
        if "optimizer" in present:
            require_saved_optimizer_state(checkpoint, state_dict["optimizer"], saved)
        files = list(checkpoint.glob("*.distcp"))
        logger.info(f"Loading {', '.join(present)} from {checkpoint} ({len(files)} files, "
                    f"{sum(f.stat().st_size for f in files) / 2**30:.2f} GiB)")
        dcp_load(state_dict, checkpoint, process_group=self._group())
        for part in present:
            try:
                self._apply(part, state_dict[self._key(part)])
            except pickle.UnpicklingError as err:
                raise UserError(f"checkpoint {checkpoint}: its {part} state is refused ({describe(err)})") from err
        return present

    def _load_template(self, part: str, saved: dict[str, Any]) -> Any:
        """What DCP loads `part` into: its current state, of the shapes the checkpoint must match."""
        if part == "model":
            return self.model.state_dict()
        if part == "dataloader":
            return b""
        if part == "optimizer":
            return exact_where_it_fits(_pack_param_groups(self.optimizers.state_dict()), saved, "optimizer.")
        if part == "diloco":
            # A run with fault_tolerance.outer_momentum = 0 saves no momentum: a run with it then starts at zero.
            return {key: value for key, value in self.diloco.state_dict().items() if f"diloco.{key}" in saved}
        if part == "rng":
            # Only generators saved by this rank: a CPU run's checkpoint resumes on CUDA and vice versa.
            return {name: state for name, state in self.rng.state_dict().items() if f"{self.rng_key}.{name}" in saved}
        return self._stateful(part).state_dict()

    def _stateful(self, part: str) -> Stateful:
        return {"lr_scheduler": self.lr_schedulers, "train_state": self.train_state,
                "rng": self.rng, "model": self.model, "diloco": self.diloco}[part]

    def _apply(self, part: str, state: Any) -> None:
        if part == "dataloader":
            self.dataloader.load_state_dict(deserialize(state))
        elif part == "optimizer":
            self.optimizers.load_state_dict(_unpack_param_groups(state))
        else:
            self._stateful(part).load_state_dict(state)

    def _check_model_shapes(self, checkpoint: Path, saved: dict[str, Any]) -> None:
        """Name the first parameter the checkpoint lacks or holds in another shape, before DCP fails obscurely."""
        for name, tensor in self.model.state_dict().items():
            entry = saved.get(f"model.{name}")
            if not isinstance(entry, TensorStorageMetadata):
                raise UserError(f"checkpoint {checkpoint} has no weight {name}: it was saved from another model; "
                                f"check model.flavor")
            if tuple(entry.size) != tuple(tensor.shape):
                raise UserError(f"checkpoint {checkpoint}: {name} was saved with shape {list(entry.size)}, the "
                                f"model expects {list(tensor.shape)}; it was saved from another model, check "
                                f"model.flavor")

    def _load_hf_model(self, folder: Path) -> list[str]:
        if self.hf_adapter is None:
            raise UserError(f"checkpoint {folder} is a Hugging Face folder, but the model family (model.name) has no "
                            f"Hugging Face format; load a DCP checkpoint of it")
        read = load_hf_model(self.model.model_parts, folder, self.hf_adapter)
        logger.info(f"Hugging Face import from {folder}: this rank read {read / 2**30:.2f} GiB of its weights")
        return ["model"]
