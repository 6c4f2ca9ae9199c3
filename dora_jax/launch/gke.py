"""Prints the Kubernetes JobSet that runs a config on GKE TPU slices under Pathways.

  python -m dora_jax.launch.gke --config=configs/moe.py --tpu=v5p-128 \\
      --workdir=/gcs/BUCKET/moe --gcs_scratch=gs://BUCKET/pathways \\
      --image=REGISTRY/dora_jax:TAG [--config.coordinator.max_staleness=1 ...] > jobset.yaml
  kubectl apply -f jobset.yaml

The config is loaded and validated here, as dora_jax.main would, and the `--config.*`
overrides are forwarded verbatim into the container's command. The job takes
`mesh.total_devices` chips (one JAX device per chip) as that many slices of `--tpu`,
which must divide it exactly. The image must hold this repository at its working
directory (the command names `configs/...` relative to it) with dora_jax and
pathwaysutils installed (dora_jax.main starts Pathways' JAX backend under
JAX_PLATFORMS=proxy).
Nothing is contacted and no credentials are read: the output is text, one YAML
document written whole by the YAML emitter (the command line that made it is kept as
an annotation, not a comment), so no argument can add YAML of its own.
"""

from __future__ import annotations

import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

from dora_jax.launch import jobset

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                          lock_config=True)
_TPU = flags.DEFINE_string("tpu", None, "TPU slice type, e.g. v5p-128, v5e-16, v6e-8")
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir (default: "
                               "/gcs/BUCKET/dora/NAME: a mounted bucket, to edit)")
_IMAGE = flags.DEFINE_string("image", "dora-jax:latest", "container image with dora_jax "
                             "installed and this repository as its working directory")
_NAME = flags.DEFINE_string("name", None, "JobSet name (default: from the config)")
_SCRATCH = flags.DEFINE_string("gcs_scratch", "gs://BUCKET/pathways",
                               "Pathways' scratch location (gs://)")
_SERVER_IMAGE = flags.DEFINE_string("server_image", jobset.SERVER_IMAGE,
                                    "Pathways server image (resource manager, workers)")
_PROXY_IMAGE = flags.DEFINE_string("proxy_image", jobset.PROXY_IMAGE,
                                   "Pathways IFRT proxy image")
flags.mark_flags_as_required(["config", "tpu"])
ANNOTATION_PREFIX = "dora-jax"


def error(message) -> None:
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
    return flags.FLAGS["config"].config_filename


def spec_from_flags(argv: list[str]) -> dict:
    """The job (`jobset.job_spec`) that the parsed flags and `argv`'s overrides
    describe, checked: the config validates, the TPU slices tile its devices, and
    the container's command parses back to the same config."""
    from dora_jax.model import hf_checks  # no JAX

    spec, overrides = config_spec(), collect_overrides(argv)
    try:
        cfg = hf_checks.validated(_CONFIG.value)
        name = _NAME.value or jobset.default_name(spec)
        job = jobset.job_spec(spec, overrides, cfg, _TPU.value, image=_IMAGE.value,
                              workdir=_WORKDIR.value or f"/gcs/BUCKET/dora/{name}",
                              name=name, gcs_scratch=_SCRATCH.value,
                              server_image=_SERVER_IMAGE.value, proxy_image=_PROXY_IMAGE.value)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        error(e)
    try:
        forwarded = hf_checks.validated(jobset.parse_command(job["command"]))
    except Exception as e:  # noqa: BLE001 - any failure here is the same user error
        error(f"the container's command does not parse back ({e}); write overrides as "
              "--config.x.y=value")
    if forwarded != cfg:
        error("the container's command parses back to another config; write overrides "
              "as --config.x.y=value")
    return job


def annotations(job: dict, argv: list[str]) -> dict:
    """How the file was made and what it asks for, as the JobSet's annotations. They
    go through the YAML emitter like every other field: in a comment header, an
    argument holding a newline would end the comment and start YAML of its own
    (another document, e.g. a privileged Pod that `kubectl apply` creates)."""
    t, d = job["tpu"], job["devices"]
    return {
        f"{ANNOTATION_PREFIX}/command": shlex.join(["python", "-m", "dora_jax.launch.gke",
                                                    *argv[1:]]),
        f"{ANNOTATION_PREFIX}/devices": (
            f"{d['total']} chips: {t['num_slices']} x {t['type']} ({t['hosts_per_slice']} "
            f"host(s) x {t['chips_per_host']} chips, topology {t['topology']}) under Pathways"),
    }


def needs_bucket(job: dict) -> bool:
    """Whether the job still names the placeholder bucket."""
    return "BUCKET/" in " ".join(job["command"] + [job["pathways"]["gcs_scratch"] + "/"])


def render(job: dict, argv: list[str]) -> str:
    """The whole output: one YAML document, the JobSet with its annotations, all of
    it written by the YAML emitter (no text of ours around it)."""
    import yaml

    js = jobset.render_jobset(job)
    js["metadata"]["annotations"] = annotations(job, argv)
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
    """Prints the JobSet as YAML (a reminder to edit BUCKET goes to stderr, out of
    the file)."""
    if len(argv) > 1:
        error(f"unexpected arguments: {' '.join(argv[1:])}")
    job = spec_from_flags(sys.argv)
    if needs_bucket(job):
        print("note: edit BUCKET (or pass --workdir, --gcs_scratch) before kubectl apply",
              file=sys.stderr)
    sys.stdout.write(render(job, sys.argv))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
