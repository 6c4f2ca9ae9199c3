"""The shipped configs, installed with the package: each module's `get_config(variant)`
returns an `ml_collections.ConfigDict` (see its docstring for the run command and
what to expect). In a clone, `configs/` at the repository root is this directory.

A config is named on the command line by path (`--config=configs/tiny.py`, any file
of your own) or, from any directory, by name (`--config=tiny`, `--config=moe:tiny`);
in Python, `dora_jax.config.load("quickstart")` or `load("configs/quickstart.py")`.
Imports nothing: the modules import dora_jax.config, which resolves names here.
"""

from __future__ import annotations

import ast
import os

DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The shipped configs' names: tiny, quickstart, longtail, moe, ..."""
    return sorted(f[:-3] for f in os.listdir(DIR) if f.endswith(".py") and not f.startswith("_"))


def summary(name: str) -> tuple[str, tuple[str, ...]]:
    """(the first line of config `name`'s docstring, its named variants), read from
    the file's source: listing the configs imports none of them."""
    with open(os.path.join(DIR, name + ".py")) as f:
        tree = ast.parse(f.read())
    doc = (ast.get_docstring(tree) or "").strip().splitlines()
    variants = ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "VARIANTS" for t in node.targets):
            variants = tuple(v for v in ast.literal_eval(node.value) if v)
    return (doc[0] if doc else ""), variants


def listing(indent: str = "  ") -> str:
    """The shipped configs, one line each with its summary (and a line of its
    variants), as a command's help lists them."""
    width = max(len(n) for n in names()) + 2
    lines = []
    for name in names():
        doc, variants = summary(name)
        lines.append(f"{indent}{name:<{width}}{doc}")
        if variants:
            lines.append(f"{indent}{'':<{width}}variants: {', '.join(variants)}")
    return "\n".join(lines)


def resolve(spec: str) -> str:
    """`name[:variant]` of a shipped config as its file's path (`DIR/name.py[:variant]`);
    any other spec (a path to a file) unchanged. A name is a spec without a directory
    or `.py`, so a file path always means the file."""
    path, sep, variant = spec.partition(":")
    if path in names() and not os.path.exists(path):
        return os.path.join(DIR, path + ".py") + sep + variant
    return spec


def unknown(spec: str) -> str | None:
    """Why `spec` names no config (one line), or None when it names a file or a
    shipped config."""
    path = resolve(spec).partition(":")[0]
    if os.path.isfile(path):
        return None
    looks_like_name = os.sep not in path and not path.endswith(".py")
    return (f"--config={spec}: no such " + ("shipped config" if looks_like_name else "file")
            + f" (a path to a config file, or one of: {', '.join(names())})")
