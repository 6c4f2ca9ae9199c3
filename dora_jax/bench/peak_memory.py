"""Runs a module as `python -m` would, then records the peak device memory it used.

    python -m dora_jax.bench.peak_memory OUT.json MODULE [ARGS...]

Each part of `bench.accelerator` runs in its own process under this wrapper, so the
peak is that part's alone (the allocator's `peak_bytes_in_use`, the largest over the
local devices). A backend without memory statistics (CPU) records null and why. The
record is written however the module ends, an exception or `sys.exit` included.
"""

from __future__ import annotations

import json
import runpy
import sys


def peak_record() -> dict:
    """The peak of the devices this process used; null when JAX never started."""
    if "jax" not in sys.modules:
        return dict(peak_bytes=None, reason="the part never imported JAX")
    import jax

    stats = [d.memory_stats() for d in jax.local_devices()]
    device = jax.local_devices()[0]
    base = dict(platform=device.platform, device_kind=device.device_kind)
    if not any(stats):
        return dict(base, peak_bytes=None,
                    reason=f"no memory statistics on {device.platform}")
    peaks = [s.get("peak_bytes_in_use", 0) for s in stats if s]
    limits = [s.get("bytes_limit", 0) for s in stats if s]
    return dict(base, peak_bytes=max(peaks), bytes_limit=max(limits) or None)


def main(argv: list) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -m dora_jax.bench.peak_memory OUT.json MODULE [ARGS...]")
    out, module, args = argv[1], argv[2], argv[3:]
    sys.argv = [module] + args
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        with open(out, "w") as f:
            json.dump(peak_record(), f)


if __name__ == "__main__":
    main(sys.argv)
