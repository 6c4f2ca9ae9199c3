"""Prints the Kubernetes JobSet that runs a config on GKE TPU slices under Pathways.

  python -m dora_jax.launch.gke --config=configs/moe.py --tpu=v5p-256 \\
      --bucket=BUCKET --image=REGISTRY/dora-jax:0.1.0 \\
      [--workdir=/gcs/BUCKET/moe --queue=LOCAL_QUEUE --config.coordinator.max_staleness=1 ...] \\
      > jobset.yaml
  kubectl apply -f jobset.yaml

The config is loaded and validated here, as dora_jax.main would, except for the
files it names (a checkpoint, tokenizer or data file may sit on gs:// or on the
bucket mounted only in the container): dora_jax.main reads and checks those when
it starts. The `--config.*` overrides are forwarded as given into the container's
command (a gs:// URL of the bucket in a file field becomes its path under the mount,
launch/storage.py). The job takes `mesh.total_devices` chips (one JAX device per chip) as that
many slices of `--tpu`, which must divide it exactly.

The bucket is mounted in the head pod (GCS FUSE CSI driver) and holds the workdir;
checkpoints go to the same place through its gs:// URL
(`coordinator.checkpoint_dir`), which Orbax writes directly. A failed pod restarts
the JobSet (up to `--max_restarts`) with the same command, which resumes from the
workdir's newest checkpoint.

With --processes=N the run is N processes instead, one pod each, without Pathways:
the trainer's lead and N-1 slice processes (launch/processes.py; it reads the run's
key from the Secret NAME-authkey).

The image is built from the repository's Dockerfile (docs/launchers.md says how); it holds
this repository at its working directory (the command names `configs/...` relative
to it) with dora_jax and pathwaysutils installed (dora_jax.main starts Pathways' JAX
backend under JAX_PLATFORMS=proxy).
Nothing is contacted and no credentials are read: the output is text, one YAML
document written whole by the YAML emitter (the command line that made it is kept as
an annotation, not a comment), so no argument can add YAML of its own.
"""

from __future__ import annotations

import shlex
import sys
from typing import NoReturn

from absl import app, flags
from ml_collections import config_flags

from dora_jax.launch import jobset, processes

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                          lock_config=True)
_TPU = flags.DEFINE_string("tpu", None, "TPU slice type, e.g. v5p-128, v5e-16, v6e-8")
_GPU = flags.DEFINE_string("gpu", None, "with --processes: GPU nodes of this GKE "
                           "accelerator type (e.g. nvidia-h100-80gb) instead of TPU")
_GPUS_PER_HOST = flags.DEFINE_integer("gpus_per_host", 8, "GPUs of one --gpu node",
                                      lower_bound=1)
_IMAGE = flags.DEFINE_string("image", None, "container image built from this repository's "
                             "Dockerfile, e.g. REGISTRY/dora-jax:0.1.0 (see docs/launchers.md)",
                             required=True)
_BUCKET = flags.DEFINE_string("bucket", None, "Cloud Storage bucket holding the workdir "
                              "(mounted in the head pod by the GCS FUSE CSI driver)",
                              required=True)
_MOUNT = flags.DEFINE_string("mount_path", "", "where the bucket is mounted (default "
                             "/gcs/BUCKET)")
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir, under the mount "
                               "(default: MOUNT/dora/NAME)")
_NAME = flags.DEFINE_string("name", None, "JobSet name (default: from the config)")
_SCRATCH = flags.DEFINE_string("gcs_scratch", "", "Pathways' scratch location (default "
                               "gs://BUCKET/pathways)")
_NODEPOOL = flags.DEFINE_string("cpu_nodepool", jobset.CPU_NODEPOOL,
                                "the CPU node pool the head pod runs on")
_CPU = flags.DEFINE_string("main_cpu", jobset.MAIN_RESOURCES["cpu"], "CPUs of `main`")
_MEMORY = flags.DEFINE_string("main_memory", jobset.MAIN_RESOURCES["memory"],
                              "memory of `main`")
_RESTARTS = flags.DEFINE_integer("max_restarts", jobset.MAX_RESTARTS, "times the JobSet "
                                 "restarts after a failure (each resumes from the workdir)")
_QUEUE = flags.DEFINE_string("queue", "", "Kueue LocalQueue to submit to (label "
                             f"{jobset.KUEUE_LABEL}; none by default)")
_SERVER_IMAGE = flags.DEFINE_string("server_image", jobset.SERVER_IMAGE,
                                    "Pathways server image (resource manager, workers)")
_PROXY_IMAGE = flags.DEFINE_string("proxy_image", jobset.PROXY_IMAGE,
                                   "Pathways IFRT proxy image")
_PROCESSES = flags.DEFINE_integer("processes", 0, "0: one process under Pathways; N: the "
                                  "trainer's lead and N-1 slice processes, one pod each "
                                  "(launch/processes.py, docs/processes.md)", lower_bound=0)
_TRAINER_PROCESSES = flags.DEFINE_integer(
    "trainer_processes", 1, "with --processes: of them, pods running the trainer's mesh "
    "as one SPMD program (jax.distributed; the lead is one)", lower_bound=1)
flags.mark_flag_as_required("config")
ANNOTATION_PREFIX = "dora-jax"


def error(message: object) -> NoReturn:
    """Stops with one line `error: ...` on stderr (no traceback), exit status 1."""
    raise SystemExit("error: " + " ".join(str(message).split()))


def collect_overrides(argv: list[str]) -> list[str]:
    """The `--config.*` overrides in `argv`, as given; `--config.x VALUE` (absl's
    spaced form) is joined into `--config.x=VALUE` so that each stays one word."""
    out, i = [], 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if arg.startswith(("--config.", "-config.", "--noconfig.", "-noconfig.")):
            spaced = ("=" not in arg and not arg.lstrip("-").startswith("noconfig.")
                      and i + 1 < len(argv) and not argv[i + 1].startswith("-"))
            out.append(f"{arg}={argv[i + 1]}" if spaced else arg)
            i += 1 if spaced else 0
        i += 1
    return out


def config_spec() -> str:
    """The `--config=` value as given (path and `:variant`)."""
    return config_flags.get_config_filename(flags.FLAGS["config"])


def spec_from_flags(argv: list[str]) -> dict:
    """The job (`jobset.job_spec`) that the parsed flags and `argv`'s overrides
    describe, checked: the config validates (without reading the files it names:
    the container does that when it starts), the TPU slices tile its devices, and
    the container's command parses back to the same config."""
    spec, overrides = config_spec(), collect_overrides(argv)
    if _GPU.value is not None and not _PROCESSES.value:
        error("--gpu runs a job of several processes: give --processes=N too (Pathways "
              "runs on TPU only)")
    try:
        cfg = jobset.render_config(_CONFIG.value)
        name = _NAME.value or jobset.default_name(spec)
        mount = _MOUNT.value or f"/gcs/{_BUCKET.value}"
        job = jobset.job_spec(
            spec, overrides, cfg, _TPU.value, image=_IMAGE.value, bucket=_BUCKET.value,
            gpu=None if _GPU.value is None else {"type": _GPU.value,
                                                 "per_host": _GPUS_PER_HOST.value},
            workdir=_WORKDIR.value or f"{mount}/dora/{name}", mount_path=_MOUNT.value,
            name=name, gcs_scratch=_SCRATCH.value, server_image=_SERVER_IMAGE.value,
            proxy_image=_PROXY_IMAGE.value, cpu_nodepool=_NODEPOOL.value,
            max_restarts=_RESTARTS.value, queue=_QUEUE.value,
            main_resources={"cpu": _CPU.value, "memory": _MEMORY.value})
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        error(e)
    try:
        forwarded = jobset.render_config(jobset.parse_command(job["command"]))
    except Exception as e:  # noqa: BLE001 - any failure here is the same user error
        error(f"the container's command does not parse back ({e}); write overrides as "
              "--config.x.y=value")
    if not jobset.same_run(forwarded, cfg, job["storage"]):
        error("the container's command parses back to another config; write overrides "
              "as --config.x.y=value")
    return job


def jobset_annotations(job: dict, argv: list[str]) -> dict:
    """How the file was made and what it asks for, as the JobSet's annotations. They
    go through the YAML emitter like every other field: in a comment header, an
    argument holding a newline would end the comment and start YAML of its own
    (another document, e.g. a privileged Pod that `kubectl apply` creates)."""
    t, d = job["tpu"], job["devices"]
    if t is None:  # GPU nodes, one pod a process
        return {f"{ANNOTATION_PREFIX}/command": shlex.join(
                    ["python", "-m", "dora_jax.launch.gke", *argv[1:]]),
                f"{ANNOTATION_PREFIX}/devices": f"{d['total']} {job['gpu']['type']} GPUs "
                                                f"as {_PROCESSES.value} processes"}
    return {
        f"{ANNOTATION_PREFIX}/command": shlex.join(["python", "-m", "dora_jax.launch.gke",
                                                    *argv[1:]]),
        f"{ANNOTATION_PREFIX}/devices": (
            f"{d['total']} chips: {t['num_slices']} x {t['type']} ({t['hosts_per_slice']} "
            f"host(s) x {t['chips_per_host']} chips, topology {t['topology']}) "
            + (f"as {_PROCESSES.value} processes" if _PROCESSES.value else "under Pathways")),
    }


def render(job: dict, argv: list[str]) -> str:
    """The whole output: one YAML document, the JobSet with its annotations, all of
    it written by the YAML emitter (no text of ours around it)."""
    import yaml

    if _PROCESSES.value:
        try:
            js = processes.render(job, _PROCESSES.value, _TRAINER_PROCESSES.value)
        except ValueError as e:
            error(e)
    else:
        js = jobset.render_jobset(job)
    js["metadata"]["annotations"] = jobset_annotations(job, argv)
    return yaml.safe_dump(js, sort_keys=False)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with its errors (a bad override, an unknown variant) as one line."""
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl's --help prints, then exits 1: asking for help is no error
        if any(a in ("-h", "-?", "--help", "--helpshort", "--helpfull") for a in argv):
            raise SystemExit(0) from None
        raise
    except flags.Error as e:
        # A config file that raises comes wrapped with its traceback: keep the
        # flag and the exception's own last line.
        lines = [line for line in str(e).splitlines() if line.strip()]
        error(lines[0] if len(lines) < 2 else f"{lines[0].split(': ')[0]}: {lines[-1]}")
    except (AttributeError, KeyError) as e:  # config_flags on a field that is not there
        name = str(e).strip("\"'")
        bad = [a.split("=")[0] for a in argv if a.startswith("--config.")
               and name in a.split("=")[0].split(".")[1:]]
        error(f"{bad[0] if bad else name}: no such config field")


def main(argv):
    """Prints the JobSet as YAML."""
    if len(argv) > 1:
        error(f"unexpected arguments: {' '.join(argv[1:])}")
    job = spec_from_flags(sys.argv)
    sys.stdout.write(render(job, sys.argv))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
