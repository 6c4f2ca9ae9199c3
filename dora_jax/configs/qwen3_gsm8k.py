"""Qwen3 on GSM8K: RL from a pretrained Hugging Face checkpoint with a math verifier.

Run: python -m dora_jax.main --config=configs/qwen3_gsm8k.py --workdir=/tmp/qwen3_gsm8k \\
       --config.model.checkpoint=/path/to/Qwen3-0.6B --config.data.path=/path/to/train.jsonl
CPU: python -m dora_jax.main --config=configs/qwen3_gsm8k.py:tiny --workdir=/tmp/qwen3_tiny
Export the trained policy: python -m dora_jax.export --config=configs/qwen3_gsm8k.py
       --config.model.checkpoint=... --config.data.path=... --workdir=... --out=DIR

Default: the architecture, weights and tokenizer come from `--config.model.checkpoint`
(a local Hugging Face directory: Qwen3-0.6B has 596,049,920 parameters with its tied
embeddings, Qwen3-1.7B 1,720,574,976; nothing is downloaded). Prompts are GSM8K-format
JSONL (`question`, `answer` ending `#### N`) from `--config.data.path`, each a chat
turn built by the checkpoint's chat template (non-thinking: enable_thinking=False)
asking for the answer after "####"; the reward is 1 when the response's final number
equals N (dora_jax/rewards/verifiers.py). EOS and pad ids come from the tokenizer.

Hardware: 8 accelerators (a TPU v5e-8 host, or one 8-GPU machine): trainer fsdp=4
on 4 chips (fp32 params and Adam: ~2.4 GB per chip for 0.6B), 4 decode slices of one
chip each, 64 slots per slice, bf16 compute, paged KV cache. Workload: groups of 8,
32 groups per step, 64 admitted ahead, max_staleness 2, responses up to 1024 tokens
(prompts up to 512), learning rate 1e-6, 200 steps, dora mode.

`:tiny` is the same pipeline at CPU size, for checking it end to end: a random
Qwen3-family model (2 layers, d_model 64, 4 query / 2 KV heads of dim 16, SwiGLU 192,
tied embeddings: 131,456 parameters) with the small tokenizer of dora_jax/assets and
the synthetic GSM8K-format problems shipped there (dora_jax/data/word_problems.py);
8 fake CPU devices as configs/tiny.py:spread, 20 steps. A random model scores about 0: the
run checks the plumbing (prompts, verifier, ledger), not learning.
"""

from dora_jax import config as config_lib
from dora_jax.data import word_problems

VARIANTS = (None, "tiny")


def get_config(arg=None):
    if arg not in VARIANTS:
        raise ValueError(f"configs/qwen3_gsm8k.py: unknown variant {arg!r} (use ':tiny' or none)")
    c = config_lib.base()
    c.data.update(dict(source="gsm8k", reward="gsm8k", chat_template_args=dict(
        enable_thinking=False)))
    if arg == "tiny":
        c.model.update(dict(vocab_size=word_problems.TOKENIZER_VOCAB, d_model=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            mlp_hidden=192, tie_embeddings=True, qk_norm=True))
        c.mesh.trainer.update(dict(data=2, fsdp=2, tensor=1, expert=1))
        c.mesh.slice.update(dict(tensor=1, expert=1))
        c.mesh.num_slices = 4
        c.rollout.update(dict(slots_per_slice=8, max_prefill_length=96, max_decode_len=32,
                              prefill_buckets=(64, 96), decode_steps=16))
        c.trainer.update(dict(learning_rate=1e-3, length_buckets=(128,)))
        c.coordinator.update(dict(mode="dora", group_size=4, train_batch_size=4,
                                  rollout_batch_size=8, max_staleness=2, num_steps=20))
        c.data.update(dict(path=word_problems.PROBLEMS_FILE,
                           tokenizer=word_problems.TOKENIZER_DIR))
        return c
    # The architecture comes from --config.model.checkpoint (fields left unset).
    c.model.update(dict(dtype="bfloat16", param_dtype="float32", attention="auto",
                        scan_layers=True, remat="full"))
    c.mesh.trainer.update(dict(data=1, fsdp=4, tensor=1, expert=1))
    c.mesh.slice.update(dict(tensor=1, expert=1))
    c.mesh.num_slices = 4
    c.rollout.update(dict(slots_per_slice=64, max_prefill_length=512, max_decode_len=1024,
                          prefill_buckets=(128, 256, 512), decode_steps=32, temperature=1.0,
                          kv_cache="paged", page_size=64))
    c.trainer.update(dict(learning_rate=1e-6, warmup_steps=10, micro_batches=4,
                          length_buckets=(512, 1024, 1536)))
    c.coordinator.update(dict(mode="dora", group_size=8, train_batch_size=32,
                              rollout_batch_size=64, max_staleness=2, num_steps=200))
    return c
