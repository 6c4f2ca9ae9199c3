"""The GKE job of dora_jax.launch.gke, through XManager.

  python launchers/xm_launch.py --config=configs/tiny.py --tpu=v5e-8 --dry_run
  python launchers/xm_launch.py --config=configs/moe.py --tpu=v5p-128 \\
      --workdir=/gcs/BUCKET/moe --gcs_scratch=gs://BUCKET/pathways --image=REGISTRY/dora_jax:TAG

Flags as dora_jax.launch.gke's (`--config.*` overrides included), plus `--dry_run`.
`--dry_run` prints the job as YAML (the executable: image and command; the
requirements: TPU type and slices; the env; the JobSet it stands for) without
XManager and without credentials. Without it, XManager (`pip install xmanager`)
submits the `main` container with those requirements through its Kubernetes
executor.

That submitting path is a sketch against XManager's public API (xm.container,
xm_local.Kubernetes, experiment.add): XManager is not installed where this
project is tested, so it is not exercised here. XManager places containers, not a
Pathways cluster: the job's `main` reaches the TPUs through a Pathways proxy
(JAX_PLATFORMS=proxy), which the cluster must provide, as the JobSet printed by
--dry_run (or dora_jax.launch.gke) does.
"""

import os
import sys

# Run from a checkout without installing: the repository root holds dora_jax.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from dora_jax.launch import gke, jobset  # noqa: E402  (defines the launch flags)

_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print the job; import no XManager, submit "
                             "nothing")
# XManager's resource names for the chips of each generation.
_XM_TPU = {"v4": "tpu_v4", "v5p": "tpu_v5p", "v5e": "tpu_v5e", "v6e": "tpu_v6e"}


def dry_run_spec(job: dict) -> dict:
    """What would be submitted, as plain data."""
    t = job["tpu"]
    return {
        "executable": {"image": job["image"], "command": job["command"]},
        "requirements": {"tpu": t["type"], "num_tpu_slices": t["num_slices"],
                         "chips_per_slice": t["chips_per_slice"],
                         "hosts_per_slice": t["hosts_per_slice"],
                         "chips_per_host": t["chips_per_host"], "topology": t["topology"],
                         "devices": job["devices"]["total"]},
        "env": job["env"],
        "jobset": jobset.render_jobset(job),
    }


def submit(job: dict, xm, xm_local) -> None:
    """Adds the job to a new local XManager experiment (untested here; see the
    module docstring)."""
    t = job["tpu"]
    with xm_local.create_experiment(experiment_title=job["name"]) as experiment:
        # The image runs the command as given: it must have no ENTRYPOINT of its own.
        [executable] = experiment.package([xm.container(
            image_path=job["image"], args=job["command"],
            executor_spec=xm_local.Kubernetes.Spec())])
        requirements = xm.JobRequirements(**{_XM_TPU[t["generation"]]: t["chips_per_host"]},
                                          replicas=t["num_slices"] * t["hosts_per_slice"])
        experiment.add(xm.Job(executable=executable,
                              executor=xm_local.Kubernetes(requirements=requirements),
                              env_vars=job["env"]))


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
