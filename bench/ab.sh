#!/usr/bin/env bash
# Same-run A/B of a training bench across commits: each commit's package sources and bench
# scripts run in turn on the same GPU, interleaved with the working tree, so that the host's
# state (clocks, other jobs) hits every variant alike.
#
#   bash bench/ab.sh export REV [REV ...]   # here: each REV's packages/*/src and bench/
#                                           # into ab/<REV>/ (git-ignored; carry it: ["ab"])
#   bash bench/ab.sh run ARGS...            # on the GPU machine: for each ab/<REV> and the
#                                           # working tree ("head"), twice in turn,
#                                           # python bench/train_fsdp.py ARGS
#   bash bench/ab.sh loop ARGS...           # the same with rl-train: python3 -m
#                                           # rl_launcher.cli ARGS (a loop config), then
#                                           # bench/e2e_summary.py over every run
# `run` prints one line per run (variant, exit status, rl-fsdp and plain-loop tokens/s; with
# --profile the profiled step's busy share, idle gaps and attention time; the graph breaks
# and graphs where the variant's bench reports them) and writes each run's JSON report to
# $OUT/ab_<variant>_<round>.json (OUT defaults to runs/ab).
# VARIANT_ARGS="exp_cuda-graphs:--fill-micro-batches --compile-mode reduce-overhead" adds
# arguments for one variant only (entries separated by ';'; flags only its bench knows).
# BENCH=bench/train_megatron.py switches the bench, ROUNDS=N the number of rounds (2),
# LIMIT_S the seconds one run may take (150), PYTHON the interpreter (python3). Even rounds
# run the variants in the reverse order: in one call the run that goes first is often
# slower (colder caches and clocks), so each variant goes first once in two rounds.
# `loop` runs each variant's packages with the working tree's examples/ (VARIANT_ARGS applies
# too: `export HEAD` and VARIANT_ARGS="HEAD:--engine.decode_attention sdpa" A/B an option on
# the same code); its runs go to
# $RUNS/<variant>_<round> (RUNS defaults to /tmp/ab_runs), their metrics.jsonl to
# $OUT/loop_<variant>_<round>.metrics.jsonl and the summary to $OUT/loop_summary.json. A
# loop run spends about two minutes starting on a fresh GPU machine (model, trainer,
# engine compile): budget LIMIT_S for that plus the steps.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:?usage: bash bench/ab.sh export REV... | run ARGS...}
shift

export_rev() {  # export_rev REV: ab/REV ('/' as '_') holds that commit's sources and bench
  local rev=$1 dir="$here/ab/${1//\//_}"
  rm -rf "$dir" && mkdir -p "$dir"
  git -C "$here" archive "$rev" bench $(cd "$here" && ls -d packages/*/src) | tar -x -C "$dir"
  echo "ab/${rev//\//_}: $(git -C "$here" log -1 --format='%h %s' "$rev" | cut -c1-90)"
}

pythonpath() {  # pythonpath ROOT: ROOT's package sources, then the device's site (/tmp/site)
  echo "$(ls -d "$1"/packages/*/src | tr '\n' ':')/tmp/site"
}

variant_args() {  # variant_args NAME: the extra arguments VARIANT_ARGS gives NAME, if any
  local entry
  IFS=';' read -ra entries <<< "${VARIANT_ARGS:-}"
  for entry in "${entries[@]}"; do
    [ "${entry%%:*}" = "$1" ] && echo "${entry#*:}"
  done
}

run_one() {  # run_one NAME ROOT ROUND ARGS...
  local name=$1 root=$2 round=$3
  shift 3
  # shellcheck disable=SC2046  # the extra arguments split on spaces on purpose
  set -- "$@" $(variant_args "$name")
  local log="$OUT/ab_${name}_${round}.log"
  (cd "$root" && PYTHONPATH=$(pythonpath "$root") timeout "${LIMIT_S:-150}" \
    "${PYTHON:-python3}" "${BENCH:-bench/train_fsdp.py}" "$@" > "$log" 2>&1)
  local status=$?
  python3 - "$log" "$OUT/ab_${name}_${round}.json" "$name" "$status" <<'EOF'
import json, sys
log, out, name, status = sys.argv[1:]
text = open(log).read()
try:
    # the report is the last top-level object (a log line may print one before it)
    start = text.rindex("\n{\n") + 1 if "\n{\n" in text else text.index("{\n")
    report = json.loads(text[start : text.rindex("\n}") + 2])
except ValueError:
    print(f"{name}: exit {status}, no report (see {log})")
    sys.exit()
json.dump(report, open(out, "w"), indent=1)
fig, base = report.get("figure", {}), report.get("baseline", {})
line = (f"{name}: exit {status}, {fig.get('tokens_per_s', 0):,.0f} tokens/s "
        f"(MFU {100 * (fig.get('mfu') or 0):.1f} %), plain loop {base.get('tokens_per_s', 0):,.0f}")
prof, comp = fig.get("profile"), fig.get("compile")
if prof:  # --profile: busy share, idle gaps and attention kernel time of the profiled step
    gaps, cats = prof["idle_gaps"], prof["categories_ms"]
    line += (f"; profiled step {prof['step_ms']:.1f} ms, busy {100 * prof['busy_fraction']:.1f} %,"
             f" idle gaps {gaps['total_ms']:.1f} ms in {gaps['count']},"
             f" attention {cats.get('attention', 0):.1f} ms, gemm {cats.get('gemm', 0):.1f} ms")
if comp:
    line += f"; graph breaks {comp['graph_breaks']}, graphs {comp['unique_graphs']}"
print(line)
EOF
}

variants() {  # variants ROUND: "name root" lines, the working tree first in odd rounds
  local lines dir
  lines="head $here"
  for dir in "$here"/ab/*/; do
    [ -d "$dir" ] && lines+=$'\n'"$(basename "$dir") ${dir%/}"
  done
  if [ $(($1 % 2)) -eq 0 ]; then echo "$lines" | tac; else echo "$lines"; fi
}

run_loop() {  # run_loop NAME ROOT ROUND ARGS...: one rl-train run of ROOT's packages
  local name=$1 root=$2 round=$3 start=$SECONDS
  shift 3
  # shellcheck disable=SC2046  # the extra arguments split on spaces on purpose
  set -- "$@" $(variant_args "$name")
  local dir="$RUNS/${name}_$round"
  rm -rf "$dir"
  (cd "$here" && PYTHONPATH=$(pythonpath "$root") timeout -k 20 "${LIMIT_S:-150}" \
    "${PYTHON:-python3}" -m rl_launcher.cli "$@" --logging.run_dir "$dir" \
    > "$OUT/loop_${name}_$round.log" 2>&1)
  echo "$name round $round: exit $?, $((SECONDS - start)) s"
  cp "$dir/metrics.jsonl" "$OUT/loop_${name}_$round.metrics.jsonl" 2>/dev/null
  LOOP_RUNS+=("$dir")
}

loop_summary() {  # the steady-state medians of every run, one line each
  PYTHONPATH=$(pythonpath "$here") "${PYTHON:-python3}" "$here/bench/e2e_summary.py" \
    "${LOOP_RUNS[@]}" --skip 3 > "$OUT/loop_summary.json" || return 0
  python3 - "$OUT/loop_summary.json" <<'EOF'
import json, sys
for name, run in json.load(open(sys.argv[1]))["runs"].items():
    t, perf = run.get("time_median_s", {}), run.get("perf_median", {})
    keys = ("step", "rollout", "log_probs", "train", "sync", "overhead")
    parts = " ".join(f"{k} {t[k]:.3f}" for k in keys if t.get(k) is not None)
    print(f"{name}: {run.get('steps')} steps, {parts}, overhead "
          f"{100 * (perf.get('time/overhead_frac') or 0):.1f} %, GPU busy "
          f"{run.get('gpu_median', {}).get('gpu/util/0')}")
EOF
}

case $cmd in
export)
  [ $# -gt 0 ] || { echo "name at least one commit" >&2; exit 2; }
  for rev in "$@"; do export_rev "$rev"; done
  ;;
run | loop)
  OUT=${OUT:-runs/ab} RUNS=${RUNS:-/tmp/ab_runs}
  # absolute: a loop runs from the repo root
  OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) RUNS=$(mkdir -p "$RUNS" && cd "$RUNS" && pwd)
  LOOP_RUNS=()
  for round in $(seq "${ROUNDS:-2}"); do
    while read -r name root; do
      if [ "$cmd" = run ]; then run_one "$name" "$root" "$round" "$@"
      else run_loop "$name" "$root" "$round" "$@"; fi
    done < <(variants "$round")
  done
  if [ "$cmd" = loop ]; then loop_summary; fi
  ;;
*)
  echo "unknown command $cmd (export, run or loop)" >&2
  exit 2
  ;;
esac
