"""Launch specs for TPU pods (dora_jax/launch, launchers/xm_launch.py): the TPU table,
the JobSet of every shipped config on slices that fit it (device counts, the fields
JobSet and Pathways need, the command parsed back to the same config), and the two
command lines as a user runs them."""

import importlib.util
import math
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, load_repo_config

from dora_jax.data.word_problems import PROBLEMS_FILE
from dora_jax.launch import jobset, tpu
from dora_jax.model import hf_checks

GENERATIONS = ("v4", "v5p", "v5e", "v6e")
# ml_collections loads config files with importlib's deprecated load_module.
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")


def _variants(path) -> tuple:
    spec = importlib.util.spec_from_file_location("_launch_cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VARIANTS


SPECS = [f"configs/{p.name}" + (f":{v}" if v else "")
         for p in sorted((REPO / "configs").glob("[!_]*.py")) for v in _variants(p)]


@pytest.fixture(scope="module")
def needs_overrides(tiny_hf_checkpoint):
    """The overrides a spec needs to validate ({dotted: value})."""
    return {"configs/qwen3_gsm8k.py": {"model.checkpoint": tiny_hf_checkpoint,
                                       "data.path": PROBLEMS_FILE}}


def _load(spec, overrides):
    """The ConfigDict, unvalidated (the launcher validates it without its files)."""
    return load_repo_config(spec, validate=False,
                            **{k.replace(".", "__"): v for k, v in overrides.items()})


def _head(js):
    [head] = [j for j in js["spec"]["replicatedJobs"] if j["name"] == jobset.HEAD]
    return head["template"]["spec"]["template"]["spec"]


def _worker(js):
    [worker] = [j for j in js["spec"]["replicatedJobs"] if j["name"] == jobset.WORKER]
    return worker


def _by_name(containers):
    return {c["name"]: c for c in containers}


def _flag(args, name):
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def _main(js):
    return _by_name(_head(js)["containers"])["main"]


def _chips(js) -> int:
    worker = _worker(js)
    pod = worker["template"]["spec"]
    [container] = pod["template"]["spec"]["containers"]
    assert pod["parallelism"] == pod["completions"]
    return worker["replicas"] * pod["parallelism"] * container["resources"]["limits"][
        jobset.TPU_RESOURCE]


def test_tpu_table():
    t = tpu.parse("v5p-128")
    assert (t.chips, t.chips_per_host, t.hosts, t.topology, t.accelerator) == (
        64, 4, 16, "4x4x4", "tpu-v5p-slice")
    assert t.pathways_instance_type == "tpuv5:4x4x4"
    assert tpu.parse("v5litepod-16") == tpu.parse("v5e-16")
    assert (tpu.parse("v5e-16").accelerator, tpu.parse("v5e-16").hosts) == (
        "tpu-v5-lite-podslice", 4)
    assert (tpu.parse("v6e-8").chips_per_host, tpu.parse("v6e-8").hosts) == (8, 1)
    assert (tpu.parse("v6e-256").topology, tpu.parse("v6e-256").accelerator) == (
        "16x16", "tpu-v6e-slice")
    assert (tpu.parse("v4-8").chips, tpu.parse("v4-8").topology) == (4, "2x2x1")
    assert tpu.parse("v4-4096").chips == 2048 and tpu.parse("v5p-12288").chips == 6144
    for t in tpu.TPU_TYPES.values():  # the topology is the slice, hosts tile it
        assert math.prod(map(int, t.topology.split("x"))) == t.chips, t
        assert t.hosts * t.chips_per_host == t.chips, t
        assert len(t.topology.split("x")) == (3 if t.generation in ("v4", "v5p") else 2)
    with pytest.raises(ValueError, match=r"unknown TPU type 'v5p-96'.*v5p-\{8,16"):
        tpu.parse("v5p-96")


def test_slices_must_tile_the_devices():
    assert tpu.num_slices(256, tpu.parse("v5p-128")) == 4
    with pytest.raises(ValueError) as e:
        tpu.num_slices(256, tpu.parse("v5p-1024"))
    assert "256" in str(e.value) and "512 chips" in str(e.value) and "v5p-512" in str(e.value)
    assert tpu.fitting(8)[0].chips == 1 and tpu.largest_fitting(256, "v5p").name == "v5p-512"


def _types_for(devices):
    """A slice type per generation that tiles `devices` (the largest), and the
    smallest of all."""
    found = {tpu.largest_fitting(devices, g) for g in GENERATIONS if tpu.fitting(devices, g)}
    return sorted(found | {tpu.fitting(devices)[0]}, key=lambda t: t.name)


def _job_spec(spec, overrides, cfg, t, **kw):
    args = dict(image="img:1", bucket="b-1", workdir="/gcs/b-1/run",
                name=jobset.default_name(spec))
    return jobset.job_spec(spec, overrides, cfg, t, **{**args, **kw})


@pytest.mark.parametrize("spec", SPECS)
def test_every_config_renders_a_jobset_that_parses_back(spec, needs_overrides):
    given = needs_overrides.get(spec, {})
    cfg = jobset.render_config(_load(spec, given))
    overrides = [f"--config.{k}={v}" for k, v in given.items()]
    devices = cfg.mesh.total_devices
    assert devices == cfg.mesh.trainer_devices + cfg.mesh.num_slices * cfg.mesh.slice_devices
    for t in _types_for(devices):
        try:
            job = _job_spec(spec, overrides, cfg, t.name)
        except ValueError as e:  # a trainer over slices needs a data axis that splits
            assert "mesh.trainer.data" in str(e) or "span two TPU slices" in str(e), e
            continue
        js = jobset.render_jobset(job)
        assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
        assert js["metadata"]["name"] == job["name"] and "labels" not in js["metadata"]
        assert {j["name"] for j in js["spec"]["replicatedJobs"]} == {"pathways-head", "worker"}
        assert _chips(js) == devices, t
        worker = _worker(js)
        assert worker["replicas"] == devices // t.chips
        pod = worker["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": t.accelerator,
                                       "cloud.google.com/gke-tpu-topology": t.topology}
        assert worker["template"]["metadata"]["annotations"][
            "alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
        head = _by_name(_head(js)["initContainers"] + _head(js)["containers"])
        assert set(head) == {"pathways-rm", "pathways-proxy", "main"}
        rm = head["pathways-rm"]["args"]
        assert int(_flag(rm, "instance_count")) == worker["replicas"]
        assert _flag(rm, "instance_type").split(":")[1] == t.topology
        assert _flag(rm, "gcs_scratch_location") == "gs://b-1/pathways"
        main = head["main"]
        env = {e["name"]: e["value"] for e in main["env"]}
        assert env == {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://localhost:29000",
                       "XCLOUD_ENVIRONMENT": "GCP"}
        assert main["command"] == ["python", "-m", "dora_jax.main", f"--config={spec}",
                                   "--workdir=/gcs/b-1/run", *overrides,
                                   "--config.coordinator.checkpoint_dir="
                                   "gs://b-1/run/checkpoints"]
        back = jobset.render_config(jobset.parse_command(main["command"], root=str(REPO)))
        assert back.coordinator.checkpoint_dir == "gs://b-1/run/checkpoints"
        assert jobset.same_run(back, cfg)


def test_parse_command_applies_the_overrides():
    cmd = jobset.main_command("configs/moe.py:tiny", "/w", ["--config.coordinator.max_staleness=1",
                                                            "--config.rollout.prefill_buckets=(8,32)"])
    back = hf_checks.validated(jobset.parse_command(cmd, root=str(REPO)))
    assert back.coordinator.max_staleness == 1 and back.rollout.prefill_buckets == (8, 32)
    assert back == load_repo_config("configs/moe.py:tiny", coordinator__max_staleness=1,
                                    rollout__prefill_buckets=(8, 32))
    assert back != load_repo_config("configs/moe.py:tiny")


def test_job_spec_refuses_a_bad_name_bucket_or_workdir():
    cfg = load_repo_config("configs/tiny.py:spread")
    kw = dict(image="i", bucket="b-1", workdir="/gcs/b-1/w", name="dora-tiny")
    jobset.job_spec("configs/tiny.py:spread", [], cfg, "v5e-8", **kw)
    for bad, match in ((dict(name="Dora_Tiny"), "DNS label"),
                       (dict(gcs_scratch="/tmp"), "gs://"),
                       (dict(bucket="B"), "bucket name"),
                       (dict(workdir="gs://b-1/w"), "plain file I/O.*/gcs/b-1"),
                       (dict(workdir="/tmp/w"), "not under the bucket's mount"),
                       (dict(queue="a queue"), "label value")):
        with pytest.raises(ValueError, match=match):
            jobset.job_spec("configs/tiny.py:spread", [], cfg, "v5e-8", **dict(kw, **bad))
    with pytest.raises(ValueError, match="needs 8 devices.*v5e-16 has 16 chips"):
        jobset.job_spec("configs/tiny.py:spread", [], cfg, "v5e-16", **kw)
    # A checkpoint directory the user names is kept.
    job = jobset.job_spec("configs/tiny.py:spread", ["--config.coordinator.checkpoint_dir=gs://x/c"],
                          cfg, "v5e-8", **kw)
    assert [a for a in job["command"] if "checkpoint_dir" in a] == [
        "--config.coordinator.checkpoint_dir=gs://x/c"]


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)


GKE = ("-m", "dora_jax.launch.gke", "--bucket=my-bucket", "--image=reg/dora-jax:0.1.0")
XM = ("launchers/xm_launch.py", "--bucket=my-bucket", "--image=reg/dora-jax:0.1.0")


def test_gke_command_line_survives_restarts():
    # A checkpoint on the mount that is not on this machine: not read at render time.
    ckpt = "--config.model.checkpoint=/gcs/my-bucket/models/Qwen3-30B-A3B"
    r = _run(*GKE, "--config=configs/moe.py", "--tpu=v5p-256", "--queue=team-q", ckpt,
             "--config.data.source=gsm8k", "--config.data.path=gs://my-bucket/data/train.jsonl",
             "--config.coordinator.max_staleness=1")
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    assert js["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-q"}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3}
    worker = _worker(js)
    pod = worker["template"]["spec"]
    wpod = pod["template"]["spec"]
    assert (worker["replicas"], pod["parallelism"], wpod["containers"][0]["resources"][
        "limits"]["google.com/tpu"]) == (2, 32, 4)
    assert _chips(js) == 256
    # Restarts: a worker restarts in place (bounded); `main` failing restarts the JobSet.
    assert (wpod["restartPolicy"], pod["backoffLimit"]) == ("OnFailure", 4 * 32)
    [head_job] = [j for j in js["spec"]["replicatedJobs"] if j["name"] == "pathways-head"]
    assert head_job["template"]["spec"]["backoffLimit"] == 0
    head = _head(js)
    assert head["restartPolicy"] == "Never"
    for p in (head, wpod):  # host networking, as Pathways runs its pods
        assert (p["hostNetwork"], p["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert head["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-np"}
    # The bucket, mounted by the GCS FUSE CSI driver, holds the workdir.
    assert head_job["template"]["spec"]["template"]["metadata"]["annotations"] == {
        "gke-gcsfuse/volumes": "true"}
    [volume] = head["volumes"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
    main = _main(js)
    assert main["volumeMounts"] == [{"name": volume["name"], "mountPath": "/gcs/my-bucket"}]
    assert main["resources"]["limits"] == {"cpu": "16", "memory": "64G"}
    assert main["image"] == "reg/dora-jax:0.1.0" and main["imagePullPolicy"] == "IfNotPresent"
    sidecars = _by_name(head["initContainers"])
    assert sidecars["pathways-rm"]["resources"]["limits"] == {"cpu": "8", "memory": "16G"}
    assert sidecars["pathways-proxy"]["resources"]["limits"] == {"cpu": "16", "memory": "100G"}
    assert [p["containerPort"] for p in wpod["containers"][0]["ports"]] == [29005, 29006, 8471,
                                                                           8080]
    wenv = {e["name"]: e.get("value") for e in wpod["containers"][0]["env"]}
    assert wenv["MEGASCALE_NUM_SLICES"] == "2"
    assert wenv["MEGASCALE_COORDINATOR_ADDRESS"] == "dora-moe-pathways-head-0-0.dora-moe"
    # The same command resumes: workdir under the mount, checkpoints at its gs:// URL.
    command = main["command"]
    assert command[4:] == ["--workdir=/gcs/my-bucket/dora/dora-moe", ckpt,
                           "--config.data.source=gsm8k",
                           # The bucket's URL, read in the container through the mount.
                           "--config.data.path=/gcs/my-bucket/data/train.jsonl",
                           "--config.coordinator.max_staleness=1",
                           "--config.coordinator.checkpoint_dir="
                           "gs://my-bucket/dora/dora-moe/checkpoints"]


def test_files_on_the_bucket_are_read_through_the_mount_and_not_at_render_time():
    # Neither file exists here: nothing is read until the container starts.
    given = {"model.checkpoint": "gs://b-1/models/Qwen3-0.6B", "data.path": "/gcs/b-1/d.jsonl"}
    overrides = [f"--config.{k}={v}" for k, v in given.items()]
    cfg = jobset.render_config(_load("configs/qwen3_gsm8k.py", given))
    job = _job_spec("configs/qwen3_gsm8k.py", overrides, cfg, "v5p-8")
    assert job["command"][5:] == [
        "--config.model.checkpoint=/gcs/b-1/models/Qwen3-0.6B",
        "--config.data.path=/gcs/b-1/d.jsonl",
        "--config.data.tokenizer=/gcs/b-1/models/Qwen3-0.6B",
        "--config.coordinator.checkpoint_dir=gs://b-1/run/checkpoints"]
    back = jobset.render_config(jobset.parse_command(job["command"], root=str(REPO)))
    assert jobset.same_run(back, cfg, job["storage"]) and not jobset.same_run(back, cfg)
    other = _load("configs/qwen3_gsm8k.py", dict(given, **{"data.path": "gs://other/d.jsonl"}))
    with pytest.raises(ValueError, match="only gs://b-1 is mounted"):
        _job_spec("configs/qwen3_gsm8k.py", [], jobset.render_config(other), "v5p-8")


@pytest.mark.parametrize("tpu_type,slices", [("v5p-512", 1), ("v5p-256", 2), ("v5p-128", 4)])
def test_gke_renders_1_2_and_4_slices(tpu_type, slices):
    # On 4 slices the 128-chip trainer spans two: its data axis crosses them.
    overrides = [] if slices < 4 else ["--config.mesh.trainer.data=2",
                                       "--config.mesh.trainer.fsdp=8"]
    r = _run(*GKE, "--config=configs/moe.py", f"--tpu={tpu_type}", *overrides)
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    worker = _worker(js)
    assert worker["replicas"] == slices and _chips(js) == 256
    assert int(_flag(_by_name(_head(js)["initContainers"])["pathways-rm"]["args"],
                     "instance_count")) == slices


def test_gke_refuses_a_trainer_whose_data_axis_cannot_cross_slices():
    r = _run(*GKE, "--config=configs/moe.py", "--tpu=v5p-128")
    assert r.returncode == 1 and "mesh.trainer.data (1) must be a multiple of 2" in r.stderr


@pytest.mark.parametrize("args", [["--tpu=v5p-1024"], ["--tpu=v5p-96"],
                                  ["--tpu=v5p-256", "--config.coordinator.max_staleness=-1"],
                                  ["--tpu=v5p-256", "--config.coordinator.nope=1"],
                                  ["--tpu=v5p-256", "--workdir=/tmp/moe"]])
def test_gke_errors_are_one_line(args):
    r = _run(*GKE, "--config=configs/moe.py", *args)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_image_is_required_and_the_dockerfile_pins_versions():
    r = _run("-m", "dora_jax.launch.gke", "--config=configs/tiny.py:spread", "--tpu=v5e-8",
             "--bucket=b-1")
    assert r.returncode != 0 and "--image" in r.stderr
    text = (REPO / "Dockerfile").read_text()
    [base] = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert ":" in base and "latest" not in base and base.split(":")[1][0].isdigit()
    assert "latest" not in text.replace("# ", "").split("FROM", 1)[1]
    for package in ("jax", "pathwaysutils", "gcsfs"):
        assert f'"{package}==' in text, package
    assert "WORKDIR" in text and "COPY . ." in text and ".[pathways]" in text


def test_xm_submits_what_it_dry_runs_single_controller():
    from dora_jax.launch import xm as xm_launch  # launchers/xm_launch.py's jobs, no flags

    cfg = jobset.render_config(load_repo_config("configs/moe.py", validate=False))
    job = _job_spec("configs/moe.py", [], cfg, "v5p-256")
    jobs = xm_launch.xm_jobs(job)
    assert set(jobs) == {"pathways-rm", "pathways-proxy", "main", "pathways-worker"}
    # Only the Pathways workers ask for chips: one `main`, CPU only.
    assert jobs["main"]["replicas"] == 1 and jobs["main"]["requirements"] == {
        "cpu": "16", "memory": "64G"}
    assert jobs["main"]["command"] == job["command"]
    assert jobs["pathways-worker"]["requirements"] == {"tpu_v5p": 4}
    assert jobs["pathways-worker"]["replicas"] == 2 * 32
    assert [n for n, j in jobs.items() if any(k.startswith("tpu") for k in j["requirements"])
            ] == ["pathways-worker"]
    # The dry run prints exactly what `submit` submits (one function builds both).
    r = _run(*XM, "--config=configs/moe.py", "--tpu=v5p-256", "--dry_run")
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    same = _job_spec("configs/moe.py", [], cfg, "v5p-256", bucket="my-bucket",
                     workdir="/gcs/my-bucket/dora/dora-moe", image="reg/dora-jax:0.1.0")
    assert out == yaml.safe_load(yaml.safe_dump(xm_launch.dry_run_spec(same), sort_keys=False))
    assert "XLA_FLAGS" not in out["jobs"]["main"]["env"]
    if importlib.util.find_spec("xmanager") is None:
        r = _run(*XM, "--config=configs/tiny.py:spread", "--tpu=v5e-8")
        assert r.returncode == 1 and r.stderr.startswith("error: xmanager is not installed")
        assert r.stderr.count("\n") == 1


def test_launch_imports_no_jax():
    code = ("import sys, dora_jax.launch.gke, dora_jax.launch.jobset\n"
            "from dora_jax import config\n"
            "config.validate(config.load('configs/moe.py'))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax'}))")
    r = _run("-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


# A newline in an override once ended the comment header and started a second YAML
# document: a privileged Pod that `kubectl apply` would create.
INJECTION = ("/x\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: evil}\nspec: "
             "{containers: [{name: x, image: evil, securityContext: {privileged: true}}]}")


@pytest.mark.parametrize("value", [INJECTION, "a\x1b[2Jb\rc\x07d\te\u2028f",
                                   "# not a comment"])
def test_override_values_cannot_inject_yaml(value):
    override = f"--config.data.path={value}"
    r = _run(*GKE, "--config=configs/tiny.py:spread", "--tpu=v5e-8", override)
    assert r.returncode == 0, r.stderr
    [js] = list(yaml.safe_load_all(r.stdout))  # exactly one document: the JobSet
    assert js["kind"] == "JobSet" and js["apiVersion"].startswith("jobset.x-k8s.io/")
    assert _main(js)["command"][-2] == override  # the value verbatim
    # How the file was made is kept inside the document, where it is only data.
    made = js["metadata"]["annotations"]["dora-jax/command"]
    assert shlex.split(made)[-1] == override
    assert "8 chips" in js["metadata"]["annotations"]["dora-jax/devices"]
    r = _run(*XM, "--config=configs/tiny.py:spread", "--tpu=v5e-8", "--dry_run", override)
    assert r.returncode == 0, r.stderr
    [out] = list(yaml.safe_load_all(r.stdout))
    assert out["jobs"]["main"]["command"][-2] == override
    assert _main(out["jobset"])["command"][-2] == override


def _readme_launch_commands() -> list[list[str]]:
    """The launcher commands of docs/launchers.md (dora_jax.launch.*, launchers/*.py) as argv:
    continuation lines joined, `# ...` comments, `> file` and optional `[--flag]`
    left out."""
    lines, out, pending = (REPO / "docs" / "launchers.md").read_text().splitlines(), [], ""
    for line in lines:
        if not (pending or line.startswith(("python -m dora_jax.launch", "python launchers/"))):
            continue
        pending += " " + line.split(" #")[0].rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        argv = [a for a in shlex.split(pending.split(" > ")[0]) if not a.startswith("[")]
        out.append(argv)
        pending = ""
    return out


def test_documented_launch_examples_run_as_written():
    """Each launcher command the docs give renders its job (XManager's in its
    dry-run form) as written, placeholders included."""
    commands = _readme_launch_commands()
    assert {c[1] if c[1] != "-m" else c[2] for c in commands} >= {
        "dora_jax.launch.gke", "launchers/xm_launch.py"}, commands
    for argv in commands:
        if argv[1] == "launchers/xm_launch.py" and "--dry_run" not in argv:
            argv = [*argv, "--dry_run"]
        r = _run(*argv[1:])
        assert r.returncode == 0, f"{shlex.join(argv)}: {r.stderr[-1000:]}"
        assert yaml.safe_load(r.stdout), shlex.join(argv)


def _container_env(container, secret="k3y"):
    return {e["name"]: e.get("value", secret if "secretKeyRef" in e.get("valueFrom", {})
                                else None) for e in container["env"]}


def test_gke_renders_a_run_of_several_processes_one_pod_each():
    """--processes=3: the lead pod (process 0, the bucket mounted, the trainer's chips)
    and an indexed Job of two slice pods whose roles, read as each process reads them,
    are processes 1 and 2 of three, all pointed at the lead's stable name."""
    from dora_jax.runtime import roles

    r = _run(*GKE, "--config=configs/tiny.py:spread", "--tpu=v5e-8", "--processes=3",
             "--name=dora-3p")
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    jobs = {j["name"]: j for j in js["spec"]["replicatedJobs"]}
    assert set(jobs) == {"lead", "slices"}
    [lead] = jobs["lead"]["template"]["spec"]["template"]["spec"]["containers"]
    slices_spec = jobs["slices"]["template"]["spec"]
    [sl] = slices_spec["template"]["spec"]["containers"]
    assert slices_spec["completionMode"] == "Indexed" and slices_spec["parallelism"] == 2
    assert lead["resources"]["limits"] == {"google.com/tpu": 4}  # the trainer's 2 x 2
    assert sl["resources"]["limits"] == {"google.com/tpu": 2}  # two slices of one chip
    lead_env, slice_env = _container_env(lead), _container_env(sl)
    assert "JAX_PLATFORMS" not in lead_env and lead_env["DORA_AUTHKEY"] == "k3y"
    assert roles.from_env(lead_env) == roles.Role(0, 3, ("dora-3p-lead-0-0.dora-3p", 8476))
    assert lead["command"][:3] == ["python", "-m", "dora_jax.main"]
    # The slice pod's shell gives process id = completion index + 1, then runs main.
    shell, flag, script, *main = sl["command"]
    assert (shell, flag) == ("bash", "-c") and main == lead["command"]
    for index in (0, 1):
        out = subprocess.run([shell, "-c", script, "env"], capture_output=True, text=True,
                             env={**slice_env, "JOB_COMPLETION_INDEX": str(index),
                                  "PATH": "/usr/bin:/bin"})
        env = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        assert roles.from_env(env).process_id == index + 1


def _pod_process_ids(container, indices):
    """The roles a pod's shell gives at each completion index, as main reads them."""
    from dora_jax.runtime import roles

    shell, flag, script, *main = container["command"]
    assert (shell, flag) == ("bash", "-c") and main[:3] == ["python", "-m", "dora_jax.main"]
    got = []
    for index in indices:
        out = subprocess.run([shell, "-c", script, "env"], capture_output=True, text=True,
                             env={**_container_env(container),
                                  "JOB_COMPLETION_INDEX": str(index), "PATH": "/usr/bin:/bin"})
        env = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        got.append(roles.from_env(env))
    return got


@pytest.mark.parametrize("accelerator", [["--tpu=v5e-8"],
                                         ["--gpu=nvidia-h100-80gb", "--gpus_per_host=4"]])
def test_gke_renders_a_trainer_over_several_pods(accelerator):
    """--processes=4 --trainer_processes=2: the lead and one more trainer pod (half the
    trainer's chips each, the workdir mounted: they read its checkpoints), then two
    slice pods; each pod's role, read as main reads it, is its own."""
    r = _run(*GKE, "--config=configs/tiny.py:spread", *accelerator, "--processes=4",
             "--trainer_processes=2", "--name=dora-4p")
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    pods = {j["name"]: j["template"]["spec"]["template"]["spec"]
            for j in js["spec"]["replicatedJobs"]}
    assert list(pods) == ["lead", "trainers", "slices"]
    [lead], [trainer], [sl] = (pods[k]["containers"] for k in pods)
    resource = "google.com/tpu" if "--tpu=v5e-8" in accelerator else "nvidia.com/gpu"
    for c, chips in ((lead, 2), (trainer, 2), (sl, 2)):  # trainer 2 x 2 / 2; 4 slices / 2
        assert c["resources"]["limits"] == {resource: chips}
    assert trainer["volumeMounts"] == lead["volumeMounts"]
    from dora_jax.runtime import roles

    assert roles.from_env(_container_env(lead)) == roles.Role(
        0, 4, ("dora-4p-lead-0-0.dora-4p", 8476), 2)
    [one] = _pod_process_ids(trainer, [0])
    assert one.process_id == 1 and one.trains and one.trainer_processes == 2
    slices = _pod_process_ids(sl, [0, 1])
    assert [s.process_id for s in slices] == [2, 3] and not any(s.trains for s in slices)
    assert slices[0].slice_ids_by_process(4) == {2: [0, 1], 3: [2, 3]}


@pytest.mark.parametrize("args, says", [
    (["--tpu=v5e-8", "--processes=4", "--trainer_processes=3"],
     "--trainer_processes=3 does not divide the trainer's 4 chips"),
    (["--tpu=v5e-8", "--processes=4"],
     "the 4 decode slices must split evenly over 3 slice processes"),
    (["--tpu=v5e-4", "--processes=3", "--config.mesh.trainer.data=4"],
     "each trainer process needs 8 chips, more than a v5e-4 host's 4"),
    (["--tpu=v5e-4", "--processes=3", "--config.mesh.colocated=True",
      "--config.coordinator.mode=sync"], "mesh.colocated: a run of several processes"),
])
def test_gke_several_processes_that_do_not_fit_are_one_line(args, says):
    r = _run(*GKE, "--config=configs/tiny.py:spread", *args)
    assert r.returncode == 1 and r.stdout == "" and says in r.stderr, r.stderr


def test_gke_renders_several_processes_on_gpu_nodes():
    r = _run(*GKE, "--config=configs/tiny.py:spread", "--gpu=nvidia-h100-80gb", "--gpus_per_host=4",
             "--processes=3")
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    pods = {j["name"]: j["template"]["spec"]["template"]["spec"]
            for j in js["spec"]["replicatedJobs"]}
    for name, gpus in (("lead", 4), ("slices", 2)):
        assert pods[name]["nodeSelector"] == {"cloud.google.com/gke-accelerator":
                                              "nvidia-h100-80gb"}
        assert pods[name]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    assert "as 3 processes" in js["metadata"]["annotations"]["dora-jax/devices"]
    # Pathways runs on TPU only: GPUs need --processes.
    r = _run(*GKE, "--config=configs/tiny.py:spread", "--gpu=nvidia-h100-80gb")
    assert r.returncode == 1 and "give --processes=N too" in r.stderr


def test_the_slurm_script_gives_each_task_its_role(tmp_path):
    """launchers/slurm.sh under stand-ins for scontrol, srun and python: each of four
    tasks starts main with the role its SLURM_PROCID gives, read as main reads it
    (DORA_TRAINER_PROCESSES=2: tasks 0 and 1 the trainer's, 2 and 3 slice processes),
    all pointed at the first node."""
    from dora_jax.runtime import roles

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        # srun runs its command once per task, as Slurm would on each node.
        "srun": 'shift; for i in $(seq 0 $((SLURM_NTASKS - 1))); do '
                'SLURM_PROCID=$i "$@"; done',
        "python": f'env > {tmp_path}/task$SLURM_PROCID.env; echo "$@" >> {tmp_path}/argv',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_NTASKS": "4", "DORA_TRAINER_PROCESSES": "2", "DORA_AUTHKEY": "k3y"}
    r = subprocess.run(["bash", str(REPO / "launchers/slurm.sh"), "--config=configs/tiny.py:spread",
                        "--workdir=/shared/run"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = []
    for task in range(4):
        lines = (tmp_path / f"task{task}.env").read_text().splitlines()
        task_env = dict(line.split("=", 1) for line in lines if "=" in line)
        assert task_env["DORA_AUTHKEY"] == "k3y"
        got.append(roles.from_env(task_env))
    assert got == [roles.Role(p, 4, ("node-a", 8476), 2) for p in range(4)]
    assert [r.trains for r in got] == [True, True, False, False]
    assert (tmp_path / "argv").read_text().splitlines() == [
        "-m dora_jax.main --config=configs/tiny.py:spread --workdir=/shared/run"] * 4
