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
Nothing is contacted and no credentials are read: the output is text.
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
    from dora_jax import config as config_lib  # no JAX

    spec, overrides = config_spec(), collect_overrides(argv)
    try:
        cfg = config_lib.validate(_CONFIG.value)
        name = _NAME.value or jobset.default_name(spec)
        job = jobset.job_spec(spec, overrides, cfg, _TPU.value, image=_IMAGE.value,
                              workdir=_WORKDIR.value or f"/gcs/BUCKET/dora/{name}",
                              name=name, gcs_scratch=_SCRATCH.value,
                              server_image=_SERVER_IMAGE.value, proxy_image=_PROXY_IMAGE.value)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        error(e)
    try:
        forwarded = config_lib.validate(jobset.parse_command(job["command"]))
    except Exception as e:  # noqa: BLE001 - any failure here is the same user error
        error(f"the container's command does not parse back ({e}); write overrides as "
              "--config.x.y=value")
    if forwarded != cfg:
        error("the container's command parses back to another config; write overrides "
              "as --config.x.y=value")
    return job


def header(job: dict, argv: list[str]) -> str:
    """YAML comment lines: how the file was made and what it asks for."""
    t, d = job["tpu"], job["devices"]
    lines = [f"# {shlex.join(['python', '-m', 'dora_jax.launch.gke', *argv[1:]])}",
             f"# {d['total']} chips: {t['num_slices']} x {t['type']} ({t['hosts_per_slice']} "
             f"host(s) x {t['chips_per_host']} chips, topology {t['topology']}) under Pathways"]
    if "BUCKET/" in " ".join(job["command"] + [job["pathways"]["gcs_scratch"] + "/"]):
        lines.append("# edit BUCKET (or pass --workdir, --gcs_scratch) before kubectl apply")
    return "\n".join(lines) + "\n"


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
    import yaml

    if len(argv) > 1:
        error(f"unexpected arguments: {' '.join(argv[1:])}")
    job = spec_from_flags(sys.argv)
    sys.stdout.write(header(job, sys.argv))
    sys.stdout.write(yaml.safe_dump(jobset.render_jobset(job), sort_keys=False))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
