"""The host path at small scale: the tiny default's steady tokens/s, this tree against
another checkout (an older commit's worktree), measured side by side.

    git worktree add /tmp/base <commit>
    python -m dora_jax.bench.host --baseline=/tmp/base --reps=3 [--profile]

Each run is a first run (a new workdir); it prints its steady tokens/s, its wall time
from the command to its exit and its compile time (compile_seconds.json). With
--resume_steps=N each is then resumed for N steps more (the same command, a larger
num_steps), and that run's wall and compile time printed too.

Each repetition runs both trees once, alternating which goes first (this machine is
noisy; interleaving shares the noise), as separate processes:
`python -m dora_jax.main --config=configs/tiny.py` with `--config.coordinator.num_steps`
steps and no periodic saves. A run counts only if its ledger audits clean. Printed: each
run's steady tokens/s (summary.json), the per-repetition ratio, and their median.

With --profile (needs `py-spy` on PATH), every run is sampled and the coordinator's
busy time per step is broken down by the function it spent it in (its thread's samples
outside waits on the event queue), so a change to the host path shows where it moved
host time.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from dora_jax.scheduler.ledger import audit, read

_WAITS = ("Condition.wait", "Queue.get (queue.py)")


def run_tree(tree: str, workdir: str, steps: int, profile: str | None = None,
             resume: bool = False) -> dict:
    """Runs the tiny default from checkout `tree` in a new workdir (or, with `resume`,
    on in the one a run before left); returns its summary, audit, the seconds from
    the command to its exit and those its programs took to compile."""
    if not resume:
        shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "dora_jax.main", "--config=configs/tiny.py",
           f"--workdir={workdir}", f"--config.coordinator.num_steps={steps}",
           "--config.coordinator.checkpoint_every=0"]
    if profile:
        cmd = ["py-spy", "record", "-r", "100", "-f", "raw", "--threads", "-o", profile,
               "--", *cmd]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(workdir, "compile_seconds.json")) as f:
        compile_seconds = sum(json.load(f).values())
    with open(os.path.join(workdir, "config.json")) as f:
        c = json.load(f)["coordinator"]
    report = audit(read(os.path.join(workdir, "ledger.jsonl")),
                   train_batch_size=c["train_batch_size"], group_size=c["group_size"],
                   max_staleness=c["max_staleness"])
    return {"tokens_per_second": summary["tokens_per_second"], "steps": summary["steps"],
            "audit_ok": report.ok, "audit": report.summary(), "wall_seconds": wall,
            "compile_seconds": compile_seconds}


def coordinator_profile(path: str, steps: int, top: int = 8) -> dict:
    """Milliseconds per step the coordinator (the main thread inside `Runtime.run`)
    was busy, in all and by the function directly under the run loop's methods."""
    by: collections.Counter[str] = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [re.sub(r" \((?:.*/)?([^/]*?):\d+\)", r" (\1)", f) for f in stack.split(";")]
        if "MainThread" not in frames[0] or "Runtime.run (loop.py)" not in frames:
            continue
        if any(w in f for f in frames for w in _WAITS):
            continue
        i = frames.index("Runtime.run (loop.py)")
        by[" > ".join(frames[i + 1:i + 3])] += int(n)

    def ms(samples):
        return round(samples * 10.0 / steps, 2)  # 100 Hz: a sample is 10 ms

    return {"busy_ms_per_step": ms(sum(by.values())),
            "top": [(name, ms(n)) for name, n in by.most_common(top)]}


def _times(r: dict) -> str:
    return (f"wall {r['wall_seconds']:5.1f} s (compile {r['compile_seconds']:4.1f})  "
            f"audit {'ok' if r['audit_ok'] else 'FAILED: ' + r['audit']}")


def main(argv):
    del argv
    f = flags.FLAGS
    trees = {"baseline": f.baseline, "this": os.getcwd()}
    results: dict[str, list] = {name: [] for name in trees}
    scratch = tempfile.mkdtemp(prefix="bench_host_")
    for rep in range(f.reps):
        order = list(trees) if rep % 2 == 0 else list(trees)[::-1]
        for name in order:
            prof = os.path.join(scratch, f"{name}_{rep}.txt") if f.profile else None
            r = run_tree(trees[name], os.path.join(scratch, name), f.steps, prof)
            if prof:
                r["profile"] = coordinator_profile(prof, f.steps)
            results[name].append(r)
            print(f"rep {rep} {name:8s} tokens/s {r['tokens_per_second']:8.1f}  {_times(r)}",
                  flush=True)
            if f.resume_steps:
                r = run_tree(trees[name], os.path.join(scratch, name), f.steps + f.resume_steps,
                             resume=True)
                print(f"      {name:8s} resumed: {_times(r)}", flush=True)
    ratios = [t["tokens_per_second"] / b["tokens_per_second"]
              for t, b in zip(results["this"], results["baseline"])
              if t["audit_ok"] and b["audit_ok"]]
    print("ratio this/baseline per rep:", [round(x, 3) for x in ratios])
    if ratios:
        print(f"median ratio: {statistics.median(ratios):.3f}")
    if f.profile:
        for name in trees:
            for rep, r in enumerate(results[name]):
                p = r["profile"]
                print(f"{name} rep {rep}: coordinator busy {p['busy_ms_per_step']} ms/step")
                for fn, ms in p["top"]:
                    print(f"    {ms:7.2f} ms  {fn}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    flags.DEFINE_string("baseline", None, "a checkout of the commit to compare against",
                        required=True)
    flags.DEFINE_integer("reps", 3, "repetitions (each runs both trees)")
    flags.DEFINE_integer("steps", 30, "train steps per run")
    flags.DEFINE_bool("profile", False, "sample every run with py-spy (on PATH)")
    flags.DEFINE_integer("resume_steps", 0, "if > 0, each run is then resumed for this "
                         "many steps more (the same command, a larger num_steps)")
    app.run(main)
