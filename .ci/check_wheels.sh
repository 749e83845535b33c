#!/usr/bin/env bash
# Build every package as released (no workspace sources), then install the light packages
# alone into fresh virtual environments and fail if importing them drags in anything heavy.
set -euo pipefail
work="${1:?usage: check_wheels.sh WORK_DIR}"
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$work/dist"
rm -rf "$dist" && mkdir -p "$dist"
uv build --no-sources --all-packages --wheel --out-dir "$dist" --directory "$root" -q
ls "$dist"

check_alone() {  # package-name import-name forbidden-modules...
    local pkg="$1" mod="$2"; shift 2
    local venv="$work/alone-$pkg"
    rm -rf "$venv"
    uv venv -q "$venv"
    uv pip install -q -p "$venv/bin/python" "$dist/${pkg//-/_}"-*.whl
    "$venv/bin/python" "$root/.ci/check_light_import.py" "$mod" "$@"
}
siblings="rl_core rl_rewards rl_sglang rl_fsdp rl_megatron rl_launcher"
heavy="ray transformers megatron sglang sglang_router"
check_alone rl-core rl_core $heavy $siblings
check_alone rl-rewards rl_rewards torch $heavy $siblings

# The checker itself must be able to fail: rl-core imports torch, so forbidding torch must trip it.
if "$work/alone-rl-core/bin/python" "$root/.ci/check_light_import.py" rl_core torch >/dev/null; then
    echo "FAIL: check_light_import.py did not notice torch being imported" >&2
    exit 1
fi
echo "ok: the import checker catches a forbidden module"
