#!/usr/bin/env bash
# Runs dora_jax on this machine's CPU with eight fake devices (enough for every CPU config).
#   launchers/local_cpu.sh configs/tiny.py /tmp/dora_tiny [--config.coordinator.mode=sync ...]
set -euo pipefail
config="${1:-configs/tiny.py}"
workdir="${2:-/tmp/dora_$(basename "${config%%.py*}")}"
shift $(( $# > 2 ? 2 : $# ))
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
exec python -m dora_jax.main --config="$config" --workdir="$workdir" "$@"
