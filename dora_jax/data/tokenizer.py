"""Tokenizer of a local Hugging Face tokenizer directory, on the `tokenizers` library.

A checkpoint's directory holds `tokenizer.json` (the fast tokenizer: vocabulary,
merges, pre-tokenizer, added tokens) and usually `tokenizer_config.json` (special
token names and the Jinja chat template). `Tokenizer.from_pretrained` reads both, plus
the stop ids of `generation_config.json` / `config.json`, so prompts are rendered with
the checkpoint's own chat template and decoding stops where the checkpoint stops.

The chat template is rendered as the Hugging Face tooling renders it (sandboxed Jinja,
`trim_blocks` and `lstrip_blocks`, a `tojson` filter that keeps non-ASCII text, a
`raise_exception` global), so the same conversation gives the same prompt ids as it
would in the checkpoint's reference stack.

`train_tokenizer` builds a small byte-level BPE tokenizer with a ChatML template, for
tests and synthetic tasks that need a real tokenizer but no download.

Imports no JAX: data preparation runs on hosts without an accelerator stack.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
_TEMPLATE_FILE = "chat_template.jinja"
_STOP_ID_FILES = ("generation_config.json", "config.json")


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
    """What the Engine API hands out for building a tokenizer: its directory."""
    path: str


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value, field: str, path: str) -> str | None:
    """A special-token field is a string, a {"content": ...} dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {field} must be a string or a {{'content': ...}} dict, "
                     f"got {value!r}")


def _pick_template(value, path: str) -> str | None:
    """A chat template is one string, or a list of named ones of which "default" is
    the conversation template (the others serve tool use or retrieval)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{path}: chat_template must be a string or a list of "
                     "{name, template} with a 'default' entry")


def _eos_ids_of(path: str) -> list[int]:
    """eos_token_id of a generation/model config: an int, a list of ints, or absent."""
    value = _read_json(path).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return ids


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and quotes for HTML; prompts need the JSON as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids and chat-template rendering for one checkpoint.

    Attributes: vocab_size (with added tokens), eos_id, pad_id (eos_id when the
    checkpoint has no pad token), bos_id (or None), stop_ids (eos_id first, then the
    checkpoint's other end-of-sequence ids), chat_template (or None).
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token: str,
                 pad_token: str | None = None, bos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None,
                 extra_stop_ids: Iterable[int] = ()):
        self._backend = backend
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._id_of(eos_token, "eos_token")
        self.pad_id = self.eos_id if pad_token is None else self._id_of(pad_token, "pad_token")
        self.bos_id = None if bos_token is None else self._id_of(bos_token, "bos_token")
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source, template)

    def _id_of(self, token: str, field: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Loads the tokenizer of a local checkpoint directory: tokenizer.json,
        tokenizer_config.json (special tokens, chat template; optional), and the
        eos_token_id of generation_config.json / config.json as extra stop ids."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer directory {path} does not exist")
        tok_file = os.path.join(path, _TOKENIZER_FILE)
        if not os.path.isfile(tok_file):
            raise ValueError(f"{tok_file} not found: the directory has no fast tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # the Rust side raises plain Exceptions
            raise ValueError(f"cannot read {tok_file}: {e}") from e
        cfg_file = os.path.join(path, _CONFIG_FILE)
        cfg = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
        token = {f: _token_text(cfg.get(f), f, cfg_file)
                 for f in ("eos_token", "pad_token", "bos_token")}
        template = _pick_template(cfg.get("chat_template"), cfg_file)
        template_file = os.path.join(path, _TEMPLATE_FILE)
        if template is None and os.path.isfile(template_file):
            # Newer checkpoints keep the template in its own file.
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        stop_ids = [i for name in _STOP_ID_FILES
                    if os.path.isfile(os.path.join(path, name))
                    for i in _eos_ids_of(os.path.join(path, name))]
        eos_token = token["eos_token"]
        if eos_token is None:
            if not stop_ids:
                raise ValueError(f"{path}: no eos_token in {_CONFIG_FILE} and no "
                                 f"eos_token_id in {' or '.join(_STOP_ID_FILES)}")
            eos_token = backend.id_to_token(stop_ids[0])
        try:
            return cls(backend, eos_token=eos_token, pad_token=token["pad_token"],
                       bos_token=token["bos_token"],
                       add_bos_token=cfg.get("add_bos_token", False),
                       chat_template=template, extra_stop_ids=stop_ids)
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {e}") from e

    def save_pretrained(self, path: str) -> None:
        """Writes tokenizer.json and tokenizer_config.json (loadable by
        `from_pretrained` and by transformers' AutoTokenizer); stop ids beyond eos_id
        go to generation_config.json, merged into one already there."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._backend.save(os.path.join(path, _TOKENIZER_FILE))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "pad_token": self.pad_token, "bos_token": self.bos_token,
               "add_bos_token": self.add_bos_token, "chat_template": self.chat_template,
               "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
        with open(os.path.join(path, _CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2,
                      ensure_ascii=False)
        if len(self.stop_ids) > 1:
            gen_file = os.path.join(path, _STOP_ID_FILES[0])
            gen = _read_json(gen_file) if os.path.isfile(gen_file) else {}
            gen["eos_token_id"] = list(self.stop_ids)
            with open(gen_file, "w", encoding="utf-8") as f:
                json.dump(gen, f, indent=2)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. a rendered
        chat template's turn markers) map to their ids; `add_special_tokens` adds
        the checkpoint's BOS / post-processor tokens."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_id is not None
                and ids[:1] != [self.bos_id]):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any iterable of ints, e.g. a numpy row)."""
        return self._backend.decode([int(i) for i in ids],
                                    skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, **template_kwargs) -> list[int] | str:
        """Renders `messages` ({"role", "content"} dicts) with the chat template.
        Extra keyword arguments are template variables (e.g. `enable_thinking`).
        Returns the token ids (the template writes the special tokens, none are
        added) or, with `tokenize=False`, the text."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in "
                             f"{_CONFIG_FILE} or {_TEMPLATE_FILE})")
        # Compiled once per source: `chat_template` may be reassigned.
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _compile_template(self.chat_template))
        text = self._compiled[1].render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token,
            pad_token=self.pad_token or "", **template_kwargs)
        return self.encode(text) if tokenize else text


def train_tokenizer(texts: Iterable[str], vocab_size: int, *,
                    chat_template: str = DEFAULT_CHAT_TEMPLATE,
                    special_tokens: Sequence[str] = ("<|pad|>", "<|endoftext|>",
                                                     "<|im_start|>", "<|im_end|>")) -> Tokenizer:
    """Trains a byte-level BPE tokenizer on `texts` (deterministic for the same
    texts). Every byte is in the base alphabet, so any text round-trips through
    encode/decode. Special tokens take ids 0.. in the given order; pad is "<|pad|>"
    and eos is "<|im_end|>", the end of a chat turn, as in ChatML chat models."""
    special_tokens = list(special_tokens)
    for required in ("<|pad|>", "<|im_end|>"):
        if required not in special_tokens:
            raise ValueError(f"special_tokens must include {required!r}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    backend.train_from_iterator(list(texts), trainer=trainer)
    return Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                     chat_template=chat_template)
