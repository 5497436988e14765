#!/usr/bin/env bash
# Everything this project checks on one GPU, in one command (about 15 minutes on an H100: more than one command of a
# lent machine runs, so the checks come in order of need), for a machine lent for a few minutes: results and logs go
# to OUT (default ./gpu_checks_out), the summary table is printed last.
#   0. the wheels carried in .carry/wheels (benchmarks/gpu_carry.py), installed offline: what the GPU image lacks
#   1. benchmarks/benchmark_torchtitan.py --recipes all: this project against TorchTitan 0.2.2, alternating steps, at
#      the 8B shape with as many blocks as fit (bf16 eager, compile, compile + Float8, compile + Float8 + selective
#      AC): tokens/s, MFU, peak memory, ratio (under 9 minutes)
#   2. benchmarks/gpu_checks.py: block-causal FlexAttention, one process and simulated CP ranks, against float64; the
#      compiled BlockMask build (time, memory, no recompile per batch)
#   3. benchmarks/flex_attention_speed.py: FlexAttention's speed under the causal and block-causal masks at 8k-128k
#      against the flash kernel, and what a first call spends compiling (the planner's FLEX_FRACTION)
#   4. scripts/calibrate_gpu.py: GEMMs by shape, Float8 speed-up, attention by length and mask, allocator reserve
#   5. the trainer through run_train.sh (torchrun, NCCL): bf16 with async checkpoints, then
#      a resume; block-causal attention in fp32 (its losses compared with the CPU's by the caller); an 8B-shaped
#      2-block model at 8,192 tokens eager, compiled, and compiled with Float8 (tokens/s and MFU)
# Without a GPU it runs the CPU forms (the side by side at a tiny shape, two recipes, Float8 emulated; gpu_checks.py
# and flex_attention_speed.py --device cpu, calibrate_gpu.py --quick, no 8B runs): a check of this script.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_checks_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
PY=${PY:-python3}
# run_train.sh calls `python`; the GPU image may only have python3.
# A wrapper, not a link: a link to a virtual environment's interpreter would lose the environment.
rm -rf /tmp/gpu_checks_bin && mkdir -p /tmp/gpu_checks_bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" >/tmp/gpu_checks_bin/python &&
  chmod +x /tmp/gpu_checks_bin/python && export PATH=/tmp/gpu_checks_bin:$PATH
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
section() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
run() {
  local limit=$1; shift; timeout "$limit" "$@" >>"$LOG" 2>&1; local rc=$?; echo "exit $rc" | tee -a "$LOG"; return $rc
}

CARRY=/tmp/gpu_carry
section "carried wheels (benchmarks/gpu_carry.py)"
if [ -d .carry/wheels ]; then
  run 120 $PY benchmarks/gpu_carry.py install "$CARRY" && export PYTHONPATH=$CARRY/deps${PYTHONPATH:+:$PYTHONPATH}
else
  echo "none: no .carry/wheels (python benchmarks/gpu_carry.py prepare, then carry .carry)" | tee -a "$LOG"
fi

section "device"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  $PY -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1; } | tee -a "$LOG"

section "side by side with TorchTitan 0.2.2 (benchmark_torchtitan.py)"
if [ -d "$CARRY/torchtitan" ]; then
  side_by_side=(benchmarks/benchmark_torchtitan.py --ours "$(command -v "$PY")"
                --output "$OUT/torchtitan_side_by_side.json")
  if [ "$DEVICE" = cuda ]; then
    PYTHONPATH=$CARRY/torchtitan:$PYTHONPATH run 540 $PY "${side_by_side[@]}" --recipes all --time_limit 520
  else  # compile on a CPU takes minutes per process: the eager recipe and Float8 (emulated, eager) with selective AC
    PYTHONPATH=$CARRY/torchtitan:$PYTHONPATH run 600 $PY "${side_by_side[@]}" --time_limit 580 \
      --recipes bf16_eager,compile_float8_sac --flavor debugmodel --n_layers 2 --seq_len 64 --local_batch_size 2 \
      --warmup 1 --steps 2 --threads 2
  fi
else
  echo "skipped: TorchTitan is not carried (no .carry/wheels)" | tee -a "$LOG"
fi

section "gpu_checks.py"
run 120 $PY benchmarks/gpu_checks.py --device "$DEVICE" --output "$OUT/gpu_checks.json"

section "flex_attention_speed.py"
if [ "$DEVICE" = cuda ]; then
  run 300 $PY benchmarks/flex_attention_speed.py --output "$OUT/flex_attention_speed.json" --time_limit 240
else run 120 $PY benchmarks/flex_attention_speed.py --device cpu --output "$OUT/flex_attention_speed.json"; fi

section "calibrate_gpu.py"
if [ "$DEVICE" = cuda ]; then run 150 $PY scripts/calibrate_gpu.py --output "$OUT/calibration.json"
else run 200 $PY scripts/calibrate_gpu.py --device cpu --quick --output "$OUT/calibration.json"; fi

train() {  # a trainer run of the debug model on one process (torchrun, NCCL on a GPU); extra flags follow
  local name=$1 limit=$2; shift 2
  section "train: $name"
  NGPU=1 run "$limit" ./run_train.sh --job.dump_folder "/tmp/gpu_checks_runs/$name" --metrics.log_freq 1 "$@"
}
rm -rf /tmp/gpu_checks_runs
train async_save 60 --training.steps 12 --checkpoint.enable --checkpoint.interval 4 \
  --checkpoint.async_mode async --checkpoint.last_save_model_only false
train async_save 60 --training.steps 16 --checkpoint.enable --checkpoint.interval 4 \
  --checkpoint.async_mode async --checkpoint.last_save_model_only false
train block_causal_fp32 60 --training.steps 10 --model.attention_mask block_causal --model.document_positions \
  --training.mixed_precision_param float32 --validation.no_enable
if [ "$DEVICE" = cuda ]; then
  big=(--model.flavor 8B --model.n_layers 2 --training.seq_len 8192 --training.local_batch_size 1
       --training.steps 12 --validation.no_enable --activation_checkpoint.mode selective)
  train 8B_2blocks_eager 70 "${big[@]}"
  train 8B_2blocks_compiled 100 "${big[@]}" --compile.enable
  train 8B_2blocks_compiled_float8 100 "${big[@]}" --compile.enable --model.converters float8 \
    --quantize.linear.float8.recipe_name tensorwise
fi
section "summary"
summary="^===|^exit|ok$|FAILED|TFLOP/s|Training finished|esum|step: +(1|10|12|16) |Error|error:|^side by side|^mask "
grep -E "$summary" "$LOG" | \
  grep -v "^\[rank0\].*INFO (optimizer|Model|embedded)" | grep -v "Error running lspci" | cut -c1-400
