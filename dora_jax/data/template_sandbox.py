"""A Jinja sandbox for chat templates that bounds their time and memory.

A chat template comes with someone else's checkpoint and is a program: Jinja's own
sandbox stops it reaching Python internals, but not `{{ 9**(9**9) }}` (minutes of
CPU) or `{{ 'a'*10**9 }}` (a gigabyte). `GuardedEnvironment` renders under a
deadline and a size cap: every operator, call, attribute, item, filter and loop
iteration first checks the deadline; operations that can build something huge in
one step (powers, repetition, concatenation, joins, padding, format widths) are
refused when the result would pass the cap, before it is built; and `render`
counts the output as it is generated. A refusal raises `TemplateLimit`.

Real chat templates (Qwen3's is ~4 KB with loops over messages and tools) render
in milliseconds, so the limits only ever stop a runaway or hostile template.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

TIME_LIMIT_S = 5.0
# Characters in the output, and characters + items in any value a template builds.
# A prompt this long is refused by any max_prefill_length anyway.
MAX_CHARS = 4_000_000
MAX_INT_BITS = 100_000  # ~30,000 digits; Python refuses to print longer ints anyway
MAX_SOURCE_CHARS = 1_000_000  # of the template itself
_ITER_CHECK_EVERY = 1024  # loop iterations between deadline checks
_DIGITS = re.compile(r"\d+")


class TemplateLimit(Exception):
    """A template passed the time limit or would build something past the size cap."""


def _weight(value, limit: int = MAX_CHARS) -> int:
    """Characters plus items in `value`, counting into nested containers; stops
    counting once past `limit` (so it costs at most ~limit steps)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        x = stack.pop()
        if isinstance(x, (str, bytes)):
            total += len(x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += len(x)
            if total <= limit:
                stack.extend(x)
        elif isinstance(x, dict):
            total += len(x)
            if total <= limit:
                stack.extend(x.keys())
                stack.extend(x.values())
        elif isinstance(x, int) and not isinstance(x, bool):
            total += x.bit_length() // 3 + 1
        else:
            total += 1
    return total


def _sized(value, what: str):
    if _weight(value) > MAX_CHARS:
        raise TemplateLimit(f"refused {what}: it would pass {MAX_CHARS} chars")
    return value


def _sized_output(value):
    return _sized(value, "an output value")


def _check_ints(args, what: str) -> None:
    # A width, count or length argument this large only ever builds a huge result
    # (str.center, |indent, |truncate, lipsum...): refused before the call.
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise TemplateLimit(f"refused {what} with argument {a}: over {MAX_CHARS}")


def _check_format(fmt, what: str) -> None:
    # A width or precision in a format string ("%1000000000d", "{:>1000000000}")
    # builds that many characters in one C call.
    if isinstance(fmt, str) and any(len(d) > 7 or int(d) > MAX_CHARS
                                    for d in _DIGITS.findall(fmt)):
        raise TemplateLimit(f"refused {what}: a format width or precision over {MAX_CHARS}")


def _projected_replace(s, old, new, count=-1) -> int:
    if not all(isinstance(x, str) for x in (s, old, new)):
        return 0
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _projected_join(sep, items) -> int:
    if not isinstance(items, (list, tuple)):
        return 0  # a lazy iterable: its items are checked as they are built
    return _weight(list(items)) + len(items) * len(str(sep))


class GuardedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox plus a deadline and a size cap (see the module)."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, **options):
        options.setdefault("extensions", [jinja2.ext.loopcontrols])
        # Every `{{ }}` value is weighed before it is turned into text: a list literal
        # of big strings is built by no operator a hook sees.
        options.setdefault("finalize", _sized_output)
        super().__init__(**options)
        # lipsum builds up to n paragraphs in one call that no hook can interrupt; no
        # chat template has a use for it.
        self.globals.pop("lipsum", None)
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self.filters["_guard_iter"] = self._guard_iter
        self.filters["_guard_size"] = self._guard_size
        self._state = threading.local()

    # ------------------------------------------------------------ the deadline

    def _tick(self) -> None:
        deadline = getattr(self._state, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateLimit(f"exceeded {self._state.limit:g} s")

    def render(self, template: jinja2.Template, *, time_limit_s: float = TIME_LIMIT_S,
               max_chars: int = MAX_CHARS, **context) -> str:
        """`template` rendered with `context` in at most `time_limit_s` seconds and
        `max_chars` characters; past either, TemplateLimit."""
        self._state.deadline = time.monotonic() + time_limit_s
        self._state.limit = time_limit_s
        try:
            chunks, size = [], 0
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > max_chars:
                    raise TemplateLimit(f"output past {max_chars} chars")
                self._tick()
                chunks.append(chunk)
            return "".join(chunks)
        finally:
            self._state.deadline = None

    # ------------------------------------------------------------ the hooks

    def _parse(self, source, name, filename):
        if len(source) > MAX_SOURCE_CHARS:
            raise TemplateLimit(f"refused: its source has {len(source)} chars, over "
                                f"{MAX_SOURCE_CHARS}")
        tree = super()._parse(source, name, filename)
        # Loops and `~` run without any hook of the sandbox: route every loop's
        # iterable and every concatenated operand through a guard filter.
        for loop in list(tree.find_all(jinja2.nodes.For)):
            loop.iter = jinja2.nodes.Filter(loop.iter, "_guard_iter", [], [], None, None,
                                            lineno=loop.lineno)
        for concat in list(tree.find_all(jinja2.nodes.Concat)):
            concat.nodes = [jinja2.nodes.Filter(n, "_guard_size", [], [], None, None,
                                                lineno=concat.lineno) for n in concat.nodes]
        return tree

    def _guard_iter(self, iterable):
        self._tick()
        if isinstance(iterable, jinja2.Undefined):
            return iterable  # iterating it raises (strict) or is empty, as unguarded

        def guarded():
            for i, item in enumerate(iterable):
                if i % _ITER_CHECK_EVERY == 0:
                    self._tick()
                yield item
        return guarded()

    def _guard_size(self, value):
        self._tick()
        return _sized(value, "a '~' operand")

    def add_filter(self, name: str, func) -> None:
        """Registers a filter under the same guard as the built-in ones."""
        self.filters[name] = self._guard_filter(name, func)

    def _guard_filter(self, name: str, func):
        offset = 2 if hasattr(func, "jinja_pass_arg") else 1  # (context,) value, args...

        @functools.wraps(func)
        def guarded(*args, **kwargs):
            self._tick()
            rest = [*args[offset:], *kwargs.values()]
            _check_ints(rest, f"|{name}")
            value = args[offset - 1] if len(args) >= offset else None
            if name == "format":
                _check_format(value, "|format")
            elif name == "replace" and len(args) >= offset + 2:
                if _projected_replace(value, *args[offset:offset + 3]) > MAX_CHARS:
                    raise TemplateLimit(f"refused |replace: it would pass {MAX_CHARS} chars")
            elif name == "join" and _projected_join(rest[0] if rest else "", value) > MAX_CHARS:
                raise TemplateLimit(f"refused |join: it would pass {MAX_CHARS} chars")
            elif name == "indent" and any(isinstance(a, str) for a in rest):
                # A string width prefixes every line.
                width = max((len(a) for a in rest if isinstance(a, str)), default=0)
                if _weight(value) + width * (str(value).count("\n") + 1) > MAX_CHARS:
                    raise TemplateLimit(f"refused |indent: it would pass {MAX_CHARS} chars")
            return _sized(func(*args, **kwargs), f"|{name}")
        return guarded

    def call_binop(self, context, op, left, right):
        """Every operator, refused before it computes something huge."""
        self._tick()
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
        if op == "**" and ints and right > 0 and abs(left) > 1:
            if right * math.log2(abs(left)) > MAX_INT_BITS:
                raise TemplateLimit(f"refused {left} ** {right}: over {MAX_INT_BITS} bits")
        elif op == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimit(f"refused a product: over {MAX_INT_BITS} bits")
        elif op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if (isinstance(n, int) and isinstance(seq, (str, list, tuple))
                    and n > 0 and _weight(seq) * n > MAX_CHARS):
                raise TemplateLimit(f"refused repeating a {type(seq).__name__} {n} times: "
                                    f"it would pass {MAX_CHARS} chars")
        elif op == "+" and not ints:
            if _weight(left) + _weight(right) > MAX_CHARS:
                raise TemplateLimit(f"refused '+': it would pass {MAX_CHARS} chars")
        elif op == "%" and isinstance(left, str):
            _check_format(left, "'%' formatting")
        return _sized(self.binop_table[op](left, right), f"'{op}'")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - as Jinja's
        """Every call from the template, refused on a huge size argument."""
        __self._tick()
        name = getattr(__obj, "__name__", "a call")
        _check_ints([*args, *kwargs.values()], f"{name}()")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            if name == "replace" and _projected_replace(owner, *args[:3]) > MAX_CHARS:
                raise TemplateLimit(f"refused replace(): it would pass {MAX_CHARS} chars")
            if name == "join" and args and _projected_join(owner, args[0]) > MAX_CHARS:
                raise TemplateLimit(f"refused join(): it would pass {MAX_CHARS} chars")
        result = super().call(__context, __obj, *args, **kwargs)
        return _sized(result, f"{name}()")

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapped)
        def guarded(*args, **kwargs):
            self._tick()
            _check_format(fmt, f"{value.__name__}()")
            return _sized(wrapped(*args, **kwargs), f"{value.__name__}()")
        return guarded

