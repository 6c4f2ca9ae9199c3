"""What every command line of the package shares (main, sft, export): flag parsing
that reports a bad flag or config in one line, the --config flag, validation before
any compute, CPU device faking before JAX starts, and one exception policy.

The policy: the errors a user can fix — an invalid config, bad data, a missing or
damaged checkpoint or file — end the program with one line `error: ...` and no
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import re

from absl import flags
from ml_collections import config_flags


def define_config_flag(lock: bool = False):
    """The --config flag (configs/x.py[:variant]), required."""
    holder = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                             lock_config=lock)
    flags.mark_flag_as_required("config")
    return holder


def _last_line(error) -> str:
    return [line.strip() for line in str(error).splitlines() if line.strip()][-1]


def parse_flags(argv):
    """absl's parsing, with a bad flag or config file reported in one line (pass as
    `app.run(main, flags_parser=parse_flags)`)."""
    try:
        return flags.FLAGS(argv)
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


def user_errors() -> tuple:
    """The exception types that end a program with one line (module docstring)."""
    from dora_jax import config as config_lib
    from dora_jax.data.prompts import DataError
    from dora_jax.model.hf_config import CheckpointError

    return (config_lib.ConfigError, DataError, CheckpointError, FileNotFoundError)


@contextlib.contextmanager
def one_line_errors():
    """Turns a user's error (`user_errors`) into `SystemExit("error: ...")`."""
    try:
        yield
    except user_errors() as e:
        raise SystemExit(f"error: {e}") from None


def validated_config(holder, *, with_pretrained: bool = False):
    """The --config ConfigDict validated into a Config, before any compute: the
    Hugging Face checkpoint and tokenizer it names are read once
    (model/hf_checks.check_pretrained), then the config is validated (a pure check).
    A file that does not load or a config that does not validate ends in one line.
    With `with_pretrained`, returns (Config, hf_checks.Pretrained): the run reuses
    the tokenizer read here."""
    from dora_jax import config as config_lib
    from dora_jax.model import hf_checks

    try:
        value = holder.value
        value.to_dict()  # a file that failed to load fails here, not later
    except (OSError, ValueError, SyntaxError) as e:
        raise SystemExit(f"error: --config could not be loaded: {_last_line(e)}") from None
    with one_line_errors():
        pretrained = hf_checks.check_pretrained(value)
        cfg = config_lib.validate(value, pretrained=pretrained)
    return (cfg, pretrained) if with_pretrained else cfg


def start_devices(cfg) -> None:
    """On a host without an accelerator, fakes the config's devices on the CPU (before
    JAX starts; a note says so), starts Pathways when proxied, and checks the device
    count the config needs."""
    from dora_jax import config as config_lib
    from dora_jax import devices

    note = devices.fake_cpu_devices_if_needed(cfg.mesh.total_devices)
    if note:
        print(note)
    devices.start_pathways_if_proxied()
    import jax

    with one_line_errors():
        config_lib.check_devices(cfg, jax.device_count())
