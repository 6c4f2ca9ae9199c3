"""One command that checks an accelerator host end to end and reports what it saw.

    python -m dora_jax.bench.accelerator [--out=accelerator_report] [--budget_s=540]
    launchers/accelerator.sh            (installs the host's extra first, then this)

Detects the platform, then runs each part in its own process, under its own share
of `--budget_s`, recording the outcome even when a part fails or runs out of time:

- tests: `pytest -m accelerator` on the device (kernels against their plain-XLA
  and numpy references, bf16 train/decode log-prob agreement), with each
  comparison's error recorded;
- engine / trainer: `bench.engine` and `bench.trainer` at a shape that keeps the
  device busy (dense and MoE decode, busy-slot step times; one train step);
- quickstart: `bench.quickstart_run`, a warm start and a short RL run on the
  device, its ledger audited;
- preset: `sim.device_fit` fits the simulator's efficiencies to the engine,
  trainer and quickstart figures, a preset for pod-scale predictions on this
  device.

Every part's peak device memory is recorded (`bench.peak_memory`). Writes
OUT/report.json (rewritten after every part, so an interrupted check keeps what it
finished) and OUT/summary.txt, and each part's output in OUT/<part>.log.

On CPU (no accelerator, or `--size=tiny`) every part runs at a tiny size on 8 fake
devices, so CI keeps the command working between device loans; the report then
says "cpu" and what a CPU cannot show.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags

from dora_jax.bench import CONFIGS, DEVICE_DENSE, DEVICE_MOE, DEVICE_ROLLOUT

_OUT = flags.DEFINE_string("out", "accelerator_report", "directory of the report")
_BUDGET = flags.DEFINE_integer("budget_s", 0, "seconds for all parts (0: the size's default)")
_SIZE = flags.DEFINE_enum("size", "auto", ["auto", "tiny", "device"],
                          "shapes: tiny (CPU form), device (fills an accelerator); auto "
                          "picks by platform")
_PARTS = flags.DEFINE_list("parts", [], "parts to run (default: all, in order)")
_TESTS_K = flags.DEFINE_string("tests_k", "", "only the accelerator tests pytest -k selects")


@dataclasses.dataclass(frozen=True)
class Size:
    budget_s: int  # all parts together
    shares: dict  # part -> fraction of the budget
    engine: list
    trainer: list
    quickstart: list
    preset: list


def overrides(prefix: str, fields: dict) -> list:
    return [f"--{prefix}.{k}={v}" for k, v in fields.items()]


SIZES = {
    "tiny": Size(
        budget_s=1200,
        shares=dict(tests=0.2, engine=0.15, trainer=0.1, quickstart=0.45, preset=0.1),
        engine=["--models=tiny,moe", "--slots=4", "--sweep=", "--decode_len=16",
                "--requests_per_slot=1", "--repeats=1", "--config.model.num_layers=1"],
        trainer=["--mesh=single", "--groups=2", "--group_size=4", "--steps=1", "--rounds=1",
                 "--config.model.num_layers=1"],
        quickstart=["--sft_steps=10", "--steps=3"], preset=["--steps=2"]),
    "device": Size(
        budget_s=540,
        shares=dict(tests=0.18, engine=0.3, trainer=0.18, quickstart=0.28, preset=0.06),
        # 256 slots last: past the part's budget, the 64-slot figures are kept.
        engine=["--models=tiny,moe", "--slots=64,256", "--sweep=", "--decode_len=256",
                "--requests_per_slot=2", "--repeats=2"]
        + [o for c in ("config", "moe_config") for o in overrides(f"{c}.rollout", DEVICE_ROLLOUT)
           + [f"--{c}.trainer.length_buckets=(512,)"]]
        + overrides("config.model", DEVICE_DENSE)
        + overrides("moe_config.model", DEVICE_MOE)
        + overrides("moe_config.model.moe", dict(num_experts=16, top_k=2, expert_hidden=1408)),
        trainer=["--mesh=single", "--groups=8", "--group_size=8", "--steps=3", "--rounds=3",
                 "--config.trainer.length_buckets=(128,)"]
        + overrides("config.model", DEVICE_DENSE),
        quickstart=["--sft_steps=150", "--steps=30"], preset=["--steps=2"]),
}
PARTS = ("tests", "engine", "trainer", "quickstart", "preset")
# What a CPU run cannot show, said in its report.
CPU_CANNOT = ("compiled TPU/GPU kernels (Pallas runs in its interpreter; no cudnn)",
              "device memory (no allocator statistics on CPU)",
              "accelerator speed: the fitted preset is this CPU's, not a GPU's")


def detect() -> dict:
    """The platform JAX picks on this host, asked of a child process so that this one
    never holds the device (JAX on a GPU takes most of its memory at start)."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps(dict("
            "platform=d[0].platform, device_kind=d[0].device_kind, devices=len(d), "
            "jax=jax.__version__)))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    if out.returncode:
        raise RuntimeError(f"JAX could not start on this host:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_env(platform: str, out: str) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(platform, platform)
    # The caller's XLA flags reach the parts, but not a device count of its own: on a
    # CPU the parts fake the configs' 8 devices, elsewhere they use the real ones.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if platform == "cpu":
        flags.append("--xla_force_host_platform_device_count=8")
    env["XLA_FLAGS"] = " ".join(flags)
    env["DORA_ACCELERATOR_RECORDS"] = os.path.join(out, "tests_records.jsonl")
    # Its own cache, removed when a part is killed at its budget: the part may have
    # left an entry half-written, which no later program may read.
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(out, "compile_cache")
    return env


def part_command(name: str, size: Size, out: str, platform: str, tests_k: str = "") -> list:
    wrap = [sys.executable, "-m", "dora_jax.bench.peak_memory",
            os.path.join(out, f"{name}_memory.json")]
    repo_tests = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
    if name == "tests":
        return wrap + ["pytest", "-m", "accelerator", "-q", "-p", "no:cacheprovider",
                       "-o", "addopts=", f"--junitxml={os.path.join(out, 'tests.xml')}",
                       *(["-k", tests_k] if tests_k else []), os.path.normpath(repo_tests)]
    if name == "engine":
        # On a GPU the Pallas paged kernel and the gathered pages (ragged) are timed
        # beside `auto`'s, which reads a full pool in place.
        kernel = ["--paged_attention=ragged,pallas_gpu"] if platform == "gpu" else []
        return wrap + ["dora_jax.bench.engine", *size.engine, *kernel,
                       f"--json_out={os.path.join(out, 'engine.json')}"]
    if name == "trainer":
        return wrap + ["dora_jax.bench.trainer", *size.trainer,
                       f"--json_out={os.path.join(out, 'trainer.json')}"]
    if name == "quickstart":
        return wrap + ["dora_jax.bench.quickstart_run", *size.quickstart,
                       f"--workdir={os.path.join(out, 'quickstart')}"]
    if name == "preset":
        return wrap + ["dora_jax.sim.device_fit", *size.preset,
                       f"--engine={os.path.join(out, 'engine.json')}",
                       f"--trainer={os.path.join(out, 'trainer.json')}",
                       f"--run={os.path.join(out, 'quickstart', 'rl')}",
                       f"--config={CONFIGS / 'quickstart.py'}",
                       # on a CPU the quickstart's slices and trainer share the cores
                       f"--cores={os.cpu_count() if platform == 'cpu' else 0}",
                       f"--out={os.path.join(out, 'preset.json')}"]
    raise ValueError(f"unknown part {name!r}; known: {', '.join(PARTS)}")


def run_part(command: list, env: dict, budget_s: float, log_path: str) -> tuple:
    """(status, seconds): passed, failed (exit N), or timed out (its process group
    killed at the budget)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timed out", time.monotonic() - start
    return ("passed" if rc == 0 else f"failed (exit {rc})"), time.monotonic() - start


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tests_figures(out: str) -> dict:
    """Counts from pytest's junit XML and the comparisons the tests recorded."""
    import xml.etree.ElementTree as ET

    figures: dict[str, object] = {}
    try:
        root = ET.parse(os.path.join(out, "tests.xml")).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            figures.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                               "skipped")})
            figures["failed"] = [c.get("name") for c in suite.iter("testcase")
                                 if c.find("failure") is not None
                                 or c.find("error") is not None]
    except (OSError, ET.ParseError, AttributeError):
        pass
    records = []
    try:
        with open(os.path.join(out, "tests_records.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    figures["comparisons"] = records
    return figures


def part_figures(name: str, out: str):
    if name == "tests":
        return tests_figures(out)
    path = {"engine": "engine.json", "trainer": "trainer.json", "preset": "preset.json",
            "quickstart": os.path.join("quickstart", "quickstart.json")}[name]
    return _read_json(os.path.join(out, path))


def summary_lines(report: dict) -> list:
    """The readable summary: one line per part, then the headline figures."""
    devices = (f"{report['fake_devices']} fake devices" if "fake_devices" in report
               else f"{report['devices']} devices")
    lines = [f"accelerator check on {report['platform']} ({report['device_kind']}, "
             f"{devices}, jax {report['jax']}), size {report['size']}, "
             f"{report['seconds']:.0f} s of a {report['budget_s']} s budget"]
    for name, part in report["parts"].items():
        peak = (part.get("memory") or {}).get("peak_bytes")
        mem = f", peak {peak / 2**30:.2f} GiB" if peak else ""
        lines.append(f"  {name:<10s} {part['status']:<16s} {part['seconds']:6.1f} s "
                     f"(budget {part['budget_s']:.0f} s){mem}")
    parts = report["parts"]
    fig = lambda name: (parts.get(name) or {}).get("figures") or {}  # noqa: E731
    t = fig("tests")
    if "tests" in t:
        kernels = [r for r in t["comparisons"] if r.get("tol") and "over_tol_allowed" not in r]
        worst = max((r["max_abs_err"] / r["tol"] for r in kernels), default=None)
        lines.append(f"tests: {t['tests']} run, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped; {len(kernels)} kernel comparisons"
                     + (f", worst error/bound {worst:.2f}" if worst is not None else ""))
        for r in t["comparisons"]:
            if r.get("name") == "logprob":
                lines.append(f"  {r['dtype']} decode vs train log-probs, {r['model']} "
                             f"({r['layout']}): max {r['max_abs_err']:.4f}, mean "
                             f"{r['mean_abs_err']:.4f}, {r.get('over_tol', 0)} of "
                             f"{r['tokens']} tokens over {r['tol']}")
    for run in fig("engine").get("runs", []):
        busy = run["regimes"]["all_busy"]
        lines.append(f"engine {run['model']} ({run['params']:,} params, S={run['slots']}): "
                     f"{busy['slice_tokens_per_s']:,.0f} tokens/s, slice/fixed-batch "
                     f"{busy['ratio']:.2f}" + "".join(
                         f", {kv} step {b['over_bound']:.2f}x its bound"
                         for kv, b in (run.get("bound") or {}).items()) + "".join(
                         f", {kv} {c['kernels']} kernels per token"
                         for kv, c in (run.get("step_bytes") or {}).items() if c.get("kernels")))
    if fig("trainer"):
        rates = fig("trainer")["tokens_per_s"]
        lines.append("trainer: " + ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in rates.items()))
    q = fig("quickstart")
    if q:
        lines.append(f"quickstart: {q['mode']} on {q['layout']}; reward {q['reward_first']} -> "
                     f"{q['reward_last']} over {q['steps']} steps; audit "
                     f"{'clean' if q['audit_ok'] else 'FAILED'}: {q['audit']}")
    p = fig("preset")
    if p:
        eff = p["efficiency"]
        minutes = p["provenance"].get("predicted_step_minutes", {})
        lines.append(f"preset {p['name']}: hbm {eff['hbm']:.3f}, step overhead "
                     f"{eff['step_overhead'] * 1e3:.2f} ms, mfu decode {eff['mfu_decode']:.3f}, "
                     f"mfu train {eff['mfu_train']:.3f}; predicted min/step on 64 devices: "
                     + ", ".join(f"{m} {v:.2f}" for m, v in minutes.items()))
    if report["platform"] == "cpu":
        lines.append("cpu: not shown here: " + "; ".join(CPU_CANNOT))
    return lines


def write_report(out: str, report: dict) -> None:
    tmp = os.path.join(out, "report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, os.path.join(out, "report.json"))
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(summary_lines(report)) + "\n")


def check(out: str, size_name: str, budget_s: int, parts: list, tests_k: str = "") -> dict:
    """Runs the parts in order and returns the report (also written to `out`)."""
    os.makedirs(out, exist_ok=True)
    out = os.path.abspath(out)
    host = detect()
    if size_name == "auto":
        size_name = "tiny" if host["platform"] == "cpu" else "device"
    size = SIZES[size_name]
    budget_s = budget_s or size.budget_s
    env = child_env(host["platform"], out)
    report = dict(host, size=size_name, budget_s=budget_s, seconds=0.0, parts={},
                  started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if host["platform"] == "cpu":
        report["cpu_cannot_show"] = list(CPU_CANNOT)
        report["fake_devices"] = 8
    start = time.monotonic()
    for name in parts:
        share = budget_s * size.shares[name]
        status, seconds = run_part(part_command(name, size, out, host["platform"], tests_k),
                                   env, share, os.path.join(out, f"{name}.log"))
        if status == "timed out":  # it may have died writing a cache entry
            shutil.rmtree(env["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
        report["parts"][name] = dict(status=status, seconds=round(seconds, 1),
                                     budget_s=round(share, 1),
                                     memory=_read_json(os.path.join(out, f"{name}_memory.json")),
                                     figures=part_figures(name, out),
                                     log=os.path.join(out, f"{name}.log"))
        report["seconds"] = round(time.monotonic() - start, 1)
        write_report(out, report)
        print(f"{name}: {status} in {seconds:.1f} s", flush=True)
    print("\n".join(summary_lines(report)))
    return report


def main(argv):
    del argv
    parts = _PARTS.value or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise app.UsageError(f"--parts: unknown {', '.join(unknown)}; known: {', '.join(PARTS)}")
    report = check(_OUT.value, _SIZE.value, _BUDGET.value, parts, _TESTS_K.value)
    failed = [n for n, p in report["parts"].items() if p["status"] != "passed"]
    if failed:
        raise SystemExit(f"parts not passed: {', '.join(failed)} (see {_OUT.value}/summary.txt)")


if __name__ == "__main__":
    app.run(main)
