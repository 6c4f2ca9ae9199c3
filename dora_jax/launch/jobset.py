"""One run on TPU slices under Pathways: the job both launchers describe (`job_spec`),
the Kubernetes JobSet that runs it on GKE (`render_jobset`), and the way back from
the container's command to the config it trains (`parse_command`).

dora_jax is single-controller: one Python process sees every device, builds the
trainer's mesh and each decode slice's mesh on disjoint devices, and copies params
between them. At pod scale that process runs under Pathways: the `pathways-head` pod
holds the resource manager, the IFRT proxy and `main` (our process, with JAX talking
to the proxy: JAX_PLATFORMS=proxy), and each TPU host runs a Pathways worker. So the
devices may span several TPU slices: the job takes `mesh.total_devices` chips (one
JAX device per chip) as that many slices of one type.

Plain data in, plain data out; no JAX, no Kubernetes client, no credentials.
"""

from __future__ import annotations

import re

from absl import flags
from ml_collections import config_flags

from dora_jax.launch import tpu as tpu_lib

SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:latest"
PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:latest"
PROXY_PORT, RM_PORT, WORKER_PORT = 29000, 29001, 29005
HEAD, WORKER = "pathways-head", "worker"
TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
EXCLUSIVE = ("alpha.jobset.sigs.k8s.io/exclusive-topology", "cloud.google.com/gke-nodepool")
MAX_RESTARTS = 3  # a restarted run resumes from its newest checkpoint in the workdir
# Pod hostnames (`<name>-worker-<slice>-<host>`) must stay one DNS label (63 chars).
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")


def main_command(cfg_spec: str, workdir: str, overrides: list[str]) -> list[str]:
    """The README's command: `python -m dora_jax.main --config=... --workdir=...`
    followed by the `--config.*` overrides as given."""
    return ["python", "-m", "dora_jax.main", f"--config={cfg_spec}", f"--workdir={workdir}",
            *overrides]


def default_name(cfg_spec: str) -> str:
    """A JobSet name from a config spec: `configs/qwen3_gsm8k.py:tiny` ->
    `dora-qwen3-gsm8k-tiny`."""
    path, _, variant = cfg_spec.partition(":")
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    name = re.sub(r"[^a-z0-9]+", "-", f"dora-{stem}-{variant}".lower()).strip("-")
    return name[:40].rstrip("-")


def job_spec(cfg_spec: str, overrides: list[str], cfg, tpu: str | tpu_lib.TpuType, *,
             image: str, workdir: str, name: str, gcs_scratch: str,
             server_image: str = SERVER_IMAGE, proxy_image: str = PROXY_IMAGE) -> dict:
    """The job as plain data, shared by the GKE and XManager launchers: the
    container (image, command, env), the devices the validated `cfg` (a
    `dora_jax.config.Config`) needs and the TPU slices that hold them, and the
    Pathways images and scratch bucket. ValueError when the slices cannot give
    exactly `cfg.mesh.total_devices` chips, or a name or bucket is malformed."""
    t = tpu if isinstance(tpu, tpu_lib.TpuType) else tpu_lib.parse(tpu)
    mesh = cfg.mesh
    devices = mesh.total_devices
    slices = tpu_lib.num_slices(devices, t)
    if not _NAME.fullmatch(name):
        raise ValueError(f"--name {name!r} must be a DNS label of at most 40 characters: "
                         "lowercase letters, digits and '-', starting with a letter")
    if not gcs_scratch.startswith("gs://"):
        raise ValueError(f"--gcs_scratch must be a gs:// location, got {gcs_scratch!r}")
    if not image:
        raise ValueError("--image must name the container image holding dora_jax")
    return {
        "name": name,
        "image": image,
        "command": main_command(cfg_spec, workdir, list(overrides)),
        # JAX in `main` reaches every TPU through the head's IFRT proxy. No XLA_FLAGS:
        # the CPU device-count flag of local runs must not leak into a pod.
        "env": {"JAX_PLATFORMS": "proxy",
                "JAX_BACKEND_TARGET": f"grpc://localhost:{PROXY_PORT}"},
        "devices": {"trainer": mesh.trainer_devices,
                    "decode_slices": 0 if mesh.colocated else mesh.num_slices,
                    "devices_per_decode_slice": mesh.slice_devices,
                    "colocated": mesh.colocated, "total": devices},
        "tpu": {"type": t.name, "generation": t.generation, "num_slices": slices, "chips_per_slice": t.chips,
                "hosts_per_slice": t.hosts, "chips_per_host": t.chips_per_host,
                "accelerator": t.accelerator, "topology": t.topology,
                "pathways_instance_type": t.pathways_instance_type},
        "pathways": {"server_image": server_image, "proxy_image": proxy_image,
                     "gcs_scratch": gcs_scratch,
                     "head_address": f"{name}-{HEAD}-0-0.{name}"},
    }


def _container(name, image, args=(), ports=(), **extra) -> dict:
    out = {"name": name, "image": image, "imagePullPolicy": "Always"}
    if args:
        out["args"] = list(args)
    if ports:
        out["ports"] = [{"containerPort": p} for p in ports]
    out.update(extra)
    return out


def _job(replicas: int, pods: int, pod_spec: dict, annotations: dict | None = None) -> dict:
    """A replicated job of `replicas` Jobs of `pods` pods each; a pod that fails
    fails its Job at once (the JobSet restarts everything: Pathways needs its whole
    cluster, and the run resumes from its checkpoint)."""
    template = {"spec": {"parallelism": pods, "completions": pods, "backoffLimit": 0,
                         "template": {"spec": {"restartPolicy": "Never", **pod_spec}}}}
    if annotations:
        template = {"metadata": {"annotations": annotations}, **template}
    return {"replicas": replicas, "template": template}


def render_jobset(spec: dict) -> dict:
    """The Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) that runs `spec` (from
    `job_spec`) on GKE under Pathways: `pathways-head` (one pod on a CPU node: the
    resource manager and proxy as sidecars, `main` our process) and `worker` (one
    Job per TPU slice, one pod per host, each with its host's chips)."""
    name, t, pw = spec["name"], spec["tpu"], spec["pathways"]
    scratch = f"--gcs_scratch_location={pw['gcs_scratch']}"
    rm_address = f"--resource_manager_address={pw['head_address']}:{RM_PORT}"
    # Native sidecars (init containers that keep running): the head pod completes
    # when `main` exits, so the JobSet's success follows the run's.
    sidecar = {"restartPolicy": "Always"}
    head_pod = {
        # Any node without TPUs: the head needs CPU and memory, not chips.
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": ACCELERATOR_LABEL, "operator": "DoesNotExist"}]}]}}},
        "initContainers": [
            _container("pathways-rm", pw["server_image"], [
                f"--server_port={RM_PORT}", "--node_type=resource_manager",
                f"--instance_count={t['num_slices']}",
                f"--instance_type={t['pathways_instance_type']}", scratch],
                ports=[RM_PORT], **sidecar),
            _container("pathways-proxy", pw["proxy_image"], [
                f"--server_port={PROXY_PORT}", rm_address, scratch],
                ports=[PROXY_PORT], **sidecar)],
        "containers": [_container(
            "main", spec["image"], command=list(spec["command"]),
            env=[{"name": k, "value": v} for k, v in spec["env"].items()])],
    }
    worker_pod = {
        "nodeSelector": {ACCELERATOR_LABEL: t["accelerator"], TOPOLOGY_LABEL: t["topology"]},
        "containers": [_container(
            "pathways-worker", pw["server_image"],
            [f"--server_port={WORKER_PORT}", rm_address, scratch], ports=[WORKER_PORT],
            resources={"limits": {TPU_RESOURCE: t["chips_per_host"]}})],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            # Pods reach each other as <name>-<job>-<index>-<pod>.<name>.
            "network": {"enableDNSHostnames": True, "subdomain": name},
            "startupPolicy": {"startupPolicyOrder": "InOrder"},  # head first
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [HEAD]},
            "failurePolicy": {"maxRestarts": MAX_RESTARTS},
            "replicatedJobs": [
                {"name": HEAD, **_job(1, 1, head_pod)},
                # One node pool per TPU slice, no two slices on one pool.
                {"name": WORKER, **_job(t["num_slices"], t["hosts_per_slice"], worker_pod,
                                        annotations=dict([EXCLUSIVE]))},
            ],
        },
    }


def config_args(command: list[str]) -> list[str]:
    """The `--config=...` and `--config.*` (or `--noconfig.*`) items of a command."""
    return [a for a in command
            if re.match(r"--?(no)?config(=|\.)", a)]


def parse_command(command: list[str], root: str | None = None):
    """The ConfigDict a `main_command` trains, parsed the way dora_jax.main parses
    its flags (ml_collections' config flag on a fresh FlagValues). A relative config
    path is taken from `root` when given (the image's working directory otherwise)."""
    args = config_args(command)
    if root is not None:
        args = [_rooted(a, root) for a in args]
    fv = flags.FlagValues()
    argv = ["main", *args]
    # The override flags are defined from the argv the config flag is shown.
    holder = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                             flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return holder.value


def _rooted(arg: str, root: str) -> str:
    if not arg.startswith(("--config=", "-config=")):
        return arg
    flag, _, spec = arg.partition("=")
    return f"{flag}={spec}" if spec.startswith("/") else f"{flag}={root.rstrip('/')}/{spec}"
