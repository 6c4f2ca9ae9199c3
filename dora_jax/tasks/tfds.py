"""`tfds`: text prompts of a prepared TFDS dataset (data/tfds_local.py reads it;
`python -m dora_jax.data.tfds_local` builds one from JSONL), each scored by the
verifier its record names."""

from __future__ import annotations

from dora_jax.data import prompts
from dora_jax.tasks.base import Task, chat_tokenizer, register, text_options


@register
class Tfds(Task):
    name = "tfds"
    reward = "by_record"
    text = True
    needs = "tfds_name"

    def records(self, cfg, tokenizer=None) -> list[dict]:
        from dora_jax.data import tfds_local

        d = cfg.data
        source = tfds_local.tfds_records(d.tfds_name, d.tfds_split, d.tfds_dir or None,
                                         chat_tokenizer(cfg, tokenizer), **text_options(cfg))
        # Records are needed whole (prompt lengths checked, resumable stream over a list).
        records = [source[i] for i in range(len(source))]
        prompts.check_unique(records, [f"{d.tfds_name}/{d.tfds_split}[{i}]"
                                       for i in range(len(records))])
        return records
