"""Saving and resuming the whole training state with torch.distributed.checkpoint (DCP).

Layout under `<dump_folder>/<checkpoint.folder>`:

    step-N/                  a complete checkpoint: DCP files (`.metadata`, `__R_I.distcp`) and `checksums.json`,
                             or, for a last save with `last_save_in_hf`, a Hugging Face folder (`config.json`,
                             `model.safetensors`)
    step-N.incomplete/       being written, or left behind by a crash: never loaded, removed by the next save
    step-N.deleted.incomplete/   superseded (below): never loaded, removed by the next save

Every save is written into `step-N.incomplete`; only once DCP has finished on every rank does rank 0 rename it to
`step-N` (an atomic rename), so a folder named `step-N` is always complete, whenever a process dies. If `step-N`
already exists (a run resumed from an earlier step reaches the same step again), the new checkpoint replaces it once
the new one is complete: the old folder is renamed to `step-N.stale.incomplete`, the new one into place, and the old
one goes with the leftovers. A crash between those renames leaves both under `.incomplete` names, and resuming takes
the previous complete step. Leftovers (`*.incomplete`) are deleted at the start of the next save, every rank its own
data files (by name) and then rank 0 the rest, so that rank 0 never deletes every rank's files; at `close()` rank 0
deletes what is left alone.

Rank 0 also writes `model.json` into every DCP checkpoint: the model's shape (width, layers, heads, FFN width,
vocabulary, RoPE), which `[model]` may have set on top of the flavor. Loading a checkpoint (resume or
`initial_load_path`) compares it with this run's model first, and names the options that differ: the parameter shapes
do not reveal the head count or the RoPE base, which would load silently and compute something else.

DCP has no checksums: a shard damaged after the save (other bytes, same size) would load silently. So before the
rename rank 0 writes `checksums.json` into the folder, the size and CRC32 of every file DCP wrote (each rank hashes
its own files as it writes them; rank 0 gathers the entries), and every load checks the files against it before DCP
reads them; a checkpoint without one (an older version's, or another tool's) loads unchecked, with a warning.

Once a new checkpoint is in place, rank 0 retires what it supersedes (renamed to `step-N.deleted.incomplete`, out of
a resume's reach, and deleted with the leftovers):
- `keep_latest_k` counts only full checkpoints (those holding the train state, the only ones a resume continues
  from): the k newest are kept. A model-only checkpoint never evicts a full one; it is deleted once it is older than
  every full checkpoint kept (it can no longer be what the run resumes from, nor its latest weights).
- A run that resumed from a step older than a full checkpoint of the folder (`load_step`, or a load without the
  train state, which restarts at step 0) continues another trajectory: the checkpoints newer than its starting step
  are retired when its first checkpoint is complete, and not before, so that a rollback run that dies early loses
  nothing. Retired means deleted, or with `keep_latest_k = 0` (keep everything) renamed to `step-N.abandoned`,
  which no resume considers. Otherwise a later plain restart would resume the abandoned trajectory.

Keys of a DCP checkpoint (DCP joins nested keys with dots):

    model.<parameter name>       full names, whatever the sharding or pipeline split, so any layout reloads them
    optimizer.state.<name>.<k>   OptimizersContainer's flattened state; optimizer.param_groups.<name> packs that
                                 parameter's hyperparameters into one record
    lr_scheduler.last_epoch
    dataloader                   the data loader's state, serialised into one value under one key for all ranks:
                                 DCP writes it once, every rank loads it (any rank's position resumes every rank,
                                 also with another number of ranks), and its structure may change as iteration
                                 starts without breaking the load
    train_state.step, train_state.tokens_seen
    rng_rank<R>.python/.torch/.cuda   each rank's random generators, restored only on a rank that has an entry
    diloco.<name>.last_sync, diloco.<name>.outer_momentum   with fault_tolerance.semi_sync_method = diloco:
                                 DiLoCo's weights of the last sync and outer momentum, sharded as the parameter

Model-only checkpoints (the seed checkpoint, `last_save_model_only`) hold only `model.*`. Resuming picks the latest
checkpoint that holds the train state; only when there is none does it load a model-only one (the model, with the
rest as initialised).
"""

from torchtitan.components.checkpoint.integrity import CHECKSUMS_FILE, verify_checkpoint
from torchtitan.components.checkpoint.layout import INCOMPLETE_SUFFIX, complete_steps
from torchtitan.components.checkpoint.manager import CheckpointManager
from torchtitan.components.checkpoint.model_shape import MODEL_FILE, check_model_shape
from torchtitan.components.checkpoint.options import ASYNC_MODES, EXPORT_DTYPES, LOADABLE_PARTS, validate_config
from torchtitan.components.checkpoint.read_full import read_full_checkpoint, read_full_model
from torchtitan.components.checkpoint.safe_io import (METADATA_FILE, SafeFileSystemReader, WeightsOnlyLoadPlanner,
                                                      read_metadata, without_collectives)
from torchtitan.components.checkpoint.state import ModelWrapper, RNGState, TrainState

__all__ = [
    "ASYNC_MODES", "CHECKSUMS_FILE", "EXPORT_DTYPES", "INCOMPLETE_SUFFIX", "LOADABLE_PARTS", "METADATA_FILE",
    "MODEL_FILE", "CheckpointManager", "check_model_shape", "ModelWrapper", "RNGState", "SafeFileSystemReader", "TrainState", "WeightsOnlyLoadPlanner",
    "complete_steps", "read_full_checkpoint", "read_full_model", "read_metadata", "validate_config",
    "verify_checkpoint", "without_collectives",
]
