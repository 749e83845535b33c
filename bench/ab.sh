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
# `run` prints one line per run (variant, exit status, rl-fsdp and plain-loop tokens/s; with
# --profile the profiled step's busy share, idle gaps and attention time; the graph breaks
# and graphs where the variant's bench reports them) and writes each run's JSON report to
# $OUT/ab_<variant>_<round>.json (OUT defaults to runs/ab).
# VARIANT_ARGS="exp_cuda-graphs:--fill-micro-batches --compile-mode reduce-overhead" adds
# arguments for one variant only (entries separated by ';'; flags only its bench knows).
# BENCH=bench/train_megatron.py switches the bench, ROUNDS=N the number of rounds (2),
# LIMIT_S the seconds one run may take (150), PYTHON the interpreter (python3).
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

case $cmd in
export)
  [ $# -gt 0 ] || { echo "name at least one commit" >&2; exit 2; }
  for rev in "$@"; do export_rev "$rev"; done
  ;;
run)
  OUT=${OUT:-runs/ab}
  mkdir -p "$OUT"
  for round in $(seq "${ROUNDS:-2}"); do
    run_one head "$here" "$round" "$@"
    for dir in "$here"/ab/*/; do
      [ -d "$dir" ] && run_one "$(basename "$dir")" "${dir%/}" "$round" "$@"
    done
  done
  ;;
*)
  echo "unknown command $cmd (export or run)" >&2
  exit 2
  ;;
esac
