"""Every mode's action sequence on fixed scenarios, counted and hashed: the V = 1
reference (fixtures/scheduler_v1_actions.json, recorded before slices could hold
several versions and again when a group's placement became the fullest slice that
holds it, `policies.fullest_fitting`; `python tests/_record_v1.py` prints it for the
current tree)."""
import hashlib
import json
import sys

from _fake_run import FakeRun, lengths_from_seed

from dora_jax.scheduler import MODES, SchedulerConfig


def record():
    out = {}
    for mode in MODES:
        for S, slots, G, tbs, rbs, k, seed in [(3, 4, 3, 2, 4, 3, 1), (4, 2, 2, 2, 5, 2, 7),
                                               (2, 3, 3, 1, 3, 1, 3)]:
            cfg = SchedulerConfig(mode=mode, num_slices=S, slots_per_slice=slots, group_size=G,
                                  train_batch_size=tbs, rollout_batch_size=rbs, max_staleness=k)
            run = FakeRun(cfg, lengths_from_seed(seed, "long_tail", 40), load_ticks=2,
                          train_ticks=3)
            acts = []
            orig = run.execute
            run.execute = lambda a, orig=orig: (acts.extend(repr(x) for x in a), orig(a))[1]
            run.run(8)
            h = hashlib.sha256("\n".join(acts).encode()).hexdigest()
            out[f"{mode}/{S},{slots},{G},{tbs},{rbs},{k},{seed}"] = [len(acts), h]
    return out

if __name__ == "__main__":
    json.dump(record(), sys.stdout, indent=1, sort_keys=True)
