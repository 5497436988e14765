#!/usr/bin/env bash
# Launch training with torchrun (through torchtitan.launch, which keeps the workers' exit code) on this machine.
#   NGPU         processes to start (default: the GPUs present, else 1)
#   CONFIG_FILE  TOML config (default: the debug model)
#   LOG_RANK     comma-separated ranks whose output is shown (default: 0)
#   COMM_MODE    default (or unset): NGPU training processes. fake_backend: a dry run. ONE process plays rank 0 of
#                NGPU ranks on fake tensors, with no GPU, data or checkpoint, and reports memory and communication
#                (docs/scaling.md); torchrun is not used. With --comm.no_fake_tensors the rank runs on real tensors on
#                this machine's GPU, its steps timed
#   FT_GROUPS    replica-group fault tolerance (torchft, docs/resilience.md): start a torchft lighthouse and
#                FT_GROUPS replica groups on this machine, each its own torchrun job of NGPU processes (group i
#                gets --fault_tolerance.replica_id i and writes under <dump_folder>/replica_i); a group whose process
#                dies is restarted by its torchrun (up to FT_MAX_RESTARTS times, default 3) and heals from a live
#                group while the others train on. FT_MIN_REPLICAS (default 1): fewest groups a step commits with.
#                FT_GROUP_ID=i: start only group i, against the lighthouse at TORCHFT_LIGHTHOUSE (a group per
#                machine); otherwise a lighthouse is started on port FT_LIGHTHOUSE_PORT (default 29510) unless
#                TORCHFT_LIGHTHOUSE names one. The lighthouse is started with the options' fault_tolerance.
#                min_replica_size, join_timeout_seconds and heartbeat_timeout_seconds; each group is checked first
#                (the lighthouse reachable, the group not running already: one error line). Console lines start with
#                [group<i> rank<r>]. SIGTERM or Ctrl-C to this script stops every group (its torchrun and workers),
#                then the lighthouse; with FT_GROUP_ID the script becomes the group's torchrun (same PID)
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
if [ -n "${FT_GROUPS:-}" ]; then
  if ! [[ "$FT_GROUPS" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: FT_GROUPS='$FT_GROUPS' is not a positive integer: the number of replica groups" >&2
    exit 2
  fi
  FT_MIN_REPLICAS=${FT_MIN_REPLICAS:-1}
  ft_options=(--job.config_file "$CONFIG_FILE" --fault_tolerance.enable --fault_tolerance.group_size "$FT_GROUPS"
    --fault_tolerance.min_replica_size "$FT_MIN_REPLICAS")
  check() {  # before the groups' torchruns: the lighthouse is reachable and groups $1 (i,j,...) are not running
    python -m torchtitan.distributed.lighthouse check "$1" "${ft_options[@]}" "${@:2}"
  }
  group() {  # replica group $1: a torchrun job that restarts its workers, in place of the calling (sub)shell, so
    # that its PID is torchrun's: a signal to it reaches the workers. Console lines start with the group and rank.
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[group$1 rank\${rank}] " exec python -m torchtitan.launch \
      --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
      --max-restarts "${FT_MAX_RESTARTS:-3}" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
      -m torchtitan.train "${ft_options[@]}" --fault_tolerance.replica_id "$1" "${@:2}"
  }
  if [ -n "${FT_GROUP_ID:-}" ]; then
    if ! [[ "$FT_GROUP_ID" =~ ^[0-9]+$ ]] || [ "$FT_GROUP_ID" -ge "$FT_GROUPS" ]; then
      echo "error: FT_GROUP_ID='$FT_GROUP_ID' is not a replica group of FT_GROUPS=$FT_GROUPS; valid: 0 to" \
        "$((FT_GROUPS - 1))" >&2
      exit 2
    fi
    if [ -z "${TORCHFT_LIGHTHOUSE:-}" ]; then
      echo "error: FT_GROUP_ID is set but TORCHFT_LIGHTHOUSE is not: the address (http://host:port) of the" \
        "lighthouse the groups share" >&2
      exit 2
    fi
    export TORCHFT_LIGHTHOUSE
    check "$FT_GROUP_ID" "$@" || exit $?
    group "$FT_GROUP_ID" "$@"
  fi
  pids=()
  lighthouse=
  # The groups and the lighthouse end with this script (an interrupted launch leaves no process behind): the
  # groups first (SIGTERM: each finishes or leaves its step), waited for, then the lighthouse.
  stop_all() {
    trap - EXIT INT TERM
    if [ ${#pids[@]} -gt 0 ]; then
      kill -TERM "${pids[@]}" 2>/dev/null || true
      wait "${pids[@]}" 2>/dev/null || true
    fi
    if [ -n "$lighthouse" ]; then
      kill -TERM "$lighthouse" 2>/dev/null || true
      wait "$lighthouse" 2>/dev/null || true
    fi
  }
  trap stop_all EXIT
  trap 'stop_all; exit 143' TERM
  trap 'stop_all; exit 130' INT
  if [ -z "${TORCHFT_LIGHTHOUSE:-}" ]; then
    # The lighthouse with the job's settings (fault_tolerance.min_replica_size, join_timeout_seconds,
    # heartbeat_timeout_seconds).
    flags=$(python -m torchtitan.distributed.lighthouse flags "${ft_options[@]}" "$@") || exit 2
    # shellcheck disable=SC2086
    torchft_lighthouse $flags --bind "[::]:${FT_LIGHTHOUSE_PORT:-29510}" &
    lighthouse=$!
    export TORCHFT_LIGHTHOUSE="http://localhost:${FT_LIGHTHOUSE_PORT:-29510}"
  else
    check "$(seq -s, 0 $((FT_GROUPS - 1)))" "$@" || exit $?
  fi
  for ((i = 0; i < FT_GROUPS; i++)); do
    group "$i" "$@" &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
  done
  exit $status
fi
exec python -m torchtitan.launch --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
