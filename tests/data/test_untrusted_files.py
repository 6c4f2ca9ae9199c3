"""Files that come from someone else (safetensors and their index, config.json,
tokenizer files and chat templates, JSONL prompt files) are validated before use:
each bad one stops with one line naming the file and the field, tensor or line,
never a bare TypeError/KeyError/ZeroDivisionError/UnicodeDecodeError."""

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time

import jinja2.sandbox
import pytest
from conftest import REPO, SUITE_XLA_FLAGS, load_repo_config

from dora_jax.data import prompts
from dora_jax.model import hf_config, safetensors_file
from dora_jax.model.hf_config import CheckpointError
from dora_jax.tasks import sources, text_files
from dora_jax.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
ASSET_TOKENIZER = REPO / "dora_jax" / "assets" / "tokenizer"


def one_line(error: Exception, *parts: str) -> str:
    """The message, checked to be one line holding every part."""
    text = str(error)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


def raw_safetensors(path, header: dict, data: bytes = b"", *, length=None) -> str:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return str(path)


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


# ------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("header, data, says", [
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, b"",
     "data_offsets [-8, 0] is not two non-negative ints"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24),
     "tensor 'w': data_offsets [8, 24] overlap tensor 'a'"),
    ({"w": {"dtype": "F32", "shape": [0, 4], "data_offsets": [8, 4]}}, bytes(8),
     "tensor 'w': data_offsets [8, 4] are reversed"),
    ({"w": {"dtype": "F32", "shape": [2 ** 62 + 1, 4], "data_offsets": [0, 8]}}, bytes(8),
     "tensor 'w': shape [4611686018427387905, 4] is absurdly large"),
    ({"w": 5}, b"", "tensor 'w': entry must be an object"),
    ({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), "tensor 'w': no dtype"),
    ({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8), "tensor 'w': no shape"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), "tensor 'w': no data_offsets"),
    ({"w": {**F32x2, "dtype": "F8_E5M2"}}, bytes(8),
     "tensor 'w': dtype 'F8_E5M2' is not supported"),
    ({"w": {**F32x2, "dtype": ["F32"]}}, bytes(8), "tensor 'w': dtype ['F32'] is not supported"),
    ({"w": {**F32x2, "shape": [True, 2]}}, bytes(8), "tensor 'w': shape [True, 2] is not a list"),
    ({"w": {**F32x2, "shape": "2"}}, bytes(8), "tensor 'w': shape '2' is not a list"),
    ({"w": {**F32x2, "shape": [2.0]}}, bytes(8), "tensor 'w': shape [2.0] is not a list"),
    ({"w": {**F32x2, "data_offsets": [0, 8, 16]}}, bytes(8),
     "tensor 'w': data_offsets [0, 8, 16]"),
    ({"w": {**F32x2, "data_offsets": [0, 12]}}, bytes(12),
     "tensor 'w': data_offsets [0, 12] hold 12 bytes, but F32 [2] needs 8"),
    ({"w": {**F32x2, "data_offsets": [0, 8]}}, bytes(4),
     "tensor 'w': data_offsets [0, 8] run past the data section's 4 bytes"),
    ({"w": {**F32x2, "data_offsets": [4, 12]}}, bytes(12),
     "tensor 'w': data_offsets [4, 12] leave a hole of 4 bytes"),
    ({"w": F32x2}, bytes(12), "4 bytes after the last tensor belong to none"),
    ({"w": F32x2, "__metadata__": {"format": 1}}, bytes(8),
     "__metadata__ 'format' must be a string"),
    ({"w": F32x2, "__metadata__": ["pt"]}, bytes(8), "__metadata__ must be an object"),
])
def test_bad_safetensors_header_is_one_line_naming_file_and_tensor(tmp_path, header, data, says):
    path = raw_safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError) as e:
        safetensors_file.SafetensorsFile(path)
    one_line(e.value, f"{path}: ", says)


def test_bad_safetensors_framing_is_one_line(tmp_path):
    path = str(tmp_path / "model.safetensors")
    cases = [
        (lambda: open(path, "wb").write(b"\x01\x02"), "shorter than 8 bytes"),
        (lambda: raw_safetensors(path, {"w": F32x2}, bytes(8), length=10 ** 6),
         "header length 1000000 runs past the end"),
        (lambda: raw_safetensors(path, {}, length=2 ** 40), "over the format's limit"),
        (lambda: open(path, "wb").write(struct.pack("<Q", 2) + b"[]"), "header is a JSON list"),
        (lambda: open(path, "wb").write(struct.pack("<Q", 2) + b"\xff{"), "not valid UTF-8"),
        (lambda: open(path, "wb").write(struct.pack("<Q", 2) + b"{x"), "not valid JSON"),
        (lambda: write_header(b'{"w": %s, "w": %s}' % ((json.dumps(F32x2).encode(),) * 2),
                              bytes(8)), "header names 'w' twice"),
    ]

    def write_header(blob, data=b""):
        open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + data)

    for write, says in cases:
        write()
        with pytest.raises(CheckpointError) as e:
            safetensors_file.SafetensorsFile(path)
        one_line(e.value, path, says)


def test_valid_files_still_read(tmp_path):
    """Empty tensors and the files we write pass; the fixtures (written by the
    reference stack) pass the layout rules too."""
    path = raw_safetensors(tmp_path / "model.safetensors", {
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "w": F32x2, "__metadata__": {"format": "pt"}}, struct.pack("<2f", 1.5, -2.0))
    f = safetensors_file.SafetensorsFile(path)
    assert f.get("w").tolist() == [1.5, -2.0] and f.get("e").shape == (0, 3)
    assert f.metadata == {"format": "pt"}
    assert len(safetensors_file.Checkpoint(str(FIXTURES / "qwen3")).names) == 36


def _sharded(tmp_path, weight_map) -> pathlib.Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    raw_safetensors(d / "a.safetensors", {"w": F32x2}, bytes(8))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("weight_map, says", [
    ({"w": "../outside.safetensors"}, "shard '../outside.safetensors' climbs out"),
    ({"w": "/etc/passwd"}, "shard '/etc/passwd' is not a relative file name"),
    ({"w": "sub/../../outside.safetensors"}, "climbs out"),
    ({"w": 3}, "weight_map 'w' must be a file name, got 3"),
    ({"w": "missing.safetensors"}, "shard 'missing.safetensors' does not exist"),
    ({"w": "a.safetensors", "v": "a.safetensors"},
     "weight_map puts tensor 'v' in a.safetensors, which has no such tensor"),
    ([["w", "a.safetensors"]], "weight_map must be a non-empty object"),
])
def test_shard_index_is_confined_and_typed(tmp_path, weight_map, says):
    raw_safetensors(tmp_path / "outside.safetensors", {"w": F32x2}, bytes(8))
    d = _sharded(tmp_path, weight_map)
    with pytest.raises(CheckpointError) as e:
        safetensors_file.Checkpoint(str(d))
    one_line(e.value, str(d / "model.safetensors.index.json"), says)


def test_symlinks_may_not_escape_but_a_hub_cache_snapshot_reads(tmp_path):
    outside = raw_safetensors(tmp_path / "outside.safetensors", {"w": F32x2}, bytes(8))
    d = _sharded(tmp_path, {"w": "link.safetensors"})
    os.symlink(outside, d / "link.safetensors")
    with pytest.raises(CheckpointError) as e:
        safetensors_file.Checkpoint(str(d))
    one_line(e.value, "shard 'link.safetensors' is a link to", "outside the checkpoint")
    single = tmp_path / "single"
    single.mkdir()
    os.symlink(outside, single / "model.safetensors")
    with pytest.raises(CheckpointError, match="is a link to"):
        safetensors_file.Checkpoint(str(single))
    # The hub cache keeps each file once in blobs/ and links it from snapshots/<rev>/.
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    raw_safetensors(repo / "blobs" / "f00d", {"w": F32x2}, bytes(8))
    os.symlink("../../blobs/f00d", repo / "snapshots" / "abc" / "model.safetensors")
    assert safetensors_file.Checkpoint(str(repo / "snapshots" / "abc")).names == {"w"}


def test_index_that_is_not_json_is_named(tmp_path):
    d = _sharded(tmp_path, {"w": "a.safetensors"})
    for text, says in ((b"\xff", "not valid UTF-8"), (b"{", "not valid JSON"),
                       (b"[1]", "expected a JSON object, got list")):
        (d / "model.safetensors.index.json").write_bytes(text)
        with pytest.raises(CheckpointError) as e:
            safetensors_file.Checkpoint(str(d))
        one_line(e.value, "model.safetensors.index.json", says)


# ------------------------------------------------------------------ config.json


def _config_dir(tmp_path, **changes) -> pathlib.Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    config = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("changes, says", [
    (dict(rope_parameters=None, rope_scaling="linear"),
     "rope_scaling must be an object, got 'linear'"),
    (dict(rope_parameters="x"), "rope_parameters must be an object"),
    (dict(num_attention_heads=0), "num_attention_heads 0 is out of range [1, 16384]"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(num_hidden_layers=10 ** 12), "num_hidden_layers 1000000000000 is out of range [1, 1024]"),
    (dict(hidden_size=True), "hidden_size must be an integer, got True"),
    (dict(hidden_size=48.0), "hidden_size must be an integer, got 48.0"),
    (dict(vocab_size=2 ** 30), "vocab_size 1073741824 is out of range"),
    (dict(vocab_size=None), "vocab_size is missing"),
    (dict(intermediate_size=-1), "intermediate_size -1 is out of range"),
    (dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (dict(num_attention_heads=5, num_key_value_heads=None, head_dim=None),
     "num_attention_heads 5 does not divide hidden_size 48"),
    (dict(head_dim=21), "head_dim 21 is odd"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number, got '1e-6'"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps -1.0 is out of range"),
    (dict(hidden_act=["silu"]), "hidden_act must be a str"),
    (dict(use_sliding_window="no"), "use_sliding_window must be true or false"),
    (dict(attention_bias=1), "attention_bias must be true or false"),
    (dict(model_type=["qwen3"]), "model_type ['qwen3'] is not supported"),
    (dict(torch_dtype=["bfloat16"]), "torch_dtype must be a str"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": "8",
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}),
     "rope_parameters.factor must be a number, got '8'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 6.4}),
     "rope_parameters.original_max_position_embeddings must be an integer"),
])
def test_bad_config_json_field_is_named(tmp_path, changes, says):
    from dora_jax.model import hf

    d = _config_dir(tmp_path, **changes)
    with pytest.raises(CheckpointError) as e:
        hf.config_from_checkpoint(str(d))
    one_line(e.value, f"{d / 'config.json'}: ", says)


def test_config_json_that_is_not_an_object_is_named(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    for text, says in ((b"[1, 2]", "expected a JSON object, got list"),
                       (b'{"a": "\xff"}', "not valid UTF-8"), (b"{", "not valid JSON")):
        (d / "config.json").write_bytes(text)
        with pytest.raises(CheckpointError) as e:
            hf_config.read(str(d))
        one_line(e.value, str(d / "config.json"), says)


def test_bad_config_json_through_the_config_is_one_config_error(tmp_path):
    from dora_jax import config as config_lib

    d = _config_dir(tmp_path, num_attention_heads=0)
    with pytest.raises(config_lib.ConfigError) as e:
        load_repo_config("configs/tiny.py:spread", model__checkpoint=str(d))
    one_line(e.value, "model.checkpoint", str(d / "config.json"), "num_attention_heads 0")


def test_fixture_configs_still_read():
    for name in ("qwen3", "qwen3_tied", "qwen3_moe", "qwen2", "llama3", "qwen3_30b_a3b"):
        d = FIXTURES / name
        fields = hf_config.model_fields(hf_config.read(str(d)), str(d / "config.json"))
        assert fields["num_layers"] > 0
    assert hf_config.model_fields(hf_config.read(str(FIXTURES / "qwen3_30b_a3b")))[
        "moe"]["num_experts"] == 128


# ------------------------------------------------------------------ tokenizer files


@pytest.fixture
def tok_dir(tmp_path) -> pathlib.Path:
    d = tmp_path / "tok"
    shutil.copytree(ASSET_TOKENIZER, d)
    return d


def _edit_json(path, **changes):
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("file, content, says", [
    ("tokenizer_config.json", "[1]", "tokenizer_config.json: expected a JSON object, got list"),
    ("tokenizer_config.json", b"{\"a\": \"\xff\"}", "tokenizer_config.json: not valid UTF-8"),
    ("tokenizer_config.json", {"add_bos_token": "false"},
     "tokenizer_config.json: add_bos_token must be true or false, got 'false'"),
    ("tokenizer_config.json", {"eos_token": {"content": 5}},
     "tokenizer_config.json: eos_token must be a string"),
    ("tokenizer_config.json", {"chat_template": 7}, "tokenizer_config.json: chat_template must be"),
    ("generation_config.json", "[2]", "generation_config.json: expected a JSON object"),
    ("generation_config.json", {"eos_token_id": "2"},
     "generation_config.json: eos_token_id must be an int or a list of ints, got '2'"),
    ("generation_config.json", {"eos_token_id": [True]}, "generation_config.json: eos_token_id"),
    ("generation_config.json", {"eos_token_id": 10 ** 9},
     "generation_config.json: eos_token_id 1000000000 is not in the tokenizer's vocabulary"),
    ("config.json", {"eos_token_id": -1}, "config.json: eos_token_id -1 is not in"),
    ("chat_template.jinja", b"{{ '\xff' }}", "chat_template.jinja: not valid UTF-8"),
])
def test_bad_tokenizer_file_is_named(tok_dir, file, content, says):
    path = tok_dir / file
    if file == "chat_template.jinja":  # read only when tokenizer_config.json has none
        _edit_json(tok_dir / "tokenizer_config.json", chat_template=None)
    if isinstance(content, dict):
        _edit_json(path, **content)
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_pretrained(str(tok_dir))
    one_line(e.value, str(tok_dir), says)


# ------------------------------------------------------------------ chat templates

USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize("template, says", [
    ("{{ 9**(9**9) }}", "chat template refused 9 ** 387420489: over 100000 bits"),
    ("{{ 'a'*10**9 }}", "chat template refused repeating a str 1000000000 times"),
    ("{{ [0]*10**9 }}", "chat template refused repeating a list"),
    ("{{ 'x'|center(10**9) }}", "chat template refused |center with argument 1000000000"),
    ("{{ 'x'.ljust(10**9) }}", "refused ljust() with argument 1000000000"),
    ("{{ '%1000000000d' % 1 }}", "refused '%' formatting: a format width"),
    ("{{ '{:>1000000000}'.format(1) }}", "refused format(): a format width"),
    ("{% set s = 'a'*1000000 %}{{ s.replace('', s) }}", "refused replace()"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "refused a '~' operand"),
    ("{% set ns = namespace(x=3) %}{% for i in range(99) %}{% set ns.x = ns.x * ns.x %}"
     "{% endfor %}", "refused a product"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
     "chat template output past 4000000 chars"),
    ("{{ raise_exception('no\nsystem') }}", "chat template failed: no system"),
    ("{% for %}", "chat template line 1:"),
])
def test_runaway_template_stops_fast_in_one_line(tok_dir, template, says):
    _edit_json(tok_dir / "tokenizer_config.json", chat_template=template)
    tok = Tokenizer.from_pretrained(str(tok_dir))
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(USER)
    assert time.monotonic() - start < 5
    one_line(e.value, f"{tok_dir / 'tokenizer_config.json'}: ", says)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'a' * 100000 %}{% for c in s %}{% for d in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_slow_template_hits_the_time_limit(tok_dir, template):
    (tok_dir / "chat_template.jinja").write_text(template)
    _edit_json(tok_dir / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_pretrained(str(tok_dir))
    tok.template_time_limit_s = 0.3
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(USER)
    assert time.monotonic() - start < 3
    one_line(e.value, f"{tok_dir / 'chat_template.jinja'}: chat template exceeded 0.3 s")


# Qwen3's chat template (tools, multi-step tool calls, reasoning_content,
# enable_thinking), as its tokenizer_config.json ships it.
QWEN3_TEMPLATE = (pathlib.Path(__file__).parents[1] / "fixtures" / "qwen3_chat_template.jinja"
                  ).read_text()

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Add 2 and 3, then ü."},
    {"role": "assistant", "content": "<think>\nadd\n</think>\n\ncalling",
     "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a < b & c"}}]


def _reference_render(template: str, **context) -> str:
    """The same template in Jinja's plain immutable sandbox (no limits)."""
    from dora_jax.text import tokenizer as tokenizer_module

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tokenizer_module._tojson
    return env.from_string(template).render(**context)


@pytest.mark.parametrize("thinking", [None, False])
def test_guarded_render_is_the_plain_render_and_fast(tok_dir, thinking):
    _edit_json(tok_dir / "tokenizer_config.json", chat_template=QWEN3_TEMPLATE)
    tok = Tokenizer.from_pretrained(str(tok_dir))
    args = {} if thinking is None else {"enable_thinking": thinking}
    tok.apply_chat_template(USER, tokenize=False)  # compiles once
    for messages, tools in ((CONVERSATION, TOOLS), (CONVERSATION[1:2], None)):
        start = time.monotonic()
        ours = tok.apply_chat_template(messages, tokenize=False, tools=tools, **args)
        assert time.monotonic() - start < 0.5
        assert ours == _reference_render(
            QWEN3_TEMPLATE, messages=messages, tools=tools, add_generation_prompt=True,
            bos_token="", eos_token=tok.eos_token, pad_token=tok.pad_token or "", **args)
    assert "<tool_call>" in ours or tools is None


def test_tokenizer_pickles_after_rendering(tok_dir):
    """Reward workers get the tokenizer pickled, after it has rendered prompts."""
    import pickle

    tok = Tokenizer.from_pretrained(str(tok_dir))
    text = tok.apply_chat_template(USER, tokenize=False)
    again = pickle.loads(pickle.dumps(tok))
    assert again.apply_chat_template(USER, tokenize=False) == text


def test_template_failure_while_building_records_names_the_line_and_file(tok_dir, tmp_path):
    _edit_json(tok_dir / "tokenizer_config.json", chat_template="{{ 'a'*10**9 }}")
    tok = Tokenizer.from_pretrained(str(tok_dir))
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "2 + 2?", "answer": "#### 4"}) + "\n")
    with pytest.raises(prompts.DataError) as e:
        text_files.gsm8k_records(str(path), tok)
    one_line(e.value, f"{path}:1: {tok_dir / 'tokenizer_config.json'}: chat template refused")


# ------------------------------------------------------------------ JSONL prompt files


def test_invalid_utf8_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"tokens": [1]}\n{"tokens": [2], "text": "\xe9t\xe9"}\n')
    with pytest.raises(prompts.DataError) as e:
        prompts.read_jsonl(str(path))
    one_line(e.value, f"{path}:2: not valid UTF-8 (byte 0xe9 at column 26)")


@pytest.mark.parametrize("line, says", [
    ({"tokens": [True, False]}, "'tokens'[0] is True, not a non-negative int"),
    ({"tokens": [3, 1.0]}, "'tokens'[1] is 1.0, not a non-negative int"),
    ({"tokens": [3, -1]}, "'tokens'[1] is -1, not a non-negative int"),
    ({"tokens": [3, 50]}, "'tokens'[1] is 50, not below vocab_size 50"),
    ({"tokens": "123"}, "'tokens' must be a non-empty list of ints, got '123'"),
    ({"tokens": [1], "prompt_id": [1]}, "'prompt_id' must be a string or an int, got [1]"),
    ({"tokens": [1], "prompt_id": True}, "'prompt_id' must be a string or an int"),
    ({"text": 5}, "'text' must be a string, got 5"),
])
def test_bad_tokens_name_file_and_line(tmp_path, line, says):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"tokens": [1, 2]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(prompts.DataError) as e:
        prompts.read_jsonl(str(path), tokenize=lambda text: [1], vocab_size=50)
    one_line(e.value, f"{path}:2: {says}")


def test_duplicate_prompt_ids_name_both_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"prompt_id": "a", "tokens": [1]}, {"prompt_id": "b", "tokens": [2]},
        {"prompt_id": "a", "tokens": [3]})) + "\n")
    with pytest.raises(prompts.DataError) as e:
        prompts.read_jsonl(str(path))
    one_line(e.value, f"{path}:3: prompt_id 'a' repeats the one at {path}:1")
    # A default id (file:line) is refused when a record claims it explicitly.
    path.write_text(json.dumps({"tokens": [1]}) + "\n" +
                    json.dumps({"prompt_id": f"{path}:1", "tokens": [2]}) + "\n")
    with pytest.raises(prompts.DataError, match=r"p\.jsonl:2: prompt_id .* repeats the one at"):
        prompts.read_jsonl(str(path))
    with pytest.raises(prompts.DataError) as e:
        prompts.in_memory([{"prompt_id": 7, "tokens": [1]}, {"prompt_id": 7, "tokens": [1]}])
    one_line(e.value, "record 1: prompt_id 7 repeats the one at record 0")


@pytest.mark.parametrize("fmt, lines", [
    ("gsm8k", [{"id": "q", "question": "1?", "answer": "#### 1"},
               {"id": "q", "question": "2?", "answer": "#### 2"}]),
    ("math", [{"id": 4, "problem": "1?", "answer": "1"},
              {"id": "4", "problem": "2?", "answer": "2"}]),
])
def test_duplicate_ids_in_qa_files_name_both_lines(tmp_path, fmt, lines):
    from _char_tokenizer import CharTokenizer

    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    build = text_files.gsm8k_records if fmt == "gsm8k" else text_files.math_records
    with pytest.raises(prompts.DataError) as e:
        build(str(path), CharTokenizer())
    one_line(e.value, f"{path}:2:", "repeats", f"{path}:1")


def test_duplicate_ids_from_tfds_name_both_indices(monkeypatch):
    from dora_jax.data import tfds_local

    examples = [{"id": b"x", "question": b"1?", "answer": b"#### 1"},
                {"id": b"y", "question": b"2?", "answer": b"#### 2"},
                {"id": b"x", "question": b"3?", "answer": b"#### 3"}]
    real = tfds_local.tfds_records
    monkeypatch.setattr(tfds_local, "tfds_records",
                        lambda *a, **k: real(*a, **k, source=examples))
    cfg = load_repo_config("configs/qwen3_gsm8k.py:tiny", data__source="tfds",
                           data__tfds_name="gsm", num_devices=8)
    with pytest.raises(prompts.DataError) as e:
        sources.all_prompt_records(cfg)
    one_line(e.value, "gsm/train[2]: prompt_id 'x' repeats the one at gsm/train[0]")
    examples[2] = {"id": b"\xff", "question": b"3?", "answer": b"#### 3"}
    with pytest.raises(prompts.DataError) as e:
        sources.all_prompt_records(cfg)
    one_line(e.value, "gsm/train[2]: 'id' is not valid UTF-8")


def test_bad_prompt_file_through_main_is_one_error_line(tmp_path):
    """The real entry point: a JSONL file with a bad byte on line 2 stops before any
    compute with exactly one `error:` line naming file:line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps({"question": "2 + 2?", "answer": "#### 4"}).encode()
                    + b'\n{"question": "caf\xe9?", "answer": "#### 1"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.main", "--config=configs/qwen3_gsm8k.py:tiny",
         f"--workdir={tmp_path / 'run'}", f"--config.data.path={bad}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": SUITE_XLA_FLAGS})
    assert out.returncode != 0
    assert out.stderr.splitlines() == [f"error: {bad}:2: not valid UTF-8 (byte 0xe9 at "
                                       "column 18)"], out.stderr
    assert not (tmp_path / "run" / "ledger.jsonl").exists()
