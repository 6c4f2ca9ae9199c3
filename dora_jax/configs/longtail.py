"""Long-tailed workload on a CPU: DORA's regime, learnable by a tiny policy.

SFT:  python -m dora_jax.sft --config=configs/longtail.py --workdir=/tmp/longtail_sft
RL:   python -m dora_jax.main --config=configs/longtail.py --workdir=/tmp/longtail \\
        --config.init_checkpoint=/tmp/longtail_sft/checkpoints

Task: countdown (dora_jax/tasks/countdown.py): the prompt [BOS, n(L)] asks for
n(L-1) ... n(0) then EOS, so response lengths come from the policy itself; counts L are
lognormal (median 12, sigma 1.1) up to 255, so correct responses have max/mean about
12 and p90/p50 about 3-4 within the 256-token decode limit. A random policy does not
count down; the supervised warm start (first command, a minute on a CPU) does, so the
lengths are long-tailed from RL step 0.

Model: configs/tiny.py's (2 layers, d_model 64, 4 query / 2 KV heads of dim 16, SwiGLU
192) with a 260-token vocabulary for the numbers: 131,968 parameters. Mesh as
configs/tiny.py:spread (8 fake CPU devices). Workload: groups of 4, 4 groups per step, up to
16 groups in flight (dora, partial_rollout), max_staleness 2, 100 steps; RL learning
rate 3e-3 (from a 20-step SFT, sync raises the reward from about 0.66 to 0.76 in 150
steps, mean of 3 seeds over the first and last 15). Measured here: SFT 300 steps, loss
6.03 -> 0.001 (1.5 min); then 20 RL steps in dora mode: responses max 192, mean 21.1
tokens (max/mean 9.1, p90/p50 5.2), none truncated, mean reward 0.95.

Every mode side by side on this workload:
    python -m dora_jax.bench.modes --config=configs/longtail.py --workdir=/tmp/modes

Variants, from the same warm start (its full fine-tuning is the base the adapters
train on, fresh; bench.modes makes it so itself):
  python -m dora_jax.main --config=configs/longtail.py:lora --workdir=/tmp/longtail_lora \\
      --config.init_checkpoint=/tmp/longtail_sft/checkpoints
    rank-8 adapters (alpha 16) on every projection over the frozen base: the
    optimizer covers the adapters alone, and each publish carries them alone.
  python -m dora_jax.main --config=configs/longtail.py:lora_multi --workdir=/tmp/lt_multi \\
      --config.init_checkpoint=/tmp/longtail_sft/checkpoints
    lora, and every slice holds the K + 1 = 3 versions of the staleness window at
    once (rollout.versions_per_slice; dora only): each slot decodes under its own
    request's version, so no slice waits to drain before taking a newer version.
    bench.modes on it runs dora with V = K + 1 and every other mode with V = 1:
    python -m dora_jax.bench.modes --config=configs/longtail.py:lora_multi \\
        --workdir=/tmp/modes_lora
"""

import os

from dora_jax import config as config_lib

VARIANTS = (None, "lora", "lora_multi")

# Adapters want a larger step than the whole model (configs/quickstart.py measured
# 10x there); not tuned on this task.
LORA_LEARNING_RATE = 1e-2


def get_config(arg=None):
    if arg not in VARIANTS:
        raise ValueError(f"configs/longtail.py: unknown variant {arg!r}; known: {VARIANTS}")
    here = os.path.dirname(os.path.abspath(__file__))
    c = config_lib.load(os.path.join(here, "tiny.py:spread"))
    c.model.vocab_size = 260
    c.rollout.update(dict(max_prefill_length=8, max_decode_len=256, prefill_buckets=(8,)))
    # Packed rows as long as the batch's bucket, up to 4 x 264 tokens per micro-batch
    # (4: the trainer mesh's batch shards): a 200-token response no longer pads the
    # other 15 rows of its batch.
    c.trainer.update(dict(learning_rate=3e-3, length_buckets=(32, 64, 136, 264),
                          tokens_per_microbatch=4 * 264))
    # Up to 64 samples admitted for 32 slots, so long-tailed stragglers do not leave
    # slots idle (dora and partial_rollout; FEASIBILITY caps it at TBS x (K + 1)).
    c.coordinator.rollout_batch_size = 16
    c.data.update(dict(source="countdown", reward="countdown", num_prompts=512,
                       count_median=12.0, count_sigma=1.1, max_count=255))
    if arg in ("lora", "lora_multi"):
        c.model.lora.update(dict(rank=8, alpha=16.0))
        c.trainer.learning_rate = LORA_LEARNING_RATE
    if arg == "lora_multi":
        c.rollout.versions_per_slice = c.coordinator.max_staleness + 1
    return c
