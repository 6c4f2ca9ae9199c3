"""Handed-over files built to hang, exhaust memory or crash the parser: a FIFO, a link
to /dev/zero or out of its directory, JSON nested 100k deep, an integer of thousands
of digits, chat-template calls on big inputs, format widths. Each is refused with one
line naming the file (and line), within a deadline and without a big allocation."""

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
from conftest import REPO, SUITE_XLA_FLAGS

from dora_jax.base import atomic_files, untrusted_files
from dora_jax.data import prompts
from dora_jax.model import hf_config, safetensors_check, safetensors_file
from dora_jax.model.hf_config import CheckpointError
from dora_jax.scheduler import ledger
from dora_jax.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

ASSET_TOKENIZER = REPO / "dora_jax" / "assets" / "tokenizer"
QWEN3_CONFIG = pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3" / "config.json"
DEEP = b"[" * 100_000 + b"]" * 100_000


def refused(fn, error: type, *parts: str, fifo=None, seconds: float = 20) -> str:
    """Runs `fn` in a thread with a deadline; it must raise `error` with one line
    holding every part. A FIFO that `fn` blocks on is opened for writing when the
    deadline passes, so the thread ends."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - checked below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"still running after {seconds} s")
    e = box.get("error")
    assert isinstance(e, error), repr(e)
    text = str(e)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


@pytest.fixture
def tok_dir(tmp_path) -> pathlib.Path:
    d = tmp_path / "tok"
    shutil.copytree(ASSET_TOKENIZER, d)
    return d


@pytest.fixture
def ckpt_dir(tmp_path) -> pathlib.Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(QWEN3_CONFIG, d / "config.json")
    return d


def _replace(path: pathlib.Path, how: str, target=None) -> None:
    """Puts a FIFO, a link or raw bytes where `path` was."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "link":
        os.symlink(target, path)
    else:
        path.write_bytes(target)


# ------------------------------------------------------------------ FIFOs and devices

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "config.json"]


@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_fifo_in_a_tokenizer_directory_is_refused_not_waited_on(tok_dir, name):
    _replace(tok_dir / name, "fifo")
    refused(lambda: Tokenizer.from_pretrained(str(tok_dir)), TokenizerError,
            f"{tok_dir / name}: a FIFO, not a regular file", fifo=tok_dir / name)


def test_fifo_as_config_json_safetensors_and_prompt_file(ckpt_dir, tmp_path):
    _replace(ckpt_dir / "config.json", "fifo")
    refused(lambda: hf_config.read(str(ckpt_dir)), CheckpointError,
            f"{ckpt_dir / 'config.json'}: a FIFO", fifo=ckpt_dir / "config.json")
    weights = ckpt_dir / "model.safetensors"
    _replace(weights, "fifo")
    refused(lambda: safetensors_file.SafetensorsFile(str(weights)), CheckpointError,
            f"{weights}: a FIFO", fifo=weights)
    prompt_file = tmp_path / "train.jsonl"
    _replace(prompt_file, "fifo")
    refused(lambda: prompts.read_jsonl(str(prompt_file)), prompts.DataError,
            f"{prompt_file}: a FIFO", fifo=prompt_file)


def test_link_to_an_endless_device_is_refused_unread(tmp_path):
    """A prompt file (a path handed in alone, so links are allowed) that leads to
    /dev/zero or /dev/urandom: not a regular file, refused before a byte is read."""
    for device in ("/dev/zero", "/dev/urandom"):
        path = tmp_path / "train.jsonl"
        _replace(path, "link", device)
        refused(lambda: prompts.read_jsonl(str(path)), prompts.DataError,
                f"{path}: a character device, not a regular file")
        refused(lambda: atomic_files.read_json_object(str(path)), atomic_files.DamagedFile,
                f"{path}: a character device")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja"])
def test_link_out_of_the_tokenizer_directory_is_refused(tok_dir, tmp_path, name):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    if name == "chat_template.jinja":  # read only when tokenizer_config.json has none
        config = json.loads((tok_dir / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    for target in (outside, "/dev/zero"):
        _replace(tok_dir / name, "link", target)
        refused(lambda: Tokenizer.from_pretrained(str(tok_dir)), TokenizerError,
                f"{tok_dir / name}: a link to {os.path.realpath(target)}, outside {tok_dir}")


def test_link_out_of_the_checkpoint_directory_is_refused(ckpt_dir, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.copy(QWEN3_CONFIG, outside)
    _replace(ckpt_dir / "config.json", "link", outside)
    refused(lambda: hf_config.read(str(ckpt_dir)), CheckpointError,
            f"{ckpt_dir / 'config.json'}: a link to {outside}, outside {ckpt_dir}")


def test_a_file_past_its_cap_is_refused_after_cap_bytes(ckpt_dir):
    """A 256 MiB (sparse) config.json: refused having read and held only the cap."""
    path = ckpt_dir / "config.json"
    with open(path, "wb") as f:
        f.truncate(256 * 2 ** 20)
    tracemalloc.start()
    try:
        refused(lambda: hf_config.read(str(ckpt_dir)), CheckpointError,
                f"{path}: larger than the {untrusted_files.CONFIG_JSON_CAP}-byte limit")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * untrusted_files.CONFIG_JSON_CAP, peak


def test_a_prompt_line_past_its_cap_names_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(untrusted_files, "LINE_CAP", 1000)
    monkeypatch.setattr(untrusted_files.lines, "__kwdefaults__", {
        **untrusted_files.lines.__kwdefaults__, "line_cap": 1000})
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"tokens": [1]}) + "\n" + json.dumps({"tokens": [1] * 999}))
    refused(lambda: prompts.read_jsonl(str(path)), prompts.DataError,
            f"{path}:2: longer than the 1000-byte line limit")


# ------------------------------------------------------------------ JSON that crashes parsers


def _deep_cases(tok_dir, ckpt_dir, tmp_path):
    index = ckpt_dir / "model.safetensors.index.json"
    header = ckpt_dir / "model.safetensors"
    yield (lambda: _replace(tok_dir / "tokenizer.json", "bytes", DEEP),
           lambda: Tokenizer.from_pretrained(str(tok_dir)), TokenizerError,
           tok_dir / "tokenizer.json")
    yield (lambda: (shutil.copy(ASSET_TOKENIZER / "tokenizer.json", tok_dir),
                    _replace(tok_dir / "tokenizer_config.json", "bytes", DEEP)),
           lambda: Tokenizer.from_pretrained(str(tok_dir)), TokenizerError,
           tok_dir / "tokenizer_config.json")
    yield (lambda: _replace(ckpt_dir / "config.json", "bytes", b'{"a": ' + DEEP + b"}"),
           lambda: hf_config.read(str(ckpt_dir)), CheckpointError, ckpt_dir / "config.json")
    yield (lambda: _replace(index, "bytes", DEEP),
           lambda: safetensors_check.read_index(str(index)), CheckpointError, index)
    yield (lambda: _replace(header, "bytes", struct.pack("<Q", len(DEEP)) + DEEP),
           lambda: safetensors_file.SafetensorsFile(str(header)), CheckpointError, header)
    workdir_json = tmp_path / "summary.json"
    yield (lambda: _replace(workdir_json, "bytes", DEEP),
           lambda: atomic_files.read_json_object(str(workdir_json)), atomic_files.DamagedFile,
           workdir_json)
    ledger_file = tmp_path / "ledger.jsonl"
    yield (lambda: _replace(ledger_file, "bytes", b'{"event": "a"}\n' + DEEP + b"\n"),
           lambda: ledger.read(str(ledger_file)), ledger.LedgerError, f"{ledger_file}:2")
    prompt_file = tmp_path / "p.jsonl"
    yield (lambda: _replace(prompt_file, "bytes", b'{"tokens": [1]}\n{"tokens": ' + DEEP
                            + b"}\n"),
           lambda: prompts.read_jsonl(str(prompt_file)), prompts.DataError, f"{prompt_file}:2")


def test_json_nested_100k_deep_is_one_line_everywhere(tok_dir, ckpt_dir, tmp_path):
    cases = list(_deep_cases(tok_dir, ckpt_dir, tmp_path))
    assert len(cases) == 8
    for write, read, error, where in cases:
        write()
        refused(read, error, f"{where}: ", "nests deeper than 128 levels")


def test_nesting_brackets_inside_strings_do_not_count(tmp_path):
    path = tmp_path / "p.jsonl"
    text = '[[{"a": "' + "[" * 10_000 + '\\"{{"}]]'
    path.write_text(json.dumps({"tokens": [1], "x": json.loads(text)}) + "\n")
    assert prompts.read_jsonl(str(path))[0]["x"] == json.loads(text)
    assert untrusted_files.loads(b"[" * 128 + b"]" * 128, "x") is not None


def test_coordinator_state_of_a_checkpoint_is_checked_before_orbax(tmp_path):
    from dora_jax.model.checkpointing import Checkpointer

    state = tmp_path / "ckpts" / "0" / "extra" / "metadata"
    state.parent.mkdir(parents=True)
    with Checkpointer(tmp_path / "ckpts") as checkpointer:
        state.write_bytes(b'{"scheduler": ' + DEEP + b"}")
        refused(lambda: checkpointer.read_extra(0), CheckpointError,
                f"{state}: JSON nests deeper than 128 levels")
        _replace(state, "fifo")
        refused(lambda: checkpointer.read_extra(0), CheckpointError, f"{state}: a FIFO",
                fifo=state)


@pytest.mark.parametrize("digits", [5000, 100_000])
def test_a_token_of_thousands_of_digits_names_file_and_line(tmp_path, digits):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"tokens": [1]}\n{"tokens": [1, ' + b"7" * digits + b"]}\n")
    refused(lambda: prompts.read_jsonl(str(path)), prompts.DataError,
            f"{path}:2: an integer of {digits} digits (more than 64)")


def test_a_token_past_int32_names_file_and_line_without_a_vocabulary(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"tokens": [1]}\n{"tokens": [1, ' + "9" * 30 + "]}\n")
    refused(lambda: prompts.read_jsonl(str(path)), prompts.DataError,
            f"{path}:2: 'tokens'[1] is {'9' * 30}, over 2147483647")


# ------------------------------------------------------------------ chat templates

USER = [{"role": "user", "content": "What is 2 + 3?"}]


def _tokenizer_with(tok_dir, template) -> Tokenizer:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(str(tok_dir))


# Each limit sits well below the time the refused call is predicted to take, and well
# above the time the template takes to build its input on a loaded host.
@pytest.mark.parametrize("template, limit_s, says", [
    ("{% set s = 'ab cd http://x.y ' * 200000 %}{{ s|urlize }}", 2.0, "refused |urlize on"),
    ("{% set s = 'ab cd ' * 600000 %}{{ s|wordwrap(5) }}", 2.0, "refused |wordwrap on"),
    ("{% set s = 'ab ' * 1000000 %}{{ s|title }}", 2.0, "refused |title on"),
    ("{% set l = range(100000)|list %}{{ (l + l + l + l + l)|sort|length }}", 1.5,
     "refused |sort"),
    ("{% set l = range(100000)|list %}{{ (l + l + l + l + l)|unique|list|length }}", 1.5,
     "refused |unique"),
    ("{% set l = range(100000)|list %}{{ (l + l + l)|map('string')|join }}", 1.0,
     "refused |map"),
    ("{% set l = range(100000)|list %}{{ (l + l + l)|batch(3)|list|length }}", 1.0,
     "refused |batch"),
    ("{% set s = 'a\n' * 1900000 %}{{ s|indent(8) }}", 0.3, "refused |indent on"),
    ("{% set s = 'ab ' * 1300000 %}{{ s.split()|length }}", 0.3, "refused split() on"),
])
def test_one_filter_call_on_a_big_input_keeps_the_time_limit(tok_dir, template, limit_s, says):
    tok = _tokenizer_with(tok_dir, template)
    tok.template_time_limit_s = limit_s
    start = time.monotonic()
    refused(lambda: tok.apply_chat_template(USER), ChatTemplateError,
            f"{tok_dir / 'tokenizer_config.json'}: chat template ", says)
    assert time.monotonic() - start < limit_s + 1.2


@pytest.mark.parametrize("template, says", [
    ("{{ '{:>200000000}'.format(1) }}", "refused format(): a format width or precision"),
    ("{{ '{0:0200000000}'.format(5) }}", "refused format(): a format width"),
    ("{{ '{:.200000000f}'.format(1.5) }}", "refused format(): a format width"),
    ("{{ '{:{}}'.format('x', '200000000') }}", "refused format(): a nested format spec"),
    ("{{ '%200000000d' % 1 }}", "refused '%' formatting: a format width"),
    ("{{ '%.200000000f' % 1.5 }}", "refused '%' formatting: a format width"),
    ("{{ '%*s' % (200000000, 'x') }}", "refused '%' formatting with argument 200000000"),
    ("{{ '%200000000s'|format(1) }}", "refused |format: a format width"),
    ("{{ 'x'|center(200000000) }}", "refused |center with argument 200000000"),
    ("{% set s = 'x' * 1000000 %}{{ '%s%s%s%s%s' % (s, s, s, s, s) }}",
     "refused '%' formatting: its output would pass"),
])
def test_format_widths_are_refused_before_allocating(tok_dir, template, says):
    tok = _tokenizer_with(tok_dir, template)
    tracemalloc.start()
    try:
        refused(lambda: tok.apply_chat_template(USER), ChatTemplateError, says)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2 ** 20, peak  # the width asked for would take 200 MB


def test_plain_numbers_and_small_widths_still_format(tok_dir):
    tok = _tokenizer_with(tok_dir, "{{ 'Call 12345678901: %s' % 'x' }}|{{ '{}:{:>4}'.format("
                          "'a', 3) }}|{{ '%-3d|'|format(7) }}")
    assert tok.apply_chat_template(USER, tokenize=False) == "Call 12345678901: x|a:   3|7  |"


# ------------------------------------------------------------------ the entry point


def test_fifo_as_the_prompt_file_through_main_is_one_error_line(tmp_path):
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.main", "--config=configs/qwen3_gsm8k.py:tiny",
         f"--workdir={tmp_path / 'run'}", f"--config.data.path={fifo}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": SUITE_XLA_FLAGS})
    assert out.returncode != 0
    assert out.stderr.splitlines() == [f"error: {fifo}: a FIFO, not a regular file"], out.stderr
