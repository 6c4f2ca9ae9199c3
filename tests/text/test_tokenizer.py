"""Tokenizer over a local Hugging Face tokenizer directory: a locally trained byte-level
BPE tokenizer round-trips through save/load, chat templates render as hand-written
expectations (and as transformers renders them, when it is installed), errors name
what is missing, and the Engine API hands the tokenizer out."""

import dataclasses
import json
import random
import subprocess
import sys

import jinja2
import pytest
from conftest import reference

from dora_jax.text.tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    Tokenizer,
    TokenizerParameters,
    train_tokenizer,
)

VOCAB = 400
SAMPLES = ["What is 17 plus 25? The answer is 42.",
           "  two leading spaces, a tab\tand\n\nblank lines  ",
           "Unicode: héllo wörld, 日本語, emoji 🙂👍🏽, Ωmega ≠ 0.5",
           "digits 0123456789 and -3.14e+10, 1,000,000",
           "The quick brown fox jumps over the lazy dog."]
SYSTEM_USER = [{"role": "system", "content": "You are a calculator."},
               {"role": "user", "content": "What is 2 + 3?"}]

# Laid out over lines and indented as real templates are: the output is right only
# with trim_blocks (the newline after a block tag dropped) and lstrip_blocks (the
# indentation before a block tag dropped).
THINKING_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
    {% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

    {% endif %}
{% endif %}
"""


def _corpus(n=400, seed=0) -> list[str]:
    rng = random.Random(seed)
    names = ["Alice", "Bob", "the farmer", "a student", "Zoë"]
    things = ["apples", "books", "coins", "marbles", "cookies"]
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, val = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
        out.append(f"What is {a} {op} {b}? The answer is {val}.")
        out.append(f"{rng.choice(names)} has {a} {rng.choice(things)} and gives away "
                   f"{b % (a + 1)} of them.")
    return out


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    return train_tokenizer(_corpus(), VOCAB)


@pytest.fixture
def saved(trained, tmp_path):
    trained.save_pretrained(str(tmp_path))
    return tmp_path


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    tok.chat_template = template
    return tok


def test_trained_tokenizer_special_ids_and_round_trip(trained):
    assert trained.vocab_size == VOCAB
    assert [trained.encode(t) for t in ("<|pad|>", "<|endoftext|>", "<|im_start|>",
                                        "<|im_end|>")] == [[0], [1], [2], [3]]
    assert (trained.pad_id, trained.eos_id, trained.bos_id, trained.stop_ids) == (0, 3, None, (3,))
    for text in SAMPLES + _corpus(20, seed=1):
        ids = trained.encode(text)
        assert all(0 <= i < VOCAB for i in ids)
        assert trained.decode(ids) == text
    # Merges were learned: corpus text is much shorter in tokens than in bytes.
    line = _corpus(1, seed=2)[0]
    assert len(trained.encode(line)) < len(line.encode()) / 2
    # Special tokens in text become their ids; decoding drops them unless asked not to.
    ids = trained.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 2 and ids[-1] == 3
    assert trained.decode(ids) == "user\nhi"
    assert trained.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_training_is_deterministic(tmp_path):
    for name in ("a", "b"):
        train_tokenizer(_corpus(), VOCAB).save_pretrained(str(tmp_path / name))
    assert ((tmp_path / "a" / "tokenizer.json").read_bytes()
            == (tmp_path / "b" / "tokenizer.json").read_bytes())


def test_save_and_load_round_trip(trained, saved):
    loaded = Tokenizer.from_pretrained(str(saved))
    for text in SAMPLES:
        assert loaded.encode(text) == trained.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id, loaded.bos_id, loaded.stop_ids) == \
        (VOCAB, 3, 0, None, (3,))
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert loaded.apply_chat_template(SYSTEM_USER) == trained.apply_chat_template(SYSTEM_USER)


def test_stop_ids_from_generation_and_model_config(saved):
    (saved / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    (saved / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    tok = Tokenizer.from_pretrained(str(saved))
    assert tok.eos_id == 3 and tok.stop_ids == (3, 1)
    # The extra stop id survives another save and load.
    tok.save_pretrained(str(saved / "again"))
    assert Tokenizer.from_pretrained(str(saved / "again")).stop_ids == (3, 1)


def test_config_field_forms(saved):
    """Token fields as {"content": ...} dicts, a list of named templates, a BOS token
    added on request, and no pad token (pad falls back to eos)."""
    cfg = json.loads((saved / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    cfg.update(eos_token={"content": "<|im_end|>", "special": True},
               bos_token={"content": "<|endoftext|>"}, add_bos_token=True,
               chat_template=[{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "{{ bos_token }}default"}])
    (saved / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained(str(saved))
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (3, 3, 1)
    assert tok.apply_chat_template([], tokenize=False) == "<|endoftext|>default"
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    # The template writes the BOS itself; tokenizing it must not add a second one,
    # nor one where the template writes none.
    assert tok.apply_chat_template([]) == [1, *tok.encode("default")]
    tok.chat_template = "no bos here"
    assert tok.apply_chat_template([]) == tok.encode("no bos here") != []
    assert tok.apply_chat_template([])[0] != 1


def test_chatml_template_renders_as_written_by_hand(trained):
    with_prompt = ("<|im_start|>system\nYou are a calculator.<|im_end|>\n"
                   "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                   "<|im_start|>assistant\n")
    without = with_prompt.removesuffix("<|im_start|>assistant\n")
    assert trained.apply_chat_template(SYSTEM_USER, tokenize=False) == with_prompt
    assert trained.apply_chat_template(SYSTEM_USER, tokenize=False,
                                       add_generation_prompt=False) == without
    ids = trained.apply_chat_template(SYSTEM_USER)
    assert ids == trained.encode(with_prompt)
    assert ids.count(2) == 3 and ids.count(3) == 2  # turn markers are single tokens


def test_thinking_template_branches_on_kwarg(trained, tmp_path):
    trained.save_pretrained(str(tmp_path))
    tok = _with_template(Tokenizer.from_pretrained(str(tmp_path)), THINKING_TEMPLATE)
    user = [SYSTEM_USER[1]]
    base = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(user, tokenize=False) == base
    assert tok.apply_chat_template(user, tokenize=False, enable_thinking=True) == base
    assert (tok.apply_chat_template(user, tokenize=False, enable_thinking=False)
            == base + "<think>\n\n</think>\n\n")
    assert (tok.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
            == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n")
    assert (tok.apply_chat_template(SYSTEM_USER, tokenize=False, enable_thinking=False)
            == "<|im_start|>system\nYou are a calculator.<|im_end|>\n" + base
            + "<think>\n\n</think>\n\n")


def test_template_tojson_and_raise_exception(trained, tmp_path):
    trained.save_pretrained(str(tmp_path))
    tok = _with_template(Tokenizer.from_pretrained(str(tmp_path)),
                         "{{ tools | tojson }}|{{ tools[0] | tojson(indent=1) }}")
    tools = [{"name": "add", "description": "a < b & ü"}]
    assert tok.apply_chat_template([], tokenize=False, tools=tools) == (
        '[{"name": "add", "description": "a < b & ü"}]|'
        '{\n "name": "add",\n "description": "a < b & ü"\n}')
    _with_template(tok, "{% if messages[0]['role'] != 'user' %}"
                        "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert tok.apply_chat_template([SYSTEM_USER[1]], tokenize=False) == "ok"
    with pytest.raises(jinja2.TemplateError, match="must be from the user"):
        tok.apply_chat_template(SYSTEM_USER)


def test_errors_name_what_is_missing(trained, saved, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        Tokenizer.from_pretrained(str(empty))
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(empty))
    (saved / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(str(saved))
    (saved / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no such|>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<\|no such\|>'"):
        Tokenizer.from_pretrained(str(saved))
    (saved / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    untemplated = Tokenizer.from_pretrained(str(saved))
    assert untemplated.chat_template is None and untemplated.pad_id == 3
    with pytest.raises(ValueError, match="no chat template"):
        untemplated.apply_chat_template(SYSTEM_USER)
    # A template kept in its own file, as newer checkpoints do.
    (saved / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained(str(saved)).apply_chat_template(
        SYSTEM_USER, tokenize=False) == "You are a calculator."


def test_tokenizer_module_imports_no_jax_or_transformers():
    code = ("import sys, dora_jax.text.tokenizer\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'jax', 'jaxlib', 'flax', 'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_transformers_loads_what_we_save_and_agrees(trained, saved):
    transformers = reference("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(saved))
    assert (ref.eos_token_id, ref.pad_token_id) == (trained.eos_id, trained.pad_id)
    for text in SAMPLES + ["<|im_start|>user\nhi<|im_end|>"]:
        assert ref(text)["input_ids"] == trained.encode(text)
    for messages in (SYSTEM_USER, SYSTEM_USER[1:]):
        assert (ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == trained.apply_chat_template(messages, tokenize=False))
    # A multi-line template and a template variable, rendered by both.
    ours = _with_template(Tokenizer.from_pretrained(str(saved)), THINKING_TEMPLATE)
    ours.save_pretrained(str(saved / "thinking"))
    ref = transformers.AutoTokenizer.from_pretrained(str(saved / "thinking"))
    for flag in (True, False):
        assert (ref.apply_chat_template(SYSTEM_USER, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=flag)
                == ours.apply_chat_template(SYSTEM_USER, tokenize=False, enable_thinking=flag))


def test_engine_hands_out_its_tokenizer(trained, saved):
    import _rollout_common as rc

    from dora_jax.rollout import Engine

    cfg = rc.config("dense")
    mesh = rc.meshes()[1][0]
    rollout = dataclasses.replace(cfg.rollout, eos_id=trained.eos_id)
    engine = Engine(cfg.model, rollout, mesh, tokenizer_path=str(saved))
    params = engine.get_tokenizer()
    assert params == TokenizerParameters(str(saved), stop_ids=trained.stop_ids)
    assert engine.stop_ids == trained.stop_ids
    tok = engine.build_tokenizer(params)  # JetStream's protocol: padded ids, true length
    for text in SAMPLES:
        ids = trained.encode(text)[-engine.max_prefill_length:]
        padded, n = tok.encode(text)
        assert n == len(ids) and list(padded[:n]) == ids and len(padded) in engine.buckets
        assert tok.tokenizer.encode(text) == trained.encode(text)
    assert tok.stop_ids == trained.stop_ids and tok.stop_tokens == set(trained.stop_ids)
    with pytest.raises(ValueError, match="tokenizer_path"):
        Engine(cfg.model, cfg.rollout, mesh).get_tokenizer()
