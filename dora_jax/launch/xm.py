"""The jobs XManager submits for a rendered GKE job: one per container of its
JobSet, single-controller (launchers/xm_launch.py submits them; this module defines no
flags, so it imports anywhere)."""

from __future__ import annotations

from dora_jax.launch import jobset

# XManager's resource names for the chips of each generation.
XM_TPU = {"v4": "tpu_v4", "v5p": "tpu_v5p", "v5e": "tpu_v5e", "v6e": "tpu_v6e"}


def _env(container: dict) -> dict:
    """A container's literal env values (fieldRefs are the JobSet's own metadata,
    which XManager does not give: left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def xm_jobs(job: dict) -> dict:
    """The jobs XManager submits for `job` (`jobset.job_spec`), one per container
    of its JobSet: image, command or args, env, replicas and requirements (CPU and
    memory, or one host's chips). Only the Pathways workers ask for TPUs: `main` is
    one process that reaches every chip through the proxy."""
    js = jobset.render_jobset(job)
    generation = job["tpu"]["generation"]
    out = {}
    for rj in js["spec"]["replicatedJobs"]:
        spec = rj["template"]["spec"]
        pod = spec["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            limits = c.get("resources", {}).get("limits", {})
            chips = limits.get(jobset.TPU_RESOURCE)
            requirements = ({XM_TPU[generation]: chips} if chips else
                            {k: v for k, v in limits.items() if k in ("cpu", "memory")})
            out[c["name"]] = {
                "image": c["image"],
                **({"command": c["command"]} if "command" in c else {"args": c.get("args", [])}),
                "env": _env(c),
                "replicas": rj["replicas"] * spec["parallelism"],
                "requirements": requirements,
            }
    return out


def dry_run_spec(job: dict) -> dict:
    """What `submit` submits, as plain data: the jobs (`xm_jobs`) and the JobSet
    they are read from."""
    return {"jobs": xm_jobs(job), "jobset": jobset.render_jobset(job)}


