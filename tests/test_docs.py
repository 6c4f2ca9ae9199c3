"""The commands in README.md and docs/ stay true: every `python -m dora_jax.X` names a
module that exists, every `--flag` of it is a flag that module defines, every
`--config=` names a config file and a variant its get_config accepts, every
`--config.a.b` override names a field of that config, and the README's install-and-test
command is the one .ci/run runs."""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INDENTED = re.compile(r"(?:^(?: {4}|\t).*\n?)+", re.M)
_INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*?)`")
_COMMAND = re.compile(r"python -m (dora_jax(?:\.\w+)*)")
# Where a shell command ends: a pipe, a redirection, a chain, a comment.
_END = re.compile(r"\s(?:&&|\|\|?|>|;|#)\s|\s#|$")


def _snippets(text: str) -> list[str]:
    """Code blocks (fenced or indented) with their line continuations joined, one
    entry per line, then the inline code spans of the prose around them."""
    lines = []
    prose = _FENCE.sub("", text)
    blocks = _FENCE.findall(text) + [b for b in _INDENTED.findall(prose)]
    for block in blocks:
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    prose = _INDENTED.sub("", prose)
    return lines + [" ".join(span.split()) for span in _INLINE.findall(prose)]


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, its arguments) for every `python -m dora_jax...` in a page."""
    out = []
    for line in _snippets(text):
        for match in _COMMAND.finditer(line):
            rest = line[match.end():]
            rest = rest[:_END.search(rest).start()]
            out.append((match.group(1), shlex.split(rest.replace("[", " ").replace("]", " "))))
    return out


def _documented():
    return [(page.relative_to(REPO).as_posix(), module, args)
            for page in PAGES for module, args in commands(page.read_text())]


# Entry points define their flags under `if __name__ == "__main__":`, so the probe runs
# the module as __main__ with app.run (or argparse's parse_args) replaced by a dump.
_PROBE = """
import argparse, json, runpy, sys
import absl.app
from absl import flags

def dump(names, bools, config=None):
    print(json.dumps({"flags": sorted(names), "bools": sorted(bools), "config": config}))
    raise SystemExit(0)

def absl_run(*args, **kwargs):
    F = flags.FLAGS
    config = F["config"].default_as_str.strip("'\\"") if "config" in F else None
    dump(list(F), [n for n in F if F[n].boolean], None if config in ("", "None") else config)

def argparse_args(parser, *args, **kwargs):
    names = [o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")]
    dump(names, [])

absl.app.run = absl_run
argparse.ArgumentParser.parse_args = argparse_args
runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
"""


@functools.cache
def module_flags(module: str) -> dict:
    """The flags `module` defines when run (in a fresh interpreter each: two entry
    points define the same flags), the booleans among them and --config's default."""
    run = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True,
                         text=True, cwd=REPO, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@functools.cache
def load_config(spec: str):
    """The config `--config=spec` names (a path or a shipped name), as the entry points
    load it; ValueError naming a variant its module does not list."""
    from dora_jax import config, configs

    path, _, variant = configs.resolve(spec).partition(":")
    cfg = config.load(spec)
    module_spec = importlib.util.spec_from_file_location("_doc_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if (variant or None) not in getattr(module, "VARIANTS", (variant or None,)):
        raise ValueError(f"{spec}: variant {variant!r} not in {module.VARIANTS}")
    return cfg


def has_field(cfg, dotted: str) -> bool:
    node = cfg
    for key in dotted.split("."):
        try:
            node = node[key]
        except (KeyError, TypeError, AttributeError):
            return False
    return True


def check_command(module: str, args: list[str]) -> list[str]:
    """What is wrong with one documented command: [] when it is true."""
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        return [f"no module {module}"]
    if module == "dora_jax.launch.local" and "--" in args:  # the rest is main's
        at = args.index("--")
        return check_command(module, args[:at]) + check_command("dora_jax.main", args[at + 1:])
    known = module_flags(module)
    problems, config_spec, overrides = [], known["config"], []
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            continue
        name, _, value = arg[2:].partition("=")
        if name.startswith("config."):
            overrides.append(name[len("config."):])
        elif name == "config":
            config_spec = value
        elif name not in known["flags"] and not (
                name.startswith("no") and name[2:] in known["bools"]):
            problems.append(f"{module} defines no flag --{name}")
    if config_spec and not re.fullmatch(r"[A-Z_]+|.*(?:\.\.\.|<).*", config_spec):
        try:
            cfg = load_config(config_spec)
        except Exception as e:  # noqa: BLE001 - the doc names it; say why it fails
            return problems + [f"--config={config_spec}: {type(e).__name__}: {e}"]
        problems += [f"--config={config_spec} has no field {o}" for o in overrides
                     if not has_field(cfg, o)]
    elif overrides:
        problems.append(f"{module}: overrides {overrides} without a config")
    return problems


def test_the_pages_document_commands():
    """The extraction finds the commands it is meant to check (an empty list would
    make every other test here pass without checking anything)."""
    found = {module for _, module, _ in _documented()}
    assert {"dora_jax.main", "dora_jax.sft", "dora_jax.sim", "dora_jax.bench.modes"} <= found
    assert (REPO / "mkdocs.yml").exists() and DOCS


@pytest.mark.parametrize("page,module,args", _documented(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_documented_command_is_true(page, module, args):
    assert check_command(module, args) == [], page


def test_a_missing_flag_or_config_field_is_caught():
    assert check_command("dora_jax.main", ["--config=configs/tiny.py", "--workdir=/tmp/x"]) == []
    assert check_command("dora_jax.main", ["--config=tiny", "--no_such_flag=1"]) == [
        "dora_jax.main defines no flag --no_such_flag"]
    assert check_command("dora_jax.main", ["--config=moe:tiny", "--config.trainer.nope=1"]) == [
        "--config=moe:tiny has no field trainer.nope"]
    assert check_command("dora_jax.nope", []) == ["no module dora_jax.nope"]
    assert check_command("dora_jax.nope.sub", []) == ["no module dora_jax.nope.sub"]
    assert "variant" in check_command("dora_jax.main", ["--config=configs/moe.py:huge"])[0]
    assert "missing.py" in check_command("dora_jax.sft", ["--config=configs/missing.py"])[0]


def test_commands_are_found_in_code_blocks_and_inline():
    text = ("Run `python -m dora_jax.export ... --format=peft\n--out=DIR`.\n\n"
            "```bash\nXLA_FLAGS=x python -m dora_jax.sim --preset=paper64 \\\n"
            "  --explain   # every mode\n```\n\n    python -m dora_jax.sft --steps=3\n")
    assert commands(text) == [("dora_jax.sim", ["--preset=paper64", "--explain"]),
                              ("dora_jax.sft", ["--steps=3"]),
                              ("dora_jax.export", ["...", "--format=peft", "--out=DIR"])]


def test_prose_overrides_name_config_fields():
    """`--config.a.b=...` mentioned outside a command names a field of the base config."""
    from dora_jax import config

    base = config.base()
    missing = {(page.name, field) for page in PAGES
               for field in re.findall(r"--config\.([\w.]*\w)", page.read_text())
               if not has_field(base, field)}
    assert not missing


def _ci_line(prefix: str) -> list[str]:
    lines = [ln.strip() for ln in (REPO / ".ci/run").read_text().splitlines()
             if ln.strip().startswith(prefix)]
    assert lines, prefix
    return shlex.split(lines[0])


def test_readme_test_command_is_what_ci_runs():
    """The README's install-and-test line: the same package extras as .ci/run's first
    install and the same pytest arguments (CI adds only -q to pip and --durations)."""
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in _snippets(readme) if "pytest" in ln and "pip install" in ln)
    install, test = (shlex.split(part) for part in line.split("&&"))
    ci_install = [a for a in _ci_line("python -m pip install -q -e") if a != "-q"]
    assert install[install.index("install"):] == ci_install[ci_install.index("install"):]
    ci_test = [a for a in _ci_line("python -m pytest") if not a.startswith("--durations")]
    assert test == ci_test


def test_layout_names_every_module():
    """docs/layout.md's entry for each subpackage names each of its modules."""
    layout = (REPO / "docs" / "layout.md").read_text().split("```")[1]
    entries = dict(re.findall(r"^  (\w+)/\s+(.*?)(?=^  \S|^\S|\Z)", layout, re.M | re.S))
    unnamed = {f"{package}/{module.stem}" for package in entries
               for module in (REPO / "dora_jax" / package).glob("*.py")
               if not module.stem.startswith("_")
               and not re.search(rf"\b{module.stem}\b", entries[package])}
    assert len(entries) > 10 and not unnamed


def _anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors mkdocs gives a page (its toc extension's slugs)."""
    headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}


def test_readme_links_resolve():
    """The README's links into docs/ (mkdocs checks the links between the pages)."""
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text())
    local = [link.partition("#") for link in links if "://" not in link]
    broken = [path + sep + anchor for path, sep, anchor in local if not (REPO / path).is_file()
              or anchor and anchor not in _anchors(REPO / path)]
    assert local and not broken
