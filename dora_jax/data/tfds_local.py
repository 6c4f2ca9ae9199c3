"""A TFDS dataset built from local GSM8K- or MATH-format JSONL, read as prompt records.

`prepare` writes the dataset `jsonl_qa/<name>` into a data_dir as array_record files
(no TensorFlow needed, nothing downloaded); `tfds_records` reads it back through
`tfds.data_source` as text records (data/text_records.py). Each example holds
`id`, `question`, `answer` (the final answer, already extracted) and `verifier`
("gsm8k" or "math"), in the file's order.

    python -m dora_jax.data.tfds_local --jsonl=train.jsonl [--jsonl=test=test.jsonl] \\
        --data_dir=DIR [--name=gsm8k] [--format=gsm8k|math] [--overwrite]
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from fractions import Fraction

import tensorflow_datasets as tfds

from dora_jax.data import prompts, text_records
from dora_jax.rewards import verifiers

DATASET = "jsonl_qa"


# tfds is not read by mypy (pyproject.toml): its base's __init_subclass__ is unknown to it.
class JsonlQa(tfds.core.GeneratorBasedBuilder, skip_registration=True):  # type: ignore[call-arg]
    """Question/answer pairs from local JSONL files, one split per file.

    Not registered with TFDS by class (a module run as a script would register it
    twice); the prepared files are self-describing, so `tfds.data_source` reads them
    from the data_dir alone.
    """

    name = DATASET
    VERSION = tfds.core.Version("1.0.0")
    # TFDS looks beside the builder's code for download checksums; this builder
    # downloads nothing. (That look-up also needs the `importlib_resources` backport
    # under tfds 4.9.10 for a builder defined inside a package.)
    code_path = None

    def __init__(self, *, jsonl_paths: Mapping[str, str] | None = None,
                 format: str = "gsm8k", **kwargs):
        self._jsonl_paths = dict(jsonl_paths or {})
        self._format = format
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            description="Question/answer pairs from local JSONL files.",
            features=tfds.features.FeaturesDict({"id": text, "question": text,
                                                 "answer": text, "verifier": text}),
            # The file's order: a run's prompt order is then the same as from JSONL.
            disable_shuffling=True)

    def _split_generators(self, dl_manager):
        if not self._jsonl_paths:
            raise ValueError("JsonlQa needs jsonl_paths to build")
        return {split: self._generate_examples(path)
                for split, path in self._jsonl_paths.items()}

    def _generate_examples(self, path):
        for key, (_, prompt_id, question, answer) in enumerate(
                text_records.read_qa_jsonl(path, self._format)):
            yield key, {"id": prompt_id, "question": question, "answer": answer,
                        "verifier": self._format}


def default_name(path: str) -> str:
    """A TFDS config name from a file name: `GSM8K-train.jsonl` -> `gsm8k_train`."""
    stem = os.path.basename(path).split(".")[0]
    return re.sub(r"[^a-z0-9_]+", "_", stem.lower()).strip("_") or "data"


def prepare(jsonl_path: str | Mapping[str, str], data_dir: str, *, name: str | None = None,
            format: str = "gsm8k", overwrite: bool = False) -> str:
    """Builds `jsonl_qa/<name>` in `data_dir` from a JSONL file (the "train" split)
    or from {split: path}; returns the TFDS name for `tfds_records`.

    A bad line raises DataError naming file and line. An existing build is reused
    unless `overwrite`.
    """
    paths = {"train": jsonl_path} if isinstance(jsonl_path, str) else dict(jsonl_path)
    if not paths:
        raise ValueError("no JSONL files given")
    if format not in text_records.FORMATS:
        raise ValueError(f"unknown format {format!r}; known: {text_records.FORMATS}")
    name = name or default_name(next(iter(paths.values())))
    builder = JsonlQa(jsonl_paths=paths, format=format, data_dir=data_dir,
                      file_format="array_record",
                      config=tfds.core.BuilderConfig(name=name,
                                                     description=f"{format} JSONL"))
    mode = (tfds.download.GenerateMode.FORCE_REDOWNLOAD if overwrite
            else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(download_mode=mode))
    return f"{DATASET}/{name}"


def _is_number(text: str) -> bool:
    try:
        Fraction(text.replace(",", "").replace("$", "").strip())
    except (ValueError, ZeroDivisionError):
        return False
    return True


def _text(example: dict, field: str, where: str) -> str:
    """A text feature of a stored example (bytes from the array_record files)."""
    if field not in example:
        raise prompts.DataError(f"{where}: no {field!r} feature")
    value = example[field]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise prompts.DataError(f"{where}: {field!r} is not valid UTF-8 (byte "
                                    f"{e.start})") from None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise prompts.DataError(f"{where}: {field!r} must be text, got {type(value).__name__}")
    return str(value)


def tfds_records(name: str, split: str, data_dir: str | None, tokenizer, *,
                 verifier: str = "gsm8k", instruction: str | None = None,
                 system_prompt: str | None = None, vocab_size: int | None = None,
                 source=None) -> prompts.TfdsSource:
    """Random-access prompt records of a prepared TFDS dataset with `question` and
    `answer` features (nothing is downloaded).

    Keys as a GSM8K-format record's: prompt_id (the `id` feature, else
    `<name>/<split>:<index>`), tokens, question, answer, verifier (the `verifier`
    feature, else `verifier`). An answer still in solution form (`... #### N` for
    gsm8k, a `\\boxed{}` for math) is reduced to its final answer.
    """

    def to_record(example: dict, index: int) -> prompts.Record:
        where = f"{name}/{split}[{index}]"
        kind = _text(example, "verifier", where) if "verifier" in example else verifier
        answer = _text(example, "answer", where)
        if kind == "gsm8k" and "####" in answer:
            answer = verifiers.extract_gsm8k_answer(answer) or ""
        elif kind == "math" and "\\boxed" in answer:
            answer = verifiers.extract_boxed(answer) or ""
        if not answer:
            raise prompts.DataError(f"{where}: no final answer")
        if kind == "gsm8k" and not _is_number(answer):
            raise prompts.DataError(f"{where}: answer {answer!r} is not a number")
        prompt_id = _text(example, "id", where) if "id" in example else f"{name}/{split}:{index}"
        return text_records.make_record(
            tokenizer, prompt_id, _text(example, "question", where), answer, kind,
            instruction=instruction, system_prompt=system_prompt, where=where,
            vocab_size=vocab_size)

    return prompts.TfdsSource(name, split, to_record, data_dir=data_dir, source=source)


def main(argv: list[str] | None = None) -> None:
    """The command line: prepares `jsonl_qa/<name>` and prints its name and sizes."""
    parser = argparse.ArgumentParser(
        prog="python -m dora_jax.data.tfds_local",
        description="Build a TFDS dataset (array_record) from local GSM8K/MATH JSONL.")
    parser.add_argument("--jsonl", action="append", required=True, metavar="[SPLIT=]FILE",
                        help="a JSONL file, for split 'train' unless SPLIT= is given; "
                             "repeat for more splits")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--name", default=None, help="config name (default: from the file name)")
    parser.add_argument("--format", choices=text_records.FORMATS, default="gsm8k")
    parser.add_argument("--overwrite", action="store_true", help="rebuild an existing dataset")
    args = parser.parse_args(argv)
    paths: dict[str, str] = {}
    for spec in args.jsonl:
        split, eq, path = spec.partition("=")
        if not eq or not re.fullmatch(r"[a-z][a-z0-9_]*", split):
            split, path = "train", spec
        if split in paths:
            parser.error(f"split {split!r} given twice")
        paths[split] = path
    try:
        full = prepare(paths, args.data_dir, name=args.name, format=args.format,
                       overwrite=args.overwrite)
    except prompts.DataError as e:
        raise SystemExit(f"error: {e}") from None
    sizes = {split: len(tfds.data_source(full, split=split, data_dir=args.data_dir,
                                         download=False)) for split in paths}
    print(f"{full} in {args.data_dir}: " + ", ".join(f"{s}={n}" for s, n in sizes.items()))


if __name__ == "__main__":
    main()
