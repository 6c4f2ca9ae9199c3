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
import string
import threading
import time
import types

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
# What one filter or method call may take on, per second left before the deadline:
# a call runs in one piece that no deadline check can interrupt, so it only starts
# if its input is small enough to end in time. Worst cases measured (jinja2 3.1, one
# core, 1M-weight inputs) with a 3-7x margin for slower hosts: per-item filters
# (|sort, |map, |xmlattr, |groupby ~250-450k items/s), text filters done in Python
# or regexes (|urlize ~0.7M chars/s, |wordwrap, |pprint ~1.5M/s), and the rest,
# C-speed string and container work (>15M chars/s).
ITEM_RATE = 100_000
SLOW_TEXT_RATE = 200_000
FAST_RATE = 5_000_000
_PER_ITEM = frozenset({"sort", "unique", "dictsort", "groupby", "map", "select", "reject",
                       "selectattr", "rejectattr", "batch", "slice", "max", "min", "sum",
                       "xmlattr"})
_SLOW_TEXT = frozenset({"urlize", "wordwrap", "pprint", "title", "wordcount", "urlencode",
                        "striptags"})
_DIGITS = re.compile(r"\d+")
# A printf directive: %[(key)][flags][width][.precision][length]type.
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)
# A str.format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type].
_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d*))?[a-zA-Z%]?\Z", re.S)


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
            if total > limit:
                break
            # Flat containers of strings or ints (the usual big ones) are weighed in C
            # calls: item by item in Python would take seconds at MAX_CHARS items.
            kinds = set(map(type, x))
            if kinds <= {str}:
                total += sum(map(len, x))
            elif kinds <= {int}:
                total += sum(map(int.bit_length, x)) // 3 + len(x)
            else:
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


def _too_wide(digits: str | None) -> bool:
    if not digits:
        return False
    return digits != "*" and (len(digits) > 7 or int(digits) > MAX_CHARS)


def _check_format(fmt, what: str, args=(), kwargs=None, *, printf: bool) -> None:
    """Refuses a format whose width or precision (written, or taken from an argument
    by `*`) or whose output would pass MAX_CHARS, before the one C call that would
    allocate it: "%1000000000d", "{:>1000000000}", "%*s" % (10**9, x)."""
    if not isinstance(fmt, str):
        return
    values = [*args] if isinstance(args, (tuple, list)) else [args]
    values += list((kwargs or {}).values())
    fields, widths = 0, 0
    if printf:
        for m in _PRINTF.finditer(fmt):
            width, precision = m.group(1), m.group(2)
            fields += 1
            if "*" in (width, precision):  # the width is the next argument
                _check_ints(values, what)
            for d in (width, precision):
                if _too_wide(d):
                    raise TemplateLimit(f"refused {what}: a format width or precision of "
                                        f"{d} is over {MAX_CHARS}")
                widths += int(d) if d and d != "*" else 0
    else:
        try:
            parts = list(string.Formatter().parse(fmt))
        except ValueError:
            return  # malformed: the call itself raises, having built nothing
        for _, field, spec, _ in parts:
            if field is None:
                continue
            fields += 1
            if "{" in (spec or ""):
                raise TemplateLimit(f"refused {what}: a nested format spec {spec!r} (its "
                                    "width would come from an argument)")
            spec_m = _SPEC.match(spec or "")
            found = [spec_m.group(1), spec_m.group(2)] if spec_m else _DIGITS.findall(spec or "")
            for d in found:
                if _too_wide(d):
                    raise TemplateLimit(f"refused {what}: a format width or precision of "
                                        f"{d} is over {MAX_CHARS}")
                widths += int(d) if d else 0
    # Each field prints one argument at most (its repr may be ~4x that, e.g. \x00;
    # the result is weighed again once built).
    if fields and len(fmt) + widths + fields * _weight(values) > MAX_CHARS:
        raise TemplateLimit(f"refused {what}: its output would pass {MAX_CHARS} chars")


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

    def _afford(self, what: str, value, *, rate: int, items: bool = False) -> None:
        """Refuses a call on `value` that would run past the deadline: its work (items
        of `value`, or its weight) at `rate` per second must fit in the time left."""
        deadline = getattr(self._state, "deadline", None)
        if deadline is None:
            return
        budget = int(max(deadline - time.monotonic(), 0.0) * rate)
        if items:
            work = len(value) if hasattr(value, "__len__") else 0
        else:
            work = _weight(value, min(budget, MAX_CHARS) + 1)
        if work > budget:
            raise TemplateLimit(f"refused {what} on an input of {work} "
                                f"{'items' if items else 'chars'}: it would run past the "
                                f"{self._state.limit:g} s time limit")

    def _listed(self, iterable, what: str) -> list:
        """A lazy iterable (a |map or |select generator) as a list, built with deadline
        checks: the filter it feeds then sees a size to be weighed."""
        out = []
        for i, item in enumerate(iterable):
            if i % _ITER_CHECK_EVERY == 0:
                self._tick()
                if i > MAX_CHARS:
                    raise TemplateLimit(f"refused {what}: its input passes {MAX_CHARS} items")
            out.append(item)
        return out

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        # Compiling folds constant filter calls (`{{ 'literal'|urlize }}`): under the
        # same deadline as a render.
        self._state.deadline = time.monotonic() + TIME_LIMIT_S
        self._state.limit = TIME_LIMIT_S
        try:
            return super().compile(source, name, filename, raw, defer_init)
        finally:
            self._state.deadline = None

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

        rate, per_item = ((ITEM_RATE, True) if name in _PER_ITEM else
                          (SLOW_TEXT_RATE, False) if name in _SLOW_TEXT else (FAST_RATE, False))

        @functools.wraps(func)
        def guarded(*args, **kwargs):
            self._tick()
            rest = [*args[offset:], *kwargs.values()]
            _check_ints(rest, f"|{name}")
            value = args[offset - 1] if len(args) >= offset else None
            if hasattr(value, "__next__"):  # a generator: sized before the filter runs
                value = self._listed(value, f"|{name}")
                args = (*args[:offset - 1], value, *args[offset:])
            self._afford(f"|{name}", value, rate=rate, items=per_item)
            if rest:
                self._afford(f"|{name}", rest, rate=FAST_RATE)
            if name == "format":
                _check_format(value, "|format", rest, printf=True)
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
            _check_format(left, "'%' formatting", right, printf=True)
        return _sized(self.binop_table[op](left, right), f"'{op}'")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - as Jinja's
        """Every call from the template, refused on a huge size argument."""
        __self._tick()
        name = getattr(__obj, "__name__", "a call")
        _check_ints([*args, *kwargs.values()], f"{name}()")
        owner = getattr(__obj, "__self__", None)
        # A method runs in one C call (str.split, str.replace...): it starts only if
        # it can end before the deadline.
        if isinstance(__obj, types.BuiltinFunctionType):
            __self._afford(f"{name}()", [owner, args, kwargs], rate=FAST_RATE)
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
            mapping = args[0] if value.__name__ == "format_map" and args else None
            _check_format(fmt, f"{value.__name__}()", () if mapping else args,
                          mapping if isinstance(mapping, dict) else kwargs, printf=False)
            return _sized(wrapped(*args, **kwargs), f"{value.__name__}()")
        return guarded

