#!/usr/bin/env bash
# The real-model GPU job (SmolLM2-135M-Instruct, arithmetic word problems, GRPO 8 prompts x 8
# samples, up to 128 new tokens, `math` reward, embedded engine colocated with its default
# options) on one GPU, after the install calls of ../shared/device/README.md (ray & co. in
# /tmp/site, the GGUF in /tmp/models). Writes the console log, metrics.jsonl, charts and
# engine logs to $OUT/<name>/.
#
#   STEPS=200 bash bench/smollm2_gpu.sh loop       # the rl-train job
#   bash bench/smollm2_gpu.sh generate             # engine vs HF generate on one batch
#                                                  # (bench/rollout_vs_generate.py)
#   NAME=grpo bash bench/smollm2_gpu.sh learn      # examples/smollm2/gpu.yaml: GRPO, real
#                                                  # SGLang from /tmp/sgsite, eval every 25
#   bash bench/smollm2_gpu.sh trl                  # TRL's GRPOTrainer, same job
#                                                  # (bench/trl_grpo.py)
# learn and trl also sample the GPU's utilisation every second into <name>.gpu.csv.
# Extra rl-train options follow the phase: bash bench/smollm2_gpu.sh loop --rollout.top_p 0.9
set -u
phase=${1:?usage: bash bench/smollm2_gpu.sh loop|generate [rl-train options]}
shift
OUT=${OUT:-runs/smollm2_gpu}
RUNS=${RUNS:-/tmp/smollm2_gpu}
GGUF=${GGUF:-/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=/tmp/site:$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONUNBUFFERED=1

gpu_sampler() {  # utilisation (%) and memory (MiB) every second until the phase ends
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
    -lms 1000 > "$OUT/$1.gpu.csv" 2>/dev/null &
  sampler=$!
}

case $phase in
learn)
  name=learn_${NAME:-grpo}
  rm -rf "${RUNS:?}/$name"
  gpu_sampler "$name"
  RL_SGLANG_PYTHONPATH=${RL_SGLANG_PYTHONPATH:-/tmp/sgsite} timeout -k 30 "${LIMIT_S:-560}" \
    python3 -m rl_launcher.cli --config examples/smollm2/gpu.yaml --model.path "$GGUF" \
    --num_steps "${STEPS:-150}" --logging.run_dir "$RUNS/$name" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}"
  kill "$sampler"
  mkdir -p "$OUT/$name"
  cp -r "$RUNS/$name/metrics.jsonl" "$RUNS/$name/plots" "$RUNS/$name/logs" "$OUT/$name/" 2>/dev/null
  ;;
trl)
  name=trl_${NAME:-grpo}
  gpu_sampler "$name"
  timeout -k 30 "${LIMIT_S:-560}" python3 bench/trl_grpo.py --gguf "$GGUF" --work "$RUNS/$name" \
    --out "$OUT/$name" --steps "${STEPS:-150}" "$@" 2>&1 | grep -v "it/s]$" | tee "$OUT/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}"
  kill "$sampler"
  ;;
loop)
  name=loop_${NAME:-default}
  rm -rf "${RUNS:?}/$name"
  timeout -k 20 "${LIMIT_S:-560}" python3 -m rl_launcher.cli \
    --config examples/smollm2/config.yaml --model.path "$GGUF" \
    --cluster.device cuda --model.dtype bfloat16 --num_steps "${STEPS:-200}" \
    --rollout.batch_size 8 --rollout.group_size 8 --rollout.max_response_tokens 128 \
    --rollout.reward math --rollout.reward_timeout_s 10 --checkpoint.interval 0 \
    --logging.run_dir "$RUNS/$name" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}"
  mkdir -p "$OUT/$name"
  cp -r "$RUNS/$name/metrics.jsonl" "$RUNS/$name/plots" "$RUNS/$name/logs" "$OUT/$name/" 2>/dev/null
  ;;
generate)
  python3 bench/rollout_vs_generate.py --gguf "$GGUF" --work "$RUNS/generate" "$@" \
    | tee "$OUT/rollout_vs_generate.json"
  ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
