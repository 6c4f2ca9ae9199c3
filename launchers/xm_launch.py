"""The GKE job of dora_jax.launch.gke, through XManager.

  python launchers/xm_launch.py --config=configs/tiny.py --tpu=v5e-8 \\
      --bucket=BUCKET --image=REGISTRY/dora-jax:0.1.0 --dry_run
  python launchers/xm_launch.py --config=configs/moe.py --tpu=v5p-256 \\
      --bucket=BUCKET --image=REGISTRY/dora-jax:0.1.0

Flags as dora_jax.launch.gke's (`--config.*` overrides included), plus `--dry_run`.

One layout, single-controller, as the JobSet's: the jobs are read off the rendered
JobSet (`xm_jobs`), so XManager places exactly its containers: `main` (our one
process, CPU only, JAX_PLATFORMS=proxy) with the Pathways resource manager and
proxy, and one Pathways worker per TPU host (the only jobs with chips).
`--dry_run` prints those jobs and the JobSet as YAML, without XManager and without
credentials; without it the same jobs go to XManager (`pip install xmanager`) as
one job group on its Kubernetes executor (`submit`, a thin translation that is not
exercised where xmanager is not installed). XManager places containers, not a
JobSet: the containers keep the JobSet's addresses (the head pod's DNS name, and
`localhost` for the proxy that shares `main`'s pod there), so the cluster must give
them the same names; the JobSet from dora_jax.launch.gke is the tested path.
"""

import os
import sys

# Run from a checkout without installing: the repository root holds dora_jax.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from dora_jax.launch import gke  # noqa: E402  (defines the launch flags)
from dora_jax.launch.xm import dry_run_spec, xm_jobs  # noqa: E402,F401

_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the job; import no XManager, submit "
                             "nothing")
def submit(job: dict, xm, xm_local) -> None:
    """Adds `dry_run_spec(job)["jobs"]` to a new local XManager experiment as one
    job group."""
    jobs = dry_run_spec(job)["jobs"]
    with xm_local.create_experiment(experiment_title=job["name"]) as experiment:
        # Each image runs its command as given: ours has no ENTRYPOINT of its own.
        executables = experiment.package([
            xm.container(image_path=j["image"], args=j.get("command") or j["args"],
                         executor_spec=xm_local.Kubernetes.Spec())
            for j in jobs.values()])
        group = {name: xm.Job(executable=executable, env_vars=j["env"],
                              executor=xm_local.Kubernetes(requirements=xm.JobRequirements(
                                  **j["requirements"], replicas=j["replicas"])))
                 for (name, j), executable in zip(jobs.items(), executables)}
        experiment.add(xm.JobGroup(**{name.replace("-", "_"): g for name, g in group.items()}))


def main(argv):
    if len(argv) > 1:
        gke.error(f"unexpected arguments: {' '.join(argv[1:])}")
    if not _DRY_RUN.value:
        try:
            from xmanager import xm, xm_local
        except ImportError:
            gke.error("xmanager is not installed (pip install xmanager); --dry_run prints "
                      "the job without it")
    job = gke.spec_from_flags(sys.argv)
    if _DRY_RUN.value:
        import yaml

        sys.stdout.write(yaml.safe_dump(dry_run_spec(job), sort_keys=False))
        return
    submit(job, xm, xm_local)


if __name__ == "__main__":
    app.run(main, flags_parser=gke.parse_flags)
