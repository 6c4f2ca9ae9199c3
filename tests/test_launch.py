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
    return load_repo_config(spec, **{k.replace(".", "__"): v for k, v in overrides.items()})


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


@pytest.mark.parametrize("spec", SPECS)
def test_every_config_renders_a_jobset_that_parses_back(spec, needs_overrides):
    given = needs_overrides.get(spec, {})
    cfg = _load(spec, given)
    overrides = [f"--config.{k}={v}" for k, v in given.items()]
    devices = cfg.mesh.total_devices
    assert devices == cfg.mesh.trainer_devices + cfg.mesh.num_slices * cfg.mesh.slice_devices
    for t in _types_for(devices):
        job = jobset.job_spec(spec, overrides, cfg, t.name, image="img:1", workdir="gs://b/run",
                              name=jobset.default_name(spec), gcs_scratch="gs://b/tmp")
        js = jobset.render_jobset(job)
        assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
        assert js["metadata"]["name"] == job["name"]
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
        assert _flag(rm, "gcs_scratch_location") == "gs://b/tmp"
        main = head["main"]
        env = {e["name"]: e["value"] for e in main["env"]}
        assert env == {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://localhost:29000"}
        assert main["command"] == ["python", "-m", "dora_jax.main", f"--config={spec}",
                                   "--workdir=gs://b/run", *overrides]
        back = hf_checks.validated(jobset.parse_command(main["command"], root=str(REPO)))
        assert back == cfg


def test_parse_command_applies_the_overrides():
    cmd = jobset.main_command("configs/moe.py:tiny", "/w", ["--config.coordinator.max_staleness=1",
                                                            "--config.rollout.prefill_buckets=(8,32)"])
    back = hf_checks.validated(jobset.parse_command(cmd, root=str(REPO)))
    assert back.coordinator.max_staleness == 1 and back.rollout.prefill_buckets == (8, 32)
    assert back == load_repo_config("configs/moe.py:tiny", coordinator__max_staleness=1,
                                    rollout__prefill_buckets=(8, 32))
    assert back != load_repo_config("configs/moe.py:tiny")


def test_job_spec_refuses_a_bad_name_or_bucket():
    cfg = load_repo_config("configs/tiny.py")
    kw = dict(image="i", workdir="/w", name="dora-tiny", gcs_scratch="gs://b")
    jobset.job_spec("configs/tiny.py", [], cfg, "v5e-8", **kw)
    with pytest.raises(ValueError, match="DNS label"):
        jobset.job_spec("configs/tiny.py", [], cfg, "v5e-8", **dict(kw, name="Dora_Tiny"))
    with pytest.raises(ValueError, match="gs://"):
        jobset.job_spec("configs/tiny.py", [], cfg, "v5e-8", **dict(kw, gcs_scratch="/tmp"))
    with pytest.raises(ValueError, match="needs 8 devices.*v5e-16 has 16 chips"):
        jobset.job_spec("configs/tiny.py", [], cfg, "v5e-16", **kw)


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)


def test_gke_command_line():
    r = _run("-m", "dora_jax.launch.gke", "--config=configs/moe.py", "--tpu=v5p-128",
             "--config.coordinator.max_staleness=1")
    assert r.returncode == 0, r.stderr
    js = yaml.safe_load(r.stdout)
    worker = _worker(js)
    pod = worker["template"]["spec"]
    limits = pod["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (worker["replicas"], pod["parallelism"], limits["google.com/tpu"]) == (4, 16, 4)
    assert _chips(js) == 256
    command = _main(js)["command"]
    assert command[-1] == "--config.coordinator.max_staleness=1"
    back = hf_checks.validated(jobset.parse_command(command, root=str(REPO)))
    assert back.coordinator.max_staleness == 1
    assert back == load_repo_config("configs/moe.py", coordinator__max_staleness=1)


@pytest.mark.parametrize("args", [["--tpu=v5p-1024"], ["--tpu=v5p-96"],
                                  ["--tpu=v5p-128", "--config.coordinator.max_staleness=-1"],
                                  ["--tpu=v5p-128", "--config.coordinator.nope=1"]])
def test_gke_errors_are_one_line(args):
    r = _run("-m", "dora_jax.launch.gke", "--config=configs/moe.py", *args)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_xm_dry_run_and_missing_xmanager():
    r = _run("launchers/xm_launch.py", "--config=configs/tiny.py", "--tpu=v5e-8", "--dry_run")
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    assert out["executable"]["command"] == jobset.main_command(
        "configs/tiny.py", "/gcs/BUCKET/dora/dora-tiny", [])
    assert _main(out["jobset"])["command"] == out["executable"]["command"]
    assert (out["requirements"]["tpu"], out["requirements"]["num_tpu_slices"]) == ("v5e-8", 1)
    assert _chips(out["jobset"]) == out["requirements"]["devices"] == 8
    assert "XLA_FLAGS" not in out["env"] and out["env"]["JAX_PLATFORMS"] == "proxy"
    if importlib.util.find_spec("xmanager") is None:
        r = _run("launchers/xm_launch.py", "--config=configs/tiny.py", "--tpu=v5e-8")
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
    r = _run("-m", "dora_jax.launch.gke", "--config=configs/tiny.py", "--tpu=v5e-8", override)
    assert r.returncode == 0, r.stderr
    [js] = list(yaml.safe_load_all(r.stdout))  # exactly one document: the JobSet
    assert js["kind"] == "JobSet" and js["apiVersion"].startswith("jobset.x-k8s.io/")
    assert _main(js)["command"][-1] == override  # the value verbatim
    # How the file was made is kept inside the document, where it is only data.
    made = js["metadata"]["annotations"]["dora-jax/command"]
    assert shlex.split(made)[-1] == override
    assert "8 chips" in js["metadata"]["annotations"]["dora-jax/devices"]
    assert "edit BUCKET" in r.stderr  # the reminder stays out of the file
    r = _run("launchers/xm_launch.py", "--config=configs/tiny.py", "--tpu=v5e-8",
             "--dry_run", override)
    assert r.returncode == 0, r.stderr
    [out] = list(yaml.safe_load_all(r.stdout))
    assert out["executable"]["command"][-1] == override
    assert _main(out["jobset"])["command"][-1] == override
