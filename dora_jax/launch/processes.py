"""One run as several processes on GKE (docs/processes.md), without Pathways: the
JobSet of a `lead` pod (process 0: the trainer and the coordinator, the bucket
mounted), with --trainer_processes=T a `trainers` Job of T-1 indexed pods (the rest
of the trainer's mesh, one SPMD program with the lead), and a `slices` Job of N-T
indexed pods (the slice processes), each pod one process on one host (a TPU host of
`--tpu`'s type, or a GPU node of `--gpu`'s) with its own chips.

Each process reads its role from its environment (runtime/roles.py): the pods get
DORA_NUM_PROCESSES, DORA_COORDINATOR (the lead pod's stable name) and DORA_AUTHKEY
(from the Secret `<name>-authkey`, key `authkey`, which `kubectl create secret
generic NAME-authkey --from-literal=authkey=$(openssl rand -hex 16)` makes) and
DORA_TRAINER_PROCESSES; a trainer pod's DORA_PROCESS_ID is its completion index + 1,
a slice pod's its completion index + T. A slice pod that fails restarts in place
(its Job's backoff): the run goes on meanwhile and takes it back. A trainer pod
failing, or the lead, fails the JobSet, which restarts and resumes from the workdir.

Plain data in, plain data out; no JAX, no Kubernetes client.
"""

from __future__ import annotations

from dora_jax.launch import jobset

LEAD, TRAINERS, SLICES = "lead", "trainers", "slices"
PORT = 8476
SLICE_RESTARTS = 8  # per slice pod, before its Job (and the JobSet) fails
GPU_RESOURCE = "nvidia.com/gpu"
GPU_LABEL = "cloud.google.com/gke-accelerator"


def chips(spec: dict, processes: int, trainer_processes: int = 1) -> tuple[int, int]:
    """(chips of each trainer process, chips of each slice process) of `spec`'s
    devices; ValueError when a process's part does not fit one host of its type."""
    d, host = spec["devices"], _host(spec)
    per_host = host["per_host"]
    if d["colocated"]:
        raise ValueError("mesh.colocated: a run of several processes gives the trainer "
                         "and the slices devices of their own")
    slice_processes = processes - trainer_processes
    if slice_processes < 1 or d["decode_slices"] % slice_processes:
        raise ValueError(f"--processes={processes}: the {d['decode_slices']} decode slices "
                         f"must split evenly over {slice_processes} slice processes")
    if d["trainer"] % trainer_processes:
        raise ValueError(f"--trainer_processes={trainer_processes} does not divide the "
                         f"trainer's {d['trainer']} chips")
    trainer = d["trainer"] // trainer_processes
    each = d["decode_slices"] // slice_processes * d["devices_per_decode_slice"]
    for what, n in (("each trainer process", trainer), ("each slice process", each)):
        if n > per_host:
            raise ValueError(f"{what} needs {n} chips, more than a {host['type']} "
                             f"host's {per_host}: a process's devices lie on one host")
    return trainer, each


def _host(spec: dict) -> dict:
    """What one node gives a pod: its type, devices, resource and node selector."""
    t, gpu = spec["tpu"], spec["gpu"]
    if gpu is not None:
        return dict(type=gpu["type"], per_host=gpu["per_host"], resource=GPU_RESOURCE,
                    selector={GPU_LABEL: gpu["type"]})
    return dict(type=t["type"], per_host=t["chips_per_host"], resource=jobset.TPU_RESOURCE,
                selector={jobset.ACCELERATOR_LABEL: t["accelerator"],
                          jobset.TOPOLOGY_LABEL: t["topology"]})


def render(spec: dict, processes: int, trainer_processes: int = 1) -> dict:
    """The JobSet for `spec` (jobset.job_spec) as `processes` processes, the first
    `trainer_processes` of them the trainer's."""
    name, store = spec["name"], spec["storage"]
    host = _host(spec)
    lead_chips, slice_chips = chips(spec, processes, trainer_processes)
    env = {k: v for k, v in spec["env"].items() if k not in ("JAX_PLATFORMS",
                                                            "JAX_BACKEND_TARGET")}
    env.update({"DORA_NUM_PROCESSES": str(processes),
                "DORA_TRAINER_PROCESSES": str(trainer_processes),
                "DORA_COORDINATOR": f"{name}-{LEAD}-0-0.{name}:{PORT}"})
    secret = {"secretKeyRef": {"name": f"{name}-authkey", "key": "authkey"}}
    selector = host["selector"]

    def container(role_env: dict, count: int, command: list, **extra) -> dict:
        c = jobset._container("main", spec["image"], command=command,
                              env={**env, **role_env},
                              resources={"limits": {host["resource"]: count}}, **extra)
        c["env"].append({"name": "DORA_AUTHKEY", "valueFrom": secret})
        return c

    lead_pod = {
        "nodeSelector": selector,
        "containers": [container(
            {"DORA_PROCESS_ID": "0"}, lead_chips, list(spec["command"]),
            ports=[{"containerPort": PORT + k} for k in range(3)],
            volumeMounts=[{"name": jobset.WORKDIR_VOLUME, "mountPath": store["mount_path"]}])],
        "volumes": [jobset.workdir_volume(store)],
    }
    mount = {"name": jobset.WORKDIR_VOLUME, "mountPath": store["mount_path"]}
    # A pod's process id from its completion index; the shell only does the sum.
    index = 'export DORA_PROCESS_ID=$((JOB_COMPLETION_INDEX + {})); exec "$0" "$@"'
    slice_pod = {"nodeSelector": selector, "containers": [container(
        {}, slice_chips, ["bash", "-c", index.format(trainer_processes), *spec["command"]])]}
    slices = jobset._job(1, processes - trainer_processes, slice_pod,
                         backoff=SLICE_RESTARTS * (processes - trainer_processes),
                         restart="OnFailure")
    slices["template"]["spec"]["completionMode"] = "Indexed"
    jobs = [{"name": LEAD, **jobset._job(1, 1, lead_pod, backoff=0, restart="Never",
                                         pod_annotations=dict([jobset.GCSFUSE_ANNOTATION]))}]
    if trainer_processes > 1:  # they read the workdir's checkpoints and compile cache
        trainer_pod = {"nodeSelector": selector, "containers": [container(
            {}, lead_chips, ["bash", "-c", index.format(1), *spec["command"]],
            volumeMounts=[mount])], "volumes": [jobset.workdir_volume(store)]}
        trainers = jobset._job(1, trainer_processes - 1, trainer_pod, backoff=0,
                               restart="Never",
                               pod_annotations=dict([jobset.GCSFUSE_ANNOTATION]))
        trainers["template"]["spec"]["completionMode"] = "Indexed"
        jobs.append({"name": TRAINERS, **trainers})
    return jobset.document(name, spec["cluster"], LEAD,
                           replicated_jobs=[*jobs, {"name": SLICES, **slices}])
