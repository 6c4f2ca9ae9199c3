"""Where a launched run keeps and reads its files: a Cloud Storage bucket mounted in
the head pod through the GCS FUSE CSI driver (`storage`: the workdir under the mount,
checkpoints at the same place as a gs:// URL, which Orbax writes directly), and the
files the run reads named as the container sees them (`mounted`,
`container_overrides`). Plain strings; nothing is read or contacted.
"""

from __future__ import annotations

import posixpath
import re


def storage(bucket: str, workdir: str, mount_path: str = "") -> dict:
    """Where the run keeps its files: the bucket, mounted at `mount_path` (default
    /gcs/BUCKET) in the head pod through the GCS FUSE CSI driver; the workdir, a
    path under the mount (the run writes it with plain file I/O); and the
    checkpoint directory, the same place as a gs:// URL, so that Orbax writes there
    directly. A restarted pod mounts the same bucket and resumes from it.
    ValueError for a malformed bucket or a workdir outside the mount."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket or ""):
        raise ValueError(f"--bucket {bucket!r} is not a Cloud Storage bucket name (3 to 222 "
                         "lowercase letters, digits, '-', '_' or '.', e.g. my-bucket)")
    mount = posixpath.normpath(mount_path or f"/gcs/{bucket}")
    if not mount.startswith("/"):
        raise ValueError(f"--mount_path must be absolute, got {mount_path!r}")
    if workdir.startswith("gs://"):
        raise ValueError(f"--workdir {workdir!r}: the run writes its workdir with plain file "
                         f"I/O; give its path under the bucket's mount, e.g. {mount}/...")
    workdir = posixpath.normpath(workdir)
    rel = posixpath.relpath(workdir, mount)
    if rel == "." or rel.startswith(".."):
        raise ValueError(f"--workdir {workdir!r} is not under the bucket's mount {mount}: a "
                         "restarted pod would not find its checkpoints there")
    return {"bucket": bucket, "mount_path": mount, "workdir": workdir,
            "checkpoint_dir": f"gs://{bucket}/{rel}/checkpoints"}


# The files a run reads with plain file I/O (checkpoint, tokenizer, data, SFT params).
FILE_FIELDS = ("model.checkpoint", "data.tokenizer", "data.path", "init_checkpoint")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def mounted(value: str, store: dict, what: str = "a path") -> str:
    """`value` as the container reads it: a gs:// URL of the mounted bucket becomes
    its path under the mount; a URL of another bucket is a ValueError (dora_jax reads
    these files through the file system, and only the workdir's bucket is mounted)."""
    prefix = f"gs://{store['bucket']}"
    if value == prefix or value.startswith(prefix + "/"):
        return store["mount_path"] + value[len(prefix):]
    if "://" in value:
        raise ValueError(f"{what} {value!r}: the run reads it through the file system and "
                         f"only gs://{store['bucket']} is mounted (at {store['mount_path']})")
    return value


def container_overrides(cfg, overrides: list[str], store: dict) -> list[str]:
    """`overrides` with every file the run reads (FILE_FIELDS) named as the container
    sees it (`mounted`): an override's gs:// URL of the bucket is replaced by its path
    under the mount; one the config file gives becomes one more override."""
    out, given = [], set()
    for item in overrides:
        m = re.fullmatch(r"--?config\.([a-z_.]+)=(.*)", item, re.S)
        if m and m[1] in FILE_FIELDS:
            given.add(m[1])
            item = f"--config.{m[1]}={mounted(m[2], store, f'config.{m[1]}')}"
        out.append(item)
    for field in FILE_FIELDS:
        value = _get(cfg, field)
        if field not in given and value and mounted(value, store, f"config.{field}") != value:
            out.append(f"--config.{field}={mounted(value, store)}")
    return out
