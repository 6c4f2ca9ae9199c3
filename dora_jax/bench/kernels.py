"""A profiler trace's device kernels, summed by name (`bench.engine --profile`)."""

from __future__ import annotations

import collections
import gzip
import json


def read_trace(path: str) -> list:
    """The events of a Perfetto trace (`jax.profiler.trace(create_perfetto_trace=True)`)."""
    with gzip.open(path) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_table(trace_events: list) -> tuple[collections.Counter, collections.Counter]:
    """(microseconds, launches) per kernel name on the device tracks of a Perfetto
    trace (the processes whose name holds GPU or TPU)."""
    device_pids = {e["pid"] for e in trace_events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and any(d in e["args"]["name"] for d in ("GPU", "TPU"))}
    micros: collections.Counter[str] = collections.Counter()
    launches: collections.Counter[str] = collections.Counter()
    for e in trace_events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            micros[e["name"]] += e["dur"]
            launches[e["name"]] += 1
    return micros, launches


def kernel_lines(micros: collections.Counter, launches: collections.Counter, steps: int,
                 top: int = 12) -> list:
    if not micros:
        return ["the profiler saw no device kernels (a CPU host)"]
    per = max(steps, 1)
    lines = [f"{sum(launches.values()) / per:.0f} kernels per step, device busy "
             f"{sum(micros.values()) / per:.0f} us per step (traced: tracing adds to each)"]
    lines += [f"  {us / per:9.1f} us/step {launches[name] / per:6.1f}/step  {name[:100]}"
              for name, us in micros.most_common(top)]
    return lines
