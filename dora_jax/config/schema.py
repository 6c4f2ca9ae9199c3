"""Frozen-dataclass config sections that validate themselves: each field declares its
constraint (`field(default, min=..., choices=...)`), `Section.__post_init__` checks
them, `Section.from_dict` builds a section tree from plain values (unknown fields
rejected by name), `schema` turns a section class back into a ConfigDict of its
fields. Errors are `ConfigError`s that name the field. No JAX, nothing else from
dora_jax (the config package builds the run's sections on it)."""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, NoReturn

import ml_collections


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


def fail(field: str, message: str) -> NoReturn:
    raise ConfigError(f"config.{field}: {message}")


def field(default=dataclasses.MISSING, **constraint):
    """A field with its constraint, checked by `Section.__post_init__`: `min=n` (an
    integer >= n), `ge`, `gt`, `le`, `lt`, `choices`, `ascending=True`; None: optional."""
    return dataclasses.field(default=default, metadata=constraint)


_BOUNDS = {"min": (operator.ge, ">="), "ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
           "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def check(field: str, value, choices=None, ascending=False, **bounds):
    if "min" in bounds and (not isinstance(value, int) or isinstance(value, bool)):
        fail(field, f"must be an integer, got {value!r}")
    for name, bound in bounds.items():
        op, sign = _BOUNDS[name]
        if not op(value, bound):
            fail(field, f"must be {sign} {bound}, got {value}")
    if choices is not None and value not in choices:
        fail(field, f"must be one of {choices}, got {value!r}")
    if ascending and (not value or list(value) != sorted(value)):
        fail(field, f"must be a non-empty ascending list, got {value}")


class Section:
    """A config section: `PATH` is its place in the ConfigDict ('model.moe')."""

    PATH: ClassVar[str] = ""
    if typing.TYPE_CHECKING:  # every section is a dataclass
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def _f(self, name: str) -> str:
        return f"{self.PATH}.{name}" if self.PATH else name

    def __post_init__(self):
        """Checks every field's declared constraint (`field`); sections add their
        own rules after calling this."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata and not (value is None and f.default is None):
                check(self._f(f.name), value, **f.metadata)

    @classmethod
    def from_dict(cls, values: Mapping | None):
        """Builds the section from plain values: unknown fields are rejected by name,
        missing required ones too, lists become tuples, nested sections recurse."""
        values = dict(values or {})
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            fail(cls.PATH or unknown[0], f"unknown field(s) {unknown}; known: {sorted(names)}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            sub, value = section_type(hints[f.name]), values.get(f.name)
            if sub is not None:
                kwargs[f.name] = sub.from_dict(value)
            elif value is None and required(f):
                fail(f"{cls.PATH}.{f.name}" if cls.PATH else f.name, "must be set")
            elif f.name in values:
                kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)


def required(f) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def section_type(hint):  # a nested section's class, or None
    return hint if isinstance(hint, type) and issubclass(hint, Section) else None


def schema(cls) -> ml_collections.ConfigDict:
    """A ConfigDict with every field of `cls`: defaults, or typed placeholders for
    required and None-default fields (so `--config.trainer.dual_clip=3` parses)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        sub = section_type(hints[f.name])
        if sub is not None:
            out[f.name] = schema(sub)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = ml_collections.ConfigDict(f.default_factory())
        elif f.default is dataclasses.MISSING or f.default is None:
            kind = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            out[f.name] = ml_collections.config_dict.placeholder(kind[0] if kind else hints[f.name])
        else:
            out[f.name] = f.default
    return ml_collections.ConfigDict(out)
