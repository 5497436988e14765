#!/usr/bin/env bash
# Launch training with torchrun (through torchtitan.launch, which keeps the workers' exit code) on this machine.
#   NGPU         processes to start (default: the GPUs present, else 1)
#   CONFIG_FILE  TOML config (default: the debug model)
#   LOG_RANK     comma-separated ranks whose output is shown (default: 0)
#   COMM_MODE    default (or unset): NGPU training processes. fake_backend: a dry run. ONE process plays rank 0 of
#                NGPU ranks on fake tensors, with no GPU, data or checkpoint, and reports memory and communication
#                (docs/scaling.md); torchrun is not used. With --comm.no_fake_tensors the rank runs on real tensors on
#                this machine's GPU, its steps timed
# Extra arguments go to the trainer, e.g.  ./run_train.sh --training.steps 20 --parallelism.tensor_parallel_degree 2
set -euo pipefail

if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "$NGPU" -gt 0 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-"$(dirname "$0")/train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}

case "${COMM_MODE:-default}" in
  default) ;;
  fake_backend)
    exec python -m torchtitan.train --job.config_file "$CONFIG_FILE" --comm.mode fake_backend \
      --comm.fake_world_size "$NGPU" "$@" ;;
  *)
    echo "error: COMM_MODE='$COMM_MODE' is not a comm.mode: default (NGPU training processes) or fake_backend (a" \
      "dry run of NGPU ranks in one process)" >&2
    exit 2 ;;
esac

if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NGPU='$NGPU' is not a positive integer: the number of training processes to start on this machine" >&2
  exit 2
fi
exec python -m torchtitan.launch --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
