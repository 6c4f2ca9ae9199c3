"""What every command line of the package shares (main, sft, export, serve): flag
parsing that reports a bad flag or config in one line, the --config flag, validation
of the config and --workdir before any compute, CPU device faking before JAX starts,
and one exception policy.

The policy: the errors a user can fix — an invalid config or flag, bad data, a missing
or damaged checkpoint or file — end the program with one line `error: ...` and no
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from absl import flags
from ml_collections import config_flags

if TYPE_CHECKING:
    from dora_jax.config import Config, DataConfig
    from dora_jax.runtime.roles import Role


def define_config_flag(lock: bool = False) -> Any:
    """The --config flag (configs/x.py[:variant], or a shipped config's name), required."""
    holder = config_flags.DEFINE_config_file(
        "config", None, "configs/x.py[:variant], or a shipped config by name (tiny, "
        "moe:tiny, ...)", lock_config=lock)
    flags.mark_flag_as_required("config")
    return holder


# --config as the user wrote it (a shipped config's name is passed on as its path):
# messages name it as written. And its file, resolved once: a later resolve could find
# a directory the run made since (`--config=moe --workdir=moe`).
_config_spec = None
_config_file = None


def _resolve_config_names(argv: Sequence[str]) -> list[str]:
    """argv with `--config=NAME[:variant]` (or `--config NAME`) of a shipped config
    made its file's path (config_flags loads files only); a spec that names nothing
    ends in one line."""
    global _config_spec, _config_file
    from dora_jax import configs

    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            spec, at = arg.partition("=")[2], i
        elif arg == "--config" and i + 1 < len(argv):
            spec, at = argv[i + 1], i + 1
        else:
            continue
        why = configs.unknown(spec)
        if why:
            raise SystemExit(f"error: {why}")
        resolved = configs.resolve(spec)
        _config_spec, _config_file = spec, resolved.partition(":")[0]
        argv[at] = ("--config=" if at == i else "") + resolved
    return argv


def _last_line(error: object) -> str:
    return [line.strip() for line in str(error).splitlines() if line.strip()][-1]


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's parsing, with a bad flag or config file reported in one line (pass as
    `app.run(main, flags_parser=parse_flags)`)."""
    try:
        return flags.FLAGS(_resolve_config_names(argv))
    except SystemExit:  # absl's --help prints and exits 1: asking for help is no error
        if any(a in ("-h", "-?", "--help", "--helpshort", "--helpfull") for a in argv):
            raise SystemExit(0) from None
        raise
    except flags.Error as e:  # config_flags embeds the config file's traceback
        first, last = str(e).splitlines()[0].rstrip(":"), _last_line(e)
        raise SystemExit(f"error: {first}" + ("" if last == first else f": {last}")) from None
    except (AttributeError, KeyError) as e:  # --config.<path> naming no field
        # ml_collections' message quotes the name, then perhaps 'Did you mean "x"'.
        quoted = re.findall(r"""[\\]?["']([A-Za-z_]\w*)[\\]?["']""", str(e))
        name = quoted[0] if quoted else _last_line(e)
        bad = [a.split("=")[0] for a in argv if a.startswith("--config.")
               and name in a.split("=")[0].split(".")[1:]]
        hint = f' (did you mean "{quoted[1]}"?)' if len(quoted) > 1 else ""
        raise SystemExit(f"error: {bad[0] if bad else name}: no such config field{hint}") \
            from None


class FlagError(ValueError):
    """A flag's value is unusable; the message names the flag."""


def user_errors() -> tuple:
    """The exception types that end a program with one line (module docstring)."""
    from dora_jax import config as config_lib
    from dora_jax.base.untrusted_files import UntrustedFileError
    from dora_jax.data.prompts import DataError
    from dora_jax.model.hf_config import CheckpointError

    return (config_lib.ConfigError, FlagError, DataError, CheckpointError,
            UntrustedFileError, FileNotFoundError)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Turns a user's error (`user_errors`) into `SystemExit("error: ...")`."""
    try:
        yield
    except user_errors() as e:
        raise SystemExit(f"error: {e}") from None


def validated_config(holder: Any, *, with_pretrained: bool = False) -> Any:
    """The --config ConfigDict validated into a Config, before any compute: the
    Hugging Face checkpoint and tokenizer it names are read once
    (model/hf_checks.check_pretrained), then the config is validated (a pure check).
    A file that does not load or a config that does not validate ends in one line.
    With `with_pretrained`, returns (Config, hf_checks.Pretrained): the run reuses
    the tokenizer read here."""
    from dora_jax import config as config_lib
    from dora_jax import tasks
    from dora_jax.model import hf_checks

    tasks.names()  # every task module in the package declares itself to config
    try:
        value = holder.value
        value.to_dict()  # a file that failed to load fails here, not later
    except (OSError, ValueError, SyntaxError) as e:
        raise SystemExit(f"error: --config could not be loaded: {_last_line(e)}") from None
    with one_line_errors():
        pretrained = hf_checks.check_pretrained(value)
        cfg = config_lib.validate(value, pretrained=pretrained)
        d = cfg.data
        # The sources that read data.path: a missing file is named now, not after the
        # devices and model have started.
        if config_lib.TASKS[d.source].needs == "path" and not os.path.exists(d.path):
            config_lib.fail("data.path", f"no such file: {d.path} (a JSONL file of prompts: "
                                         "--config.data.path=FILE)")
        if d.source == "env":
            _check_sandbox(d)
    return (cfg, pretrained) if with_pretrained else cfg


def workdir_to_write(path: str, flag: str = "--workdir") -> str:
    """`path` as a directory this process writes in, checked before any compute (the
    run would otherwise fail at its first write, after the devices and model
    started): made if missing, then one line naming `flag` if something is in the
    way, it cannot be made (a file among its parents, no permission) or it is not
    writable. As root, permission bits do not stop a write, so neither do they here."""
    with one_line_errors():
        if os.path.lexists(path) and not os.path.isdir(path):
            raise FlagError(f"{flag}: {path} exists and is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise FlagError(f"{flag}: cannot create {path}: {e.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise FlagError(f"{flag}: {path} is not writable by this user")
    return path


def workdir_to_read(path: str, flag: str = "--workdir") -> str:
    """`path` as the directory of a run to read, checked before any compute: one line
    naming `flag` if it is missing, not a directory or not readable."""
    with one_line_errors():
        if not os.path.lexists(path):
            raise FlagError(f"{flag}: no such directory: {path}")
        if not os.path.isdir(path):
            raise FlagError(f"{flag}: {path} is not a directory")
        if not os.access(path, os.R_OK | os.X_OK):
            raise FlagError(f"{flag}: {path} is not readable by this user")
    return path


def _check_sandbox(d: DataConfig) -> None:
    """Fails closed: a tool that runs the model's code needs its sandbox's layers."""
    from dora_jax import config as config_lib
    from dora_jax import envs
    from dora_jax.envs import sandbox

    if envs.get(d.env).sandbox_isolation is None:
        return
    try:
        sandbox.require(d.env_isolation)
    except sandbox.SandboxUnavailable as e:
        config_lib.fail("data.env_isolation", str(e))


def _cpu_variant(spec: str | None, file: str | None) -> str | None:
    """`spec`'s CPU variant where its config (`file`) declares one: `tiny_<variant>`,
    else `tiny` (configs/moe.py:lora -> moe.py:tiny_lora, moe.py -> moe.py:tiny)."""
    if not spec or not file:
        return None
    path, _, variant = spec.partition(":")
    module_vars: dict[str, Any] = {}
    try:
        with open(file) as f:  # its VARIANTS, without building it
            exec(f.read().split("\ndef get_config")[0], module_vars)
    except (OSError, SyntaxError, ImportError):
        return None
    variants = module_vars.get("VARIANTS", ())
    if variant.startswith("tiny"):
        return None
    tiny = f"tiny_{variant}" if f"tiny_{variant}" in variants else "tiny"
    return f"{path}:{tiny}" if tiny in variants else None


def _too_few_devices(cfg: Config, available: int, backend: str) -> str:
    """The one line for a config whose meshes need more devices than the host has:
    how many each side needs, and what to run here instead."""
    from dora_jax.config import devices

    mesh, needed = cfg.mesh, cfg.mesh.total_devices
    split = f"trainer {mesh.trainer_devices}" + (
        "" if mesh.colocated else f" + {mesh.num_slices} decode slices x {mesh.slice_devices}")
    instead = []
    cpu_variant = _cpu_variant(_config_spec, _config_file)
    if cpu_variant:
        instead.append(f"run {cpu_variant} here")
    if backend == "cpu" and needed <= devices.MAX_FAKE_CPU_DEVICES:
        instead.append(f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} to "
                       "fake them on a CPU")
    if not instead:
        instead.append("run a smaller config here, e.g. configs/tiny.py")
    return (f"error: config.mesh: {_config_spec or 'the config'} needs {needed} devices "
            f"({split}), but this host has {available} ({backend}): " + ", or ".join(instead))


def start_devices(cfg: Config) -> None:
    """On a host without an accelerator, fakes the config's devices on the CPU (before
    JAX starts; a note says so), starts Pathways when proxied, and checks the device
    count the config needs (one line saying what to run here when it is short)."""
    from dora_jax.config import devices

    role = process_role(cfg)
    try:
        needed = role.devices_needed(cfg.mesh)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    note = devices.fake_cpu_devices_if_needed(needed)
    if note:
        print(note)
    devices.start_pathways_if_proxied()
    if role.trains and role.trainer_processes > 1:
        # As long as a slice process may be silent before its slices count as lost.
        devices.join_trainer_processes(
            role.trainer_service, role.trainer_processes, role.process_id,
            heartbeat_timeout=max(30.0, (cfg.coordinator.stall_timeout or 600.0) / 10))
    import jax

    have = jax.local_device_count() if role.multi else jax.device_count()
    if needed > have:
        raise SystemExit(_too_few_devices(cfg, have, jax.default_backend()))


def process_role(cfg: Config) -> Role:
    """This process's part of the run (runtime/roles.py), checked against the config:
    one line naming what a run of several processes cannot do yet."""
    from dora_jax import config as config_lib
    from dora_jax.runtime import roles

    try:
        role = roles.from_env()
        if role.multi:
            role.slice_ids_by_process(cfg.mesh.num_slices)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if role.multi:
        with one_line_errors():
            for field, on, why in [
                    ("mesh.colocated", cfg.mesh.colocated, "the trainer and the slices "
                     "take turns on the same devices, which one process owns"),
                    ("eval.every", cfg.eval.every, "evaluations run on a slice of the "
                     "trainer's process, and it has none"),
                    ("data.source", cfg.data.source == "env", "multi-turn episodes do not "
                     "move between processes yet")]:
                if on:
                    config_lib.fail(field, f"a run of {role.num_processes} processes "
                                           f"cannot use it: {why}")
    return role
