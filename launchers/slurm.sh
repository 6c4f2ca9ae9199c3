#!/usr/bin/env bash
# One run as several processes under Slurm: task 0 is the trainer's lead, tasks
# 1..T-1 the rest of the trainer (DORA_TRAINER_PROCESSES=T, default 1: one SPMD
# program over jax.distributed), every other task a slice process (docs/processes.md).
# One task per host (or per group of a host's accelerators); each trainer task's host
# must give 1/T of the trainer's devices, each slice task its slices' devices.
#
#   sbatch --nodes=3 --ntasks-per-node=1 launchers/slurm.sh \
#       --config=configs/tiny.py --workdir=/shared/dora_run
#   DORA_TRAINER_PROCESSES=2 sbatch --nodes=4 --ntasks-per-node=1 launchers/slurm.sh ...
#
# Each task reads its role from these variables (dora_jax/runtime/roles.py):
#   DORA_NUM_PROCESSES  = SLURM_NTASKS
#   DORA_PROCESS_ID     = SLURM_PROCID
#   DORA_COORDINATOR    = the first node's hostname, port DORA_PORT (default 8476;
#                         the trainer tasks also use DORA_PORT+1 and DORA_PORT+2)
#   DORA_TRAINER_PROCESSES = T (default 1)
#   DORA_AUTHKEY        = a secret shared by the tasks (made here unless set)
# The lead alone writes the workdir; the trainer tasks read its checkpoints when a
# run resumes, so with T > 1 it must be on storage their hosts see. Slurm restarts
# nothing: a dead slice task fails its slices and the run goes on with the others
# (start a replacement task with the same SLURM_PROCID's variables to give them
# back); a dead trainer task ends the run, which the same sbatch line resumes.
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # reads all: no SIGPIPE
export DORA_AUTHKEY="${DORA_AUTHKEY:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
export DORA_COORDINATOR="$head:${DORA_PORT:-8476}"
export DORA_TRAINER_PROCESSES="${DORA_TRAINER_PROCESSES:-1}"
srun --kill-on-bad-exit=0 bash -c \
  'DORA_NUM_PROCESSES=$SLURM_NTASKS DORA_PROCESS_ID=$SLURM_PROCID exec python -m dora_jax.main "$@"' \
  _ "$@"
