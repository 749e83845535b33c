#!/usr/bin/env bash
# The end-to-end GPU runs of examples/gpu (issue 8) on a 2-GPU machine (nvidia-h200-x2),
# after the install calls of examples/gpu/README.md. Each run has a wall-clock limit; its
# metrics.jsonl, charts, SGLang/engine logs and console log go to $OUT/<run>/, and a
# summary (bench/e2e_summary.py) to $OUT/summary_<phase>.json.
#
#   bash bench/gpu_e2e.sh colocated      # GPU 0: FSDP + SGLang, then FSDP + embedded engine;
#                                        # GPU 1 meanwhile: Megatron + SGLang, then FSDP +
#                                        # SGLang with the training state left resident
#   bash bench/gpu_e2e.sh colocated_resident  # GPU 0: training state resident; GPU 1: no
#                                        # turns at all (trainer and engine both resident)
#   bash bench/gpu_e2e.sh disaggregated  # GPUs 0+1: one_step_async, then sync
#   bash bench/gpu_e2e.sh weight_sync    # GPUs 0+1: NCCL weight sync into real SGLang
# On a 4-GPU machine both phases run at once with `bash bench/gpu_e2e.sh all` (colocated on
# GPUs 0 and 1, disaggregated on 2+3). STEPS=N overrides the configs' num_steps.
set -u
phase=${1:?usage: bash bench/gpu_e2e.sh colocated|colocated_resident|disaggregated|all|weight_sync}
OUT=${OUT:-runs/gpu_e2e}
RUNS=${RUNS:-/tmp/gpu_e2e}  # run directories (model copies stay here, off $OUT)
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export RL_SGLANG_PYTHONPATH=${RL_SGLANG_PYTHONPATH:-/tmp/sgsite} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

train() {  # train NAME GPUS LIMIT_S ARGS...: one rl-train run on GPUS, at most LIMIT_S seconds
  local name=$1 gpus=$2 limit=$3
  shift 3
  rm -rf "${RUNS:?}/$name"  # a run of an earlier phase on this machine (its files are in $OUT)
  spy "$name" &
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 20 "$limit" python3 -m rl_launcher.cli "$@" \
    ${STEPS:+--num_steps "$STEPS"} --logging.run_dir "$RUNS/$name" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? at $(date +%T)"
  mkdir -p "$OUT/$name"
  cp -r "$RUNS/$name/metrics.jsonl" "$RUNS/$name/plots" "$RUNS/$name/logs" "$OUT/$name/" 2>/dev/null
  return 0
}

spy() {  # with PYSPY_AT=S: py-spy samples run NAME (driver, Ray workers, servers) for
  # PYSPY_S seconds (default 15), S seconds after its start, into $OUT/NAME.pyspy.txt
  # (collapsed stacks, idle included); needs py-spy on PATH and ptrace rights
  [ -n "${PYSPY_AT:-}" ] || return 0
  sleep "$PYSPY_AT"
  local pid
  pid=$(pgrep -f -- "--logging.run_dir $RUNS/$1\$" | grep -v "^$$\$" | tail -1)
  [ -n "$pid" ] || return 0
  py-spy record --subprocesses --idle -d "${PYSPY_S:-15}" -r 50 -f raw \
    -o "$OUT/$1.pyspy.txt" --pid "$pid" > "$OUT/$1.pyspy.log" 2>&1
}

case $phase in
colocated_sglang)  # only the two SGLang runs, side by side
  train colocated_fsdp "${GPU_A:-0}" 300 --config examples/gpu/colocated_fsdp.yaml &
  train colocated_megatron "${GPU_B:-1}" 300 --config examples/gpu/colocated_megatron.yaml &
  wait
  ;;
colocated)  # two chains of two runs, one chain per GPU
  (train colocated_fsdp "${GPU_A:-0}" 270 --config examples/gpu/colocated_fsdp.yaml
   train colocated_embedded "${GPU_A:-0}" 240 --config examples/gpu/colocated_fsdp.yaml \
     --engine.kind embedded) &
  (train colocated_megatron "${GPU_B:-1}" 270 --config examples/gpu/colocated_megatron.yaml
   train colocated_fsdp_resident "${GPU_B:-1}" 240 --config examples/gpu/colocated_fsdp.yaml \
     --backend.offload_when_idle false) &  # the engine takes turns, the trainer stays
  wait
  python3 bench/e2e_summary.py "$RUNS"/colocated_* > "$OUT/summary_colocated.json"
  ;;
colocated_resident)  # FSDP + SGLang with the training state resident (GPU A), and with no
  # turns at all, both resident (GPU B): what the turns cost when everything fits
  train colocated_fsdp_resident "${GPU_A:-0}" 270 --config examples/gpu/colocated_fsdp.yaml \
    --backend.offload_when_idle false &
  train colocated_fsdp_no_turns "${GPU_B:-1}" 270 --config examples/gpu/colocated_fsdp.yaml \
    --backend.offload_when_idle false --engine.release_when_idle false &
  wait
  python3 bench/e2e_summary.py "$RUNS"/colocated_fsdp_* > "$OUT/summary_colocated_resident.json"
  ;;
disaggregated)
  train disagg_async "${GPU_PAIR:-0,1}" 270 --config examples/gpu/disaggregated.yaml
  train disagg_sync "${GPU_PAIR:-0,1}" 240 --config examples/gpu/disaggregated.yaml --rollout.loop sync
  python3 bench/e2e_summary.py "$RUNS"/disagg_* --pair disagg_async disagg_sync \
    > "$OUT/summary_disaggregated.json"
  ;;
all)  # a 4-GPU machine: the colocated phase on GPUs 0 and 1, the disaggregated one on 2+3
  GPU_A=0 GPU_B=1 bash "$0" colocated &
  GPU_PAIR=2,3 bash "$0" disaggregated &
  wait
  ;;
weight_sync)  # the disaggregated weight-sync bench with real SGLang (the colocated one: --engines);
  # SGLang's first start on a fresh machine takes ~2.5 min of the limit
  CUDA_VISIBLE_DEVICES=${GPU_PAIR:-0,1} timeout -k 10 300 python3 bench/weight_sync.py \
    --engines sglang --disaggregated --only-disaggregated --out "$OUT/weight_sync_sglang.json" \
    > "$OUT/weight_sync.log" 2>&1
  echo "weight_sync: exit $? at $(date +%T)"
  ;;
*)
  echo "unknown phase $phase (colocated, colocated_resident, disaggregated, all or weight_sync)" >&2
  exit 2
  ;;
esac
