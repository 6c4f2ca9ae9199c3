#!/usr/bin/env bash
# Installs dora_jax with this host's accelerator extra in a fresh virtualenv, then
# runs its accelerator check (python -m dora_jax.bench.accelerator).
#   launchers/accelerator.sh [cuda|tpu|cpu|auto] [--out=DIR] [--budget_s=540] ...
# auto: cuda where nvidia-smi sees a GPU, tpu where a TPU is attached, cpu otherwise.
# The report goes to --out (default: $OUT/accelerator_report when $OUT is set). The
# whole command, install included, aims at DORA_ACCELERATOR_SECONDS (default 570:
# one device command of at most 10 minutes); the check gets what the install left
# (a --budget_s given here overrides it).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-auto}"
[[ $# -gt 0 ]] && shift
if [[ "$extra" == auto ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then extra=cuda
  elif compgen -G "/dev/accel[0-9]*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    extra=tpu
  else extra=cpu; fi
fi
venv="${DORA_ACCELERATOR_VENV:-/tmp/dora_accelerator_venv}"
start=$SECONDS
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
if [[ "$extra" == cpu ]]; then python -m pip install -q -e ".[test]"
else python -m pip install -q -e ".[$extra,test]"; fi
echo "installed .[$extra] in $((SECONDS - start)) s"
default_out="accelerator_report"
[[ -n "${OUT:-}" ]] && default_out="$OUT/accelerator_report"
left=$(( ${DORA_ACCELERATOR_SECONDS:-570} - (SECONDS - start) - 10 ))
(( left < 120 )) && left=120
exec python -m dora_jax.bench.accelerator --out="$default_out" --budget_s="$left" "$@"
