#!/usr/bin/env bash
# One run as several processes under Slurm: task 0 is the trainer's lead, every other
# task a slice process (docs/processes.md). One task per host (or per group of a
# host's accelerators); the lead's host must give the trainer's devices, each other
# task its slices' devices.
#
#   sbatch --nodes=3 --ntasks-per-node=1 launchers/slurm.sh \
#       --config=configs/tiny.py --workdir=/shared/dora_run
#
# Each task reads its role from these variables (dora_jax/runtime/roles.py):
#   DORA_NUM_PROCESSES  = SLURM_NTASKS
#   DORA_PROCESS_ID     = SLURM_PROCID
#   DORA_COORDINATOR    = the first node's hostname, port DORA_PORT (default 8476)
#   DORA_AUTHKEY        = a secret shared by the tasks (made here unless set)
# The workdir must be on storage every task's host sees only for the lead, which
# alone writes it. Slurm restarts nothing: a dead slice task fails its slices and the
# run goes on with the others (start a replacement task with the same SLURM_PROCID's
# variables to give them back).
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export DORA_AUTHKEY="${DORA_AUTHKEY:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
export DORA_COORDINATOR="$head:${DORA_PORT:-8476}"
srun --kill-on-bad-exit=0 bash -c \
  'DORA_NUM_PROCESSES=$SLURM_NTASKS DORA_PROCESS_ID=$SLURM_PROCID exec python -m dora_jax.main "$@"' \
  _ "$@"
