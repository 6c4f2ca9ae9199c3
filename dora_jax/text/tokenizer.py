"""Tokenizer of a local Hugging Face tokenizer directory, on the `tokenizers` library.

A checkpoint's directory holds `tokenizer.json` (the fast tokenizer: vocabulary,
merges, pre-tokenizer, added tokens) and usually `tokenizer_config.json` (special
token names and the Jinja chat template). `Tokenizer.from_pretrained` reads both, plus
the stop ids of `generation_config.json` / `config.json`, so prompts are rendered with
the checkpoint's own chat template and decoding stops where the checkpoint stops.

The chat template is rendered as the Hugging Face tooling renders it (sandboxed Jinja,
`trim_blocks` and `lstrip_blocks`, a `tojson` filter that keeps non-ASCII text, a
`raise_exception` global), so the same conversation gives the same prompt ids as it
would in the checkpoint's reference stack. The template is someone else's program:
it renders under a time and a size limit (template_sandbox), and every way it can
fail is one ChatTemplateError line naming its file.

Every file read is checked (JSON objects, field types, ids in the vocabulary); a bad
one raises a TokenizerError (a ValueError) of one line naming the file and field.

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
from typing import Any, Literal, overload

import jinja2
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dora_jax.base import untrusted_files
from dora_jax.text import template_sandbox

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
_TEMPLATE_FILE = "chat_template.jinja"
_STOP_ID_FILES = ("generation_config.json", "config.json")


class TokenizerError(ValueError):
    """A tokenizer file is unreadable or malformed; one line naming the file."""


class ChatTemplateError(TokenizerError, jinja2.exceptions.TemplateError):
    """A chat template failed to compile or render, or passed its time or size
    limit; one line naming the template's file. A jinja2.TemplateError too, as the
    template's own `raise_exception` always was."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
    """What the Engine API hands out for building a tokenizer: JetStream's
    TokenizerParameters as far as a local Hugging Face directory needs them, plus the
    stop ids the engine decodes with.

    path: the tokenizer's directory. extra_ids: sentinel ids beyond the vocabulary
    (a SentencePiece notion; 0 here). stop_ids: token ids that end a sequence (the
    tokenizer built from these parameters stops on them too).
    """
    path: str
    extra_ids: int = 0
    stop_ids: tuple = ()


def _read_text(path: str, directory: str, cap: int = untrusted_files.CONFIG_JSON_CAP) -> str:
    """A file of the tokenizer directory, checked to be a regular file inside it and
    at most `cap` bytes (untrusted_files)."""
    try:
        return untrusted_files.read_text(path, cap, within=directory, error=TokenizerError)
    except FileNotFoundError:
        raise TokenizerError(f"cannot read {path}: no such file") from None


def _read_json(path: str, directory: str) -> dict:
    text = _read_text(path, directory)
    value = untrusted_files.loads(text, path, error=TokenizerError)
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value, field: str, path: str) -> str | None:
    """A special-token field is a string, a {"content": ...} dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {field} must be a string or a {{'content': ...}} dict, "
                         f"got {_one_line(repr(value))[:80]}")


def _pick_template(value, path: str) -> str | None:
    """A chat template is one string, or a list of named ones of which "default" is
    the conversation template (the others serve tool use or retrieval)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(f"{path}: chat_template must be a string or a list of "
                         "{name, template} with a 'default' entry")


def _bool_field(cfg: dict, field: str, path: str) -> bool:
    # Only a JSON bool: the string "false" is true to Python.
    value = cfg.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TokenizerError(f"{path}: {field} must be true or false, got "
                             f"{_one_line(repr(value))[:80]}")
    return value


def _eos_ids_of(path: str, directory: str, vocab_size: int) -> list[int]:
    """eos_token_id of a generation/model config: an int, a list of ints, or absent;
    each an id of the vocabulary."""
    value = _read_json(path, directory).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got "
                             f"{_one_line(repr(value))[:80]}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"{path}: eos_token_id {bad[0]} is not in the tokenizer's "
                             f"vocabulary of {vocab_size}")
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
    """The template in a guarded sandbox (template_sandbox.GuardedEnvironment)."""
    env = template_sandbox.GuardedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids and chat-template rendering for one checkpoint.

    Attributes: vocab_size (with added tokens), eos_id, pad_id (eos_id when the
    checkpoint has no pad token), bos_id (or None), stop_ids (eos_id first, then the
    checkpoint's other end-of-sequence ids), chat_template (or None; its errors name
    the file it was read from), and the limits a render runs under:
    template_time_limit_s, template_max_chars.
    """

    template_time_limit_s = template_sandbox.TIME_LIMIT_S
    template_max_chars = template_sandbox.MAX_CHARS

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token: str,
                 pad_token: str | None = None, bos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None,
                 extra_stop_ids: Iterable[int] = (), chat_template_file: str | None = None):
        self._backend = backend
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.add_bos_token = bool(add_bos_token)
        self.chat_template = chat_template
        # The file is named only while the template is the one read from it.
        self._template_origin = (chat_template, chat_template_file)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._id_of(eos_token, "eos_token")
        self.pad_id = self.eos_id if pad_token is None else self._id_of(pad_token, "pad_token")
        self.bos_id = None if bos_token is None else self._id_of(bos_token, "bos_token")
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source, template)

    def __getstate__(self) -> dict:
        # Reward workers get the tokenizer pickled; the compiled template (with its
        # sandbox's per-thread deadline) is rebuilt on first use there.
        return {**self.__dict__, "_compiled": None}

    def _id_of(self, token: str, field: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{field} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Loads the tokenizer of a local checkpoint directory: tokenizer.json,
        tokenizer_config.json (special tokens, chat template; optional), and the
        eos_token_id of generation_config.json / config.json as extra stop ids."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer directory {path} does not exist")
        tok_file = os.path.join(path, _TOKENIZER_FILE)
        if not os.path.lexists(tok_file):
            raise TokenizerError(f"{tok_file} not found: the directory has no fast tokenizer")
        # Read here (regular file, inside the directory, capped), not by the Rust
        # side's from_file, which would block on a FIFO or read /dev/zero forever.
        try:
            tok_bytes = untrusted_files.read_bytes(
                tok_file, untrusted_files.TOKENIZER_JSON_CAP, within=path, error=TokenizerError)
        except FileNotFoundError:
            raise TokenizerError(f"cannot read {tok_file}: no such file") from None
        untrusted_files.check_depth(tok_bytes, tok_file, error=TokenizerError)
        try:
            backend = tokenizers.Tokenizer.from_str(
                untrusted_files.decode(tok_bytes, tok_file, TokenizerError))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"cannot read {tok_file}: {_one_line(e)}") from None
        cfg_file = os.path.join(path, _CONFIG_FILE)
        # lexists, not isfile: a FIFO or device under a known name is refused, not skipped.
        cfg = _read_json(cfg_file, path) if os.path.lexists(cfg_file) else {}
        token = {f: _token_text(cfg.get(f), f, cfg_file)
                 for f in ("eos_token", "pad_token", "bos_token")}
        template = _pick_template(cfg.get("chat_template"), cfg_file)
        source_file = cfg_file if template is not None else None
        template_file = os.path.join(path, _TEMPLATE_FILE)
        if template is None and os.path.lexists(template_file):
            # Newer checkpoints keep the template in its own file.
            template, source_file = _read_text(template_file, path), template_file
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        stop_ids = [i for name in _STOP_ID_FILES
                    if os.path.lexists(os.path.join(path, name))
                    for i in _eos_ids_of(os.path.join(path, name), path, vocab_size)]
        eos_token = token["eos_token"]
        if eos_token is None:
            if not stop_ids:
                raise TokenizerError(f"{path}: no eos_token in {_CONFIG_FILE} and no "
                                     f"eos_token_id in {' or '.join(_STOP_ID_FILES)}")
            eos_token = backend.id_to_token(stop_ids[0])
            assert eos_token is not None  # the stop ids were checked against the vocabulary
        try:
            return cls(backend, eos_token=eos_token, pad_token=token["pad_token"],
                       bos_token=token["bos_token"],
                       add_bos_token=_bool_field(cfg, "add_bos_token", cfg_file),
                       chat_template=template, extra_stop_ids=stop_ids,
                       chat_template_file=source_file)
        except TokenizerError as e:
            raise TokenizerError(f"{cfg_file}: {e}") from None

    @classmethod
    def from_parameters(cls, params: TokenizerParameters) -> Tokenizer:
        """The tokenizer of `params.path`, stopping on its own stop ids and on
        `params.stop_ids`."""
        tok = cls.from_pretrained(params.path)
        tok.stop_ids = tuple(dict.fromkeys([*tok.stop_ids, *params.stop_ids]))
        return tok

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
            gen = _read_json(gen_file, path) if os.path.isfile(gen_file) else {}
            gen["eos_token_id"] = list(self.stop_ids)
            with open(gen_file, "w", encoding="utf-8") as f:
                json.dump(gen, f, indent=2)

    @property
    def special_tokens(self) -> tuple:
        """The texts of the added special tokens (turn markers, EOS, ...)."""
        return tuple(t.content for t in self._backend.get_added_tokens_decoder().values()
                     if t.special)

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

    @overload
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = ...,
                            tokenize: Literal[True] = ..., **template_kwargs: Any
                            ) -> list[int]: ...

    @overload
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = ...,
                            tokenize: Literal[False], **template_kwargs: Any) -> str: ...

    @overload
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = ...,
                            tokenize: bool, **template_kwargs: Any) -> list[int] | str: ...

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, **template_kwargs: Any) -> list[int] | str:
        """Renders `messages` ({"role", "content"} dicts) with the chat template.
        Extra keyword arguments are template variables (e.g. `enable_thinking`).
        Returns the token ids (the template writes the special tokens, none are
        added) or, with `tokenize=False`, the text."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (none in "
                                 f"{_CONFIG_FILE} or {_TEMPLATE_FILE})")
        origin, origin_file = self._template_origin
        where = (origin_file if origin_file and origin == self.chat_template
                 else "chat_template")
        try:
            # Compiled once per source: `chat_template` may be reassigned.
            if self._compiled is None or self._compiled[0] != self.chat_template:
                self._compiled = (self.chat_template, _compile_template(self.chat_template))
            template = self._compiled[1]
            env = template.environment
            assert isinstance(env, template_sandbox.GuardedEnvironment)  # _compile_template's
            text = env.render(
                template, time_limit_s=self.template_time_limit_s,
                max_chars=self.template_max_chars, messages=list(messages),
                add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token, pad_token=self.pad_token or "", **template_kwargs)
        except template_sandbox.TemplateLimit as e:
            raise ChatTemplateError(f"{where}: chat template {e}") from None
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: chat template line {e.lineno}: "
                                    f"{_one_line(e.message)}") from None
        except Exception as e:  # anything the template's code raises is the template's fault
            detail = _one_line(e) or type(e).__name__
            if not isinstance(e, jinja2.TemplateError):
                detail = f"{type(e).__name__}: {detail}"
            raise ChatTemplateError(f"{where}: chat template failed: {detail[:300]}") from None
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
