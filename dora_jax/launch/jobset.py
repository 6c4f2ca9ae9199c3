"""One run on TPU slices under Pathways: the job both launchers describe (`job_spec`),
the Kubernetes JobSet that runs it on GKE (`render_jobset`), and the way back from
the container's command to the config it trains (`parse_command`).

Under Pathways one Python process sees every device, builds the trainer's mesh and
each decode slice's mesh on disjoint devices, and copies params between them (the
same run as several processes, without Pathways, is launch/processes.py's): the `pathways-head` pod
holds the resource manager, the IFRT proxy and `main` (our process, with JAX talking
to the proxy: JAX_PLATFORMS=proxy), and each TPU host runs a Pathways worker. So the
devices may span several TPU slices: the job takes `mesh.total_devices` chips (one
JAX device per chip) as that many slices of one type.

The JobSet survives a restart: the workdir lives on a Cloud Storage bucket mounted
in the head pod (launch/storage.py), checkpoints go to the same place by its gs://
URL, and a failed pod restarts the JobSet with the same command, which resumes from
the workdir's newest checkpoint. The config is checked here without reading the
files it names (`render_config`); dora_jax.main reads and checks them when it starts.

Plain data in, plain data out; no JAX, no Kubernetes client, no credentials.
"""

from __future__ import annotations

import re

from absl import flags
from ml_collections import config_flags

from dora_jax.launch import tpu as tpu_lib
from dora_jax.launch.storage import FILE_FIELDS, _get, container_overrides, mounted, storage  # noqa: F401 - the launchers' names

SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:latest"
PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:latest"
PROXY_PORT, RM_PORT, WORKER_PORT = 29000, 29001, 29005
# Every port each Pathways container listens on (the published PathwaysJob layout).
RM_PORTS, PROXY_PORTS = (RM_PORT, 29002), (PROXY_PORT,)
WORKER_PORTS = (WORKER_PORT, 29006, 8471, 8080)
HEAD, WORKER = "pathways-head", "worker"
TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
EXCLUSIVE = ("alpha.jobset.sigs.k8s.io/exclusive-topology", NODEPOOL_LABEL)
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GCSFUSE_ANNOTATION = ("gke-gcsfuse/volumes", "true")  # injects the FUSE sidecar
WORKDIR_VOLUME = "workdir"
# CPU and memory of the head's containers: the resource manager's and the proxy's
# as Pathways' published JobSets give them; `main` holds the host copy of batches
# and the coordinator (flags of dora_jax.launch.gke).
RM_RESOURCES = {"cpu": "8", "memory": "16G"}
PROXY_RESOURCES = {"cpu": "16", "memory": "100G"}
MAIN_RESOURCES = {"cpu": "16", "memory": "64G"}
CPU_NODEPOOL = "cpu-np"
MAX_RESTARTS = 3  # a restarted run resumes from its newest checkpoint in the workdir
# A failed worker pod is replaced in place this many times per host before its Job
# (and so the JobSet) restarts, as Pathways' published workers allow.
WORKER_BACKOFF_PER_HOST = 4
# Pod hostnames (`<name>-worker-<slice>-<host>`) must stay one DNS label (63 chars).
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?")


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


def render_config(config):
    """The `dora_jax.config.Config` of a ConfigDict, validated without reading any
    file, as the launchers need it: the files a config names (model.checkpoint's
    config.json, data.tokenizer, data.path) may be on gs:// or on a bucket mounted
    only in the container, so they are read and checked there, when dora_jax.main
    starts. The architecture a checkpoint would give is stood in for by sizes that
    every mesh axis divides; only the devices and the other fields are used."""
    import math

    import ml_collections

    from dora_jax.config import validate
    from dora_jax.model.hf_checks import Pretrained  # no JAX

    d = ml_collections.ConfigDict(config.to_dict())  # an unlocked copy
    if d.model.get("checkpoint"):
        sizes = [v for section in (d.mesh.trainer, d.mesh.slice) for v in section.values()
                 if isinstance(v, int) and v > 0]
        n = math.lcm(8, *sizes)
        stand_in = dict(num_heads=n, num_kv_heads=n, head_dim=128, d_model=128 * n,
                        mlp_hidden=128 * n, num_layers=n, vocab_size=1024 * n)
        for key, value in stand_in.items():
            if d.model.get(key) is None:
                d.model[key] = value
        # The container takes the checkpoint's tokenizer unless data.tokenizer names
        # one (a gs:// checkpoint's is then named by its path under the mount).
        d.data.tokenizer = d.data.get("tokenizer") or d.model.checkpoint
    # An empty Pretrained: nothing read, nothing merged (the container merges it).
    return validate(d, pretrained=Pretrained())


def check_layout(mesh, chips_per_slice: int) -> None:
    """Fails (ValueError) when the config's meshes cannot be laid out on TPU slices
    of `chips_per_slice` chips as dora_jax.config.devices lays them out (devices taken slice
    by slice): a trainer over several slices crosses them on its `data` axis only,
    so that axis must be a multiple of the slices it spans, and each decode slice
    must lie in one TPU slice. The same rule as `devices.device_grid`, without JAX."""
    n, k = mesh.trainer_devices, mesh.slice_devices
    if n > chips_per_slice:
        spans, data = n // chips_per_slice, mesh.trainer["data"]
        if n % chips_per_slice:
            raise ValueError(f"the trainer's {n} devices take unequal parts of slices of "
                             f"{chips_per_slice} chips: choose a slice type that divides {n}")
        if data % spans:
            raise ValueError(f"the trainer's {n} devices span {spans} slices of "
                             f"{chips_per_slice} chips, so mesh.trainer.data ({data}) must be "
                             f"a multiple of {spans} (only that axis crosses the data-centre "
                             f"network); or choose slices of at least {n} chips")
    for i in range(mesh.num_slices):
        start = (0 if mesh.colocated else n) + i * k
        if start // chips_per_slice != (start + k - 1) // chips_per_slice:
            raise ValueError(f"decode slice {i} ({k} devices) would span two TPU slices of "
                             f"{chips_per_slice} chips; choose another slice type")


def same_run(a, b, store: dict | None = None) -> bool:
    """Whether two Configs train the same run, whichever checkpoint directory the
    launcher added (`job_spec` points it at the bucket) and whether a file is named
    by its gs:// URL or its path under the mount (`store`)."""
    import dataclasses

    def plain(cfg):
        cfg = dataclasses.replace(cfg, coordinator=dataclasses.replace(
            cfg.coordinator, checkpoint_dir=""))
        if store is None:
            return cfg
        for field in FILE_FIELDS:
            *parents, leaf = field.split(".")
            value = mounted(_get(cfg, field), store)
            if parents:
                section = dataclasses.replace(_get(cfg, parents[0]), **{leaf: value})
                cfg = dataclasses.replace(cfg, **{parents[0]: section})
            else:
                cfg = dataclasses.replace(cfg, **{leaf: value})
        return cfg

    return plain(a) == plain(b)


def job_spec(cfg_spec: str, overrides: list[str], cfg, tpu: str | tpu_lib.TpuType | None, *,
             image: str, bucket: str, workdir: str, name: str, gcs_scratch: str = "",
             mount_path: str = "", server_image: str = SERVER_IMAGE,
             proxy_image: str = PROXY_IMAGE, cpu_nodepool: str = CPU_NODEPOOL,
             max_restarts: int = MAX_RESTARTS, queue: str = "",
             main_resources: dict | None = None, gpu: dict | None = None) -> dict:
    """The job as plain data, shared by the GKE and XManager launchers: the
    container (image, command, env, resources), the devices the validated `cfg` (a
    `dora_jax.config.Config`) needs and the TPU slices that hold them, the storage
    (`storage`), the cluster (CPU node pool, restarts, Kueue queue) and the Pathways
    images and scratch location (default gs://BUCKET/pathways). Unless the
    overrides name one, the command points `coordinator.checkpoint_dir` at the
    workdir's checkpoints as a gs:// URL. ValueError when the slices cannot give
    exactly `cfg.mesh.total_devices` chips, or a name, path or bucket is malformed.
    With `gpu` ({"type": GKE accelerator name, "per_host": GPUs a node has}) instead of
    `tpu`, the job is for GPU nodes, one process per pod (launch/processes.py)."""
    if (tpu is None) == (gpu is None):
        raise ValueError("name the accelerator: --tpu, or --gpu with --processes")
    mesh = cfg.mesh
    devices = mesh.total_devices
    t = None
    if tpu is not None:
        t = tpu if isinstance(tpu, tpu_lib.TpuType) else tpu_lib.parse(tpu)
        slices = tpu_lib.num_slices(devices, t)
        check_layout(mesh, t.chips)
    if not _NAME.fullmatch(name):
        raise ValueError(f"--name {name!r} must be a DNS label of at most 40 characters: "
                         "lowercase letters, digits and '-', starting with a letter")
    store = storage(bucket, workdir, mount_path)
    gcs_scratch = gcs_scratch or f"gs://{bucket}/pathways"
    if not gcs_scratch.startswith("gs://"):
        raise ValueError(f"--gcs_scratch must be a gs:// location, got {gcs_scratch!r}")
    if not image:
        raise ValueError("--image must name the container image holding dora_jax")
    if max_restarts < 0:
        raise ValueError(f"--max_restarts must be >= 0, got {max_restarts}")
    if queue and not _LABEL_VALUE.fullmatch(queue):
        raise ValueError(f"--queue {queue!r} is not a Kubernetes label value")
    overrides = container_overrides(cfg, overrides, store)
    if not any(re.match(r"--?config\.coordinator\.checkpoint_dir[= ]", o) for o in overrides):
        overrides.append(f"--config.coordinator.checkpoint_dir={store['checkpoint_dir']}")
    return {
        "name": name,
        "image": image,
        "command": main_command(cfg_spec, store["workdir"], overrides),
        # JAX in `main` reaches every TPU through the head's IFRT proxy. No XLA_FLAGS:
        # the CPU device-count flag of local runs must not leak into a pod.
        "env": {"JAX_PLATFORMS": "proxy",
                "JAX_BACKEND_TARGET": f"grpc://localhost:{PROXY_PORT}",
                "XCLOUD_ENVIRONMENT": "GCP"},
        "resources": dict(main_resources or MAIN_RESOURCES),
        "devices": {"trainer": mesh.trainer_devices,
                    "decode_slices": 0 if mesh.colocated else mesh.num_slices,
                    "devices_per_decode_slice": mesh.slice_devices,
                    "colocated": mesh.colocated, "total": devices},
        "tpu": None if t is None else {
            "type": t.name, "generation": t.generation, "num_slices": slices,
            "chips_per_slice": t.chips, "hosts_per_slice": t.hosts,
            "chips_per_host": t.chips_per_host, "accelerator": t.accelerator,
            "topology": t.topology, "pathways_instance_type": t.pathways_instance_type},
        "gpu": gpu,
        "storage": store,
        "cluster": {"cpu_nodepool": cpu_nodepool, "max_restarts": max_restarts,
                    "queue": queue},
        "pathways": {"server_image": server_image, "proxy_image": proxy_image,
                     "gcs_scratch": gcs_scratch,
                     "head_address": f"{name}-{HEAD}-0-0.{name}"},
    }


def _container(name, image, args=(), ports=(), env=None, resources=None, **extra) -> dict:
    # Our image has a pinned tag (pulled once per node); Pathways' follow `latest`.
    pull = "Always" if image.endswith(":latest") else "IfNotPresent"
    out = {"name": name, "image": image, "imagePullPolicy": pull}
    if args:
        out["args"] = list(args)
    if ports:
        out["ports"] = [{"containerPort": p} for p in ports]
    if env:
        out["env"] = [{"name": k, **({"valueFrom": {"fieldRef": {"fieldPath": v[1]}}}
                                     if isinstance(v, tuple) else {"value": v})}
                      for k, v in env.items()]
    if resources:
        out["resources"] = resources
    out.update(extra)
    return out


def _field(path: str) -> tuple:
    """An env value read from the pod's own metadata (a Downward API fieldRef)."""
    return ("fieldRef", path)


def _job(replicas: int, pods: int, pod_spec: dict, *, backoff: int, restart: str,
         job_annotations: dict | None = None, pod_annotations: dict | None = None) -> dict:
    """A replicated job of `replicas` Jobs of `pods` pods each. A Job that fails
    (more than `backoff` pod failures) fails the JobSet, which restarts every pod
    (failurePolicy.maxRestarts): Pathways needs its whole cluster, and the same
    command then resumes the run from its workdir."""
    pod = {"spec": {"restartPolicy": restart, **pod_spec}}
    if pod_annotations:
        pod = {"metadata": {"annotations": pod_annotations}, **pod}
    template = {"spec": {"parallelism": pods, "completions": pods, "backoffLimit": backoff,
                         "template": pod}}
    if job_annotations:
        template = {"metadata": {"annotations": job_annotations}, **template}
    return {"replicas": replicas, "template": template}


_JOBSET = "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
_REPLICATED_JOB = "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"
# Host networking, as Pathways' examples run every pod: the TPU hosts' and the
# head's traffic skips the pod network; cluster DNS still resolves the pod names.
_HOST_NETWORK = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


def render_jobset(spec: dict) -> dict:
    """The Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) that runs `spec` (from
    `job_spec`) on GKE under Pathways: `pathways-head` (one pod on the CPU node
    pool: the resource manager and proxy as sidecars, `main` our process with the
    bucket mounted) and `worker` (one Job per TPU slice, one pod per host, each with
    its host's chips)."""
    name, t, pw = spec["name"], spec["tpu"], spec["pathways"]
    store, cluster = spec["storage"], spec["cluster"]
    scratch = f"--gcs_scratch_location={pw['gcs_scratch']}"
    head = pw["head_address"]
    rm_address = f"--resource_manager_address={head}:{RM_PORT}"
    # Native sidecars (init containers that keep running): the head pod completes
    # when `main` exits, so the JobSet's success follows the run's.
    sidecar = {"restartPolicy": "Always"}
    main_resources = {"requests": dict(spec["resources"]), "limits": dict(spec["resources"])}
    head_pod = {
        **_HOST_NETWORK,
        "nodeSelector": {NODEPOOL_LABEL: cluster["cpu_nodepool"]},
        "initContainers": [
            _container("pathways-rm", pw["server_image"], [
                f"--server_port={RM_PORT}", "--node_type=resource_manager",
                f"--instance_count={t['num_slices']}",
                f"--instance_type={t['pathways_instance_type']}", scratch],
                ports=RM_PORTS, resources={"limits": dict(RM_RESOURCES)},
                env={"REPLICATED_JOB_NAME": _field(_REPLICATED_JOB),
                     "JOBSET_NAME": _field(_JOBSET), "HOST_ADDRESS": head,
                     "TPU_SKIP_MDS_QUERY": "true"}, **sidecar),
            _container("pathways-proxy", pw["proxy_image"], [
                f"--server_port={PROXY_PORT}", rm_address, scratch],
                ports=PROXY_PORTS, resources={"limits": dict(PROXY_RESOURCES)}, **sidecar)],
        "containers": [_container(
            "main", spec["image"], command=list(spec["command"]), env=dict(spec["env"]),
            resources=main_resources,
            volumeMounts=[{"name": WORKDIR_VOLUME, "mountPath": store["mount_path"]}])],
        "volumes": [workdir_volume(store)],
    }
    worker_pod = {
        **_HOST_NETWORK,
        "nodeSelector": {ACCELERATOR_LABEL: t["accelerator"], TOPOLOGY_LABEL: t["topology"]},
        "containers": [_container(
            "pathways-worker", pw["server_image"],
            [f"--server_port={WORKER_PORT}", rm_address, scratch], ports=WORKER_PORTS,
            env={"TPU_MIN_LOG_LEVEL": "0", "TF_CPP_MIN_LOG_LEVEL": "0",
                 "XCLOUD_ENVIRONMENT": "GCP",
                 "MEGASCALE_NUM_SLICES": str(t["num_slices"]),
                 "MEGASCALE_SLICE_ID": _field(
                     "metadata.labels['jobset.sigs.k8s.io/job-index']"),
                 "MEGASCALE_COORDINATOR_ADDRESS": head,
                 "JOBSET_NAME": _field(_JOBSET), "REPLICATED_JOB_NAME": _field(_REPLICATED_JOB)},
            resources={"limits": {TPU_RESOURCE: t["chips_per_host"]}},
            volumeMounts=[{"name": "shared-tmp", "mountPath": "/tmp"}])],
        "volumes": [{"name": "shared-tmp",
                     "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
    }
    return document(name, cluster, HEAD, in_order=True, replicated_jobs=[  # head first
        # `main` failing fails the head's Job at once: the JobSet restarts.
        {"name": HEAD, **_job(1, 1, head_pod, backoff=0, restart="Never",
                              pod_annotations=dict([GCSFUSE_ANNOTATION]))},
        # A worker that crashes restarts in place, up to a bound per host; one node
        # pool per TPU slice, no two slices on one pool.
        {"name": WORKER, **_job(
            t["num_slices"], t["hosts_per_slice"], worker_pod,
            backoff=WORKER_BACKOFF_PER_HOST * t["hosts_per_slice"],
            restart="OnFailure", job_annotations=dict([EXCLUSIVE]))},
    ])


def workdir_volume(store: dict) -> dict:
    """The bucket (`storage`) as the pod volume WORKDIR_VOLUME (GCS FUSE)."""
    # implicit-dirs: directories written through gs:// (Orbax's) show up in the mount too.
    return {"name": WORKDIR_VOLUME, "csi": {
        "driver": GCSFUSE_DRIVER,
        "volumeAttributes": {"bucketName": store["bucket"], "mountOptions": "implicit-dirs"}}}


def document(name: str, cluster: dict, lead: str, replicated_jobs: list, *,
             in_order: bool = False) -> dict:
    """The JobSet around `replicated_jobs`: it succeeds when job `lead` does, restarts
    up to the cluster's max_restarts, and goes to its Kueue queue if one is named;
    `in_order` starts the jobs in their order."""
    metadata: dict = {"name": name}
    if cluster["queue"]:
        metadata["labels"] = {KUEUE_LABEL: cluster["queue"]}
    spec: dict = {
        # Pods reach each other as <name>-<job>-<index>-<pod>.<name>.
        "network": {"enableDNSHostnames": True, "subdomain": name}}
    if in_order:
        spec["startupPolicy"] = {"startupPolicyOrder": "InOrder"}
    spec.update({"successPolicy": {"operator": "All", "targetReplicatedJobs": [lead]},
                 "failurePolicy": {"maxRestarts": cluster["max_restarts"]},
                 "replicatedJobs": replicated_jobs})
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": metadata, "spec": spec}


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
