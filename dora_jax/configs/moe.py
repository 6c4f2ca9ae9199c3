"""Flagship MoE policy: the Qwen3-30B-A3B architecture, sized for a TPU pod.

Run: python -m dora_jax.main --config=configs/moe.py --workdir=/gcs/BUCKET/run
     (add --config.model.checkpoint=/path/to/Qwen3-30B-A3B --config.data.source=gsm8k
      --config.data.path=/path/to/train.jsonl to train from the checkpoint on GSM8K)
CPU: python -m dora_jax.main --config=configs/moe.py:tiny --workdir=/tmp/dora_moe
(`--config=moe` and `--config=moe:tiny` name the same configs from any directory.)

Default (`--config=configs/moe.py`): 48 layers, d_model 2048, 32 query / 4 KV heads
of dim 128 with QK-norm, every layer MoE with 128 experts, top-8, expert hidden 768,
vocab 151,936, untied embeddings: 30,532,122,624 parameters (30.5B total; about 3.3B
active per token). bf16 compute; layers scanned (one compiled layer), flash-style
attention (`attention=auto`: splash on TPU) and full per-layer remat, so the train
step's memory grows linearly with the 32K-token sequences. Mesh: trainer fsdp=16 x
expert=8 (128 chips) plus 8 decode slices of tensor=4 x expert=4 (16 chips each):
256 chips, e.g. a v5p-512. Decode: a paged KV cache of 64-position pages (the TPU
Pallas paged-attention kernel); a slice's pool holds 32,768 pages, the memory a
dense cache gives 64 full-length slots (2.1M positions, 98 KB each in bf16: about
13 GB per chip), and serves 256 slots: at the paper's mean response (2.4K tokens)
all of them fit, and a slice that runs short preempts its newest request.

Without a checkpoint the command runs as written: a dry run of the whole system with
random weights on the countdown task (dora_jax/tasks/countdown.py: procedural token
prompts with long-tailed response lengths, no file and no tokenizer needed; a random
policy scores about 0, so expect the plumbing exercised, not learning). On a host
with fewer than 256 devices it stops before any compute with one line:
`error: config.mesh: configs/moe.py needs 256 devices (trainer 128 + 8 decode slices
x 16), but this host has 1 (cpu): run configs/moe.py:tiny here`.

With `--config.model.checkpoint` (a local Hugging Face directory of Qwen3-30B-A3B: its
config.json is checked against every shape above, a mismatch named by field) the
trainer starts from its weights, placed shard by shard on the trainer mesh (no device
ever holds the whole checkpoint), and prompts use its tokenizer and chat template
(EOS <|im_end|> 151,645 and pad <|endoftext|> 151,643 come from the tokenizer). The
token task means nothing to a real tokenizer, so name a text source with it
(`--config.data.source=gsm8k --config.data.path=FILE`; a missing file is one line
naming config.data.path). Export the trained policy with `python -m dora_jax.export`
(same flags, plus --workdir and --out).

`--config=configs/moe.py:tiny`: the same architecture family at CPU size — 2 layers,
d_model 64, 4 query / 2 KV heads of dim 16, 8 experts top-2 of hidden 32, one shared
expert, vocab 128: 152,960 parameters. Mesh and workload as configs/tiny.py:spread
(the residue task) but with expert=2 on the trainer (8 fake CPU devices).

`:lora` and `:tiny_lora`: the same with LoRA (model/lora.py) on attention q/k/v/o,
rank 32 (alpha 64; tiny: rank 4) over the frozen base, learning rate 10x the full
model's. A publish carries the adapters alone: 0.09% of the flagship's weight bytes
(5.5% with `--config.model.lora.experts=True`, which adapts every expert too).
Run: python -m dora_jax.main --config=configs/moe.py:lora --workdir=/gcs/BUCKET/run
CPU: python -m dora_jax.main --config=configs/moe.py:tiny_lora --workdir=/tmp/dora_moe_lora
(tiny_lora: 152,960 parameters of the base plus 5,888 of adapters; a dry run as :tiny)
"""

import os

from dora_jax import config as config_lib

VARIANTS = (None, "tiny", "lora", "tiny_lora")

# LoRA: rank-32 adapters on attention q/k/v/o, the base frozen; the adapters alone train
# and are published (0.09% of the weights' bytes per version). The experts' projections
# too with --config.model.lora.experts=True (5.5%).
LORA = dict(rank=32, alpha=64.0)


def get_config(arg=None):
    if arg not in VARIANTS:
        raise ValueError(f"configs/moe.py: unknown variant {arg!r}; known: {VARIANTS}")
    if arg in ("lora", "tiny_lora"):
        c = get_config("tiny" if arg == "tiny_lora" else None)
        c.model.lora.update(LORA if arg == "lora" else dict(LORA, rank=4, alpha=8.0))
        # Adapters take about 10x the full model's step (configs/quickstart.py:lora).
        c.trainer.learning_rate *= 10
        return c
    if arg == "tiny":
        # configs/tiny.py:spread (model, mesh, rollout, workload) with every MLP made MoE.
        here = os.path.dirname(os.path.abspath(__file__))
        c = config_lib.load(os.path.join(here, "tiny.py:spread"))
        c.model.moe.update(dict(num_experts=8, top_k=2, expert_hidden=32,
                                num_shared_experts=1, shared_expert_hidden=32,
                                aux_loss_coef=1e-3, z_loss_coef=1e-4))
        c.mesh.trainer.update(dict(data=2, fsdp=1, tensor=1, expert=2))
        return c
    c = config_lib.base()
    c.model.update(dict(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32,
                        num_kv_heads=4, head_dim=128, mlp_hidden=6144,
                        tie_embeddings=False, qk_norm=True, rope_theta=1_000_000.0,
                        dtype="bfloat16", param_dtype="float32",
                        # 32K-token train sequences: flash-style attention (splash on
                        # TPU), each layer recomputed in the backward pass.
                        attention="auto", attention_block=512, remat="full",
                        scan_layers=True))
    # Dropless in training too (ragged_dot, grouped matmuls on TPU): the trainer's
    # log-probs are then those of the engine's dropless decoding.
    c.model.moe.update(dict(num_experts=128, top_k=8, expert_hidden=768, moe_every=1,
                            normalize_topk=True, dispatch="dropless",
                            aux_loss_coef=1e-3, z_loss_coef=0.0))
    c.mesh.trainer.update(dict(data=1, fsdp=16, tensor=1, expert=8))
    c.mesh.slice.update(dict(tensor=4, expert=4))
    c.mesh.num_slices = 8
    c.rollout.update(dict(slots_per_slice=256, max_prefill_length=2048, max_decode_len=30_720,
                          prefill_buckets=(512, 1024, 2048), temperature=1.0,
                          kv_cache="paged", page_size=64, kv_pages=64 * 512,
                          paged_attention="auto"))
    c.trainer.update(dict(learning_rate=1e-6, warmup_steps=10, micro_batches=16,
                          length_buckets=(4096, 8192, 16384, 32768)))
    # The paper's workload shape: 512 prompts x 16 samples per step, K=3.
    c.coordinator.update(dict(mode="dora", group_size=16, train_batch_size=512,
                              rollout_batch_size=768, max_staleness=3, num_steps=1000))
    # A procedural task that needs no file or tokenizer, so the command runs as written
    # (a dry run with random weights). EOS / pad ids are left unset: the token task's
    # (1, 0) here, the tokenizer's with a checkpoint or data.tokenizer.
    c.data.update(dict(source="countdown", reward="countdown", num_prompts=4096,
                       count_median=12.0, count_sigma=1.1, max_count=255))
    return c
