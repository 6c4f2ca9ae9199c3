"""Prompt sources (Grain): streams, JSONL and TFDS-style sources, the length filter."""

import json

import pytest

from dora_jax.data import prompts
from dora_jax.tasks.residue import residue_prompts


def test_stream_reshuffles_each_epoch_with_stable_ids_and_resumes():
    records = residue_prompts(6, 64)
    ds = prompts.prompt_dataset(records, seed=0, num_epochs=3)
    stream = prompts.PromptStream(ds)
    seen = [stream.next() for _ in range(18)]
    assert stream.next() is None  # finite: three epochs, then done
    epochs = [[r["prompt_id"] for r in seen if r["epoch"] == e] for e in range(3)]
    for ids in epochs:  # every epoch visits every prompt exactly once
        assert sorted(ids) == sorted(r["prompt_id"] for r in records)
    assert epochs[0] != epochs[1]  # and in a different order
    # Resume from a saved iterator state: the continuation is identical.
    stream = prompts.PromptStream(ds)
    for _ in range(7):
        stream.next()
    state = stream.get_state()
    rest = [stream.next()["prompt_id"] for _ in range(5)]
    resumed = prompts.PromptStream(ds)
    resumed.set_state(state)
    assert [resumed.next()["prompt_id"] for _ in range(5)] == rest


def test_jsonl_source_reports_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt_id": "a", "tokens": [2, 5]}) + "\n\n"
                    + json.dumps({"text": "hi"}) + "\n")
    records = prompts.read_jsonl(str(good), tokenize=lambda s: [ord(c) for c in s])
    assert records[0]["prompt_id"] == "a"
    assert records[1]["tokens"] == [104, 105] and records[1]["prompt_id"].endswith(":3")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_id": "a", "tokens": [2, 5]}) + "\n{not json\n")
    with pytest.raises(prompts.DataError, match=r"bad\.jsonl:2: not valid JSON"):
        prompts.read_jsonl(str(bad))
    bad.write_text(json.dumps({"prompt_id": "a", "tokens": []}) + "\n")
    with pytest.raises(prompts.DataError, match=r"bad\.jsonl:1: 'tokens'"):
        prompts.read_jsonl(str(bad))
    bad.write_text(json.dumps({"prompt_id": "a", "tokens": [500]}) + "\n")
    with pytest.raises(prompts.DataError, match="vocab_size"):
        prompts.read_jsonl(str(bad), vocab_size=128)
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(prompts.DataError, match="no tokenizer"):
        prompts.read_jsonl(str(bad))


def test_tfds_style_source_through_grain():
    # A TFDS data_source is a random-access sequence of example dicts; any such
    # sequence can stand in for it (nothing is downloaded in tests).
    examples = [{"question": [2, 7, 9], "answer": [4]}, {"question": [2, 3], "answer": [5]}]
    source = prompts.TfdsSource("fake", "train",
                                lambda ex, i: {"prompt_id": f"fake-{i}",
                                               "tokens": ex["question"], "answer": ex["answer"]},
                                source=examples)
    ds = prompts.prompt_dataset(source, seed=1, num_epochs=1)
    got = sorted(r["prompt_id"] for r in ds)
    assert got == ["fake-0", "fake-1"]
    broken = prompts.TfdsSource("fake", "train", lambda ex, i: {"prompt_id": i, "tokens": []},
                                source=examples)
    with pytest.raises(prompts.DataError, match=r"fake/train\[0\]"):
        broken[0]


def test_long_prompts_are_an_error_or_skipped_with_a_filter_line(tmp_path, load_config):
    """A JSONL prompt past rollout.max_prefill_length (16 in configs/tiny.py) stops
    the run before any compute by default; with data.skip_long_prompts it is left
    out, and the ledger's prompt-level `filter` line for it passes the audit."""
    from dora_jax.scheduler import ledger
    from dora_jax.tasks import sources

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_id": "short", "tokens": [2, 5, 6]}\n'
                    '{"prompt_id": "long", "tokens": ' + str([5] * 20) + '}\n')
    strict = load_config("configs/tiny.py:spread", data__source="jsonl", data__path=str(path))
    with pytest.raises(prompts.DataError, match=r"1 prompt\(s\) longer .* \['long'\]"):
        sources.prompt_records(strict)
    lenient = load_config("configs/tiny.py:spread", data__source="jsonl", data__path=str(path),
                          data__skip_long_prompts=True)
    records, skipped = sources.prompt_records(lenient)
    assert [r["prompt_id"] for r in records] == ["short"]
    assert skipped == ["long"]
    events = [dict(event="filter", prompt_id="long", reason="prompt over max"),
              dict(event="admit", group_id=0, prompt_id="short", version=0),
              dict(event="unconsumed", group_id=0, version=0)]
    assert ledger.audit(events, train_batch_size=1, group_size=1, max_staleness=0).ok
