"""What ``shard_dataset`` does, without KFP: count a dataset's samples, cut them into shards.

A dataset is named by one string:

| form | samples |
|---|---|
| ``""`` (empty) | ``dataset(split)`` of the ``model_def`` module (what the workers train on) |
| ``example:digits`` | the built-in example (8x8 digits, ``kfp_elastic.worker.examples.digits``) |
| ``model-def:pkg.module`` | ``dataset(split)`` of that module |
| ``/path/dir`` | one sample per regular file below it (recursive, hidden files skipped) |
| ``/path/f.jsonl``, ``.ndjson``, ``.txt`` | one sample per non-empty line |
| ``/path/f.csv``, ``.tsv`` | one sample per non-empty line after the header |
| ``/path/f.npy`` | the array's first dimension |
| ``/path/f.pt``, ``.pth`` | ``len()`` of the saved tensor or sequence |

``file://`` URIs are paths. Other schemes (``gs://``, ``s3://``, ``http://``) are refused: mount
the data (a PVC, gcsfuse's ``/gcs/...``) and give the path. Whatever the form, the workers'
``model_def.dataset("train")`` must have exactly as many samples: ``elastic_train`` checks it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kfp_elastic.contract.data_plan import Shard

MANIFEST_FORMAT = "kfp-elastic/shard-manifest/v1"
DEFAULT_NUM_SHARDS = 16
EXAMPLES = {"digits": "kfp_elastic.worker.examples.digits"}
_LINES = {".jsonl", ".ndjson", ".txt"}
_TABLES = {".csv", ".tsv"}
_TORCH = {".pt", ".pth"}


def resolve(dataset: str, model_def: str) -> tuple[str, str]:
    """``(kind, where)``: ``("model-def", module)`` or ``("path", local path)``."""
    text = (dataset or "").strip()
    if not text:
        if not (model_def or "").strip():
            raise ValueError(
                "dataset is empty and no model_def is given: name a dataset "
                "(a path, example:digits or model-def:pkg.module)"
            )
        return "model-def", model_def.strip()
    if text.startswith("example:"):
        name = text.split(":", 1)[1]
        if name not in EXAMPLES:
            raise ValueError(
                f"unknown example dataset {name!r}; built-in: "
                f"{', '.join('example:' + n for n in EXAMPLES)}"
            )
        return "model-def", EXAMPLES[name]
    if text.startswith("model-def:"):
        return "model-def", text.split(":", 1)[1].strip()
    parsed = urlparse(text)
    if parsed.scheme == "file":
        return "path", parsed.path
    if len(parsed.scheme) > 1:  # one letter: a Windows drive, not a scheme
        raise ValueError(
            f"dataset {text!r}: {parsed.scheme}:// is not read directly; mount it "
            "(a PVC, or gcsfuse's /gcs/...) and give the local path"
        )
    return "path", text


def count_samples(dataset: str, model_def: str = "", split: str = "train") -> int:
    kind, where = resolve(dataset, model_def)
    if kind == "model-def":
        from kfp_elastic.worker.model_def import load_model_def

        return len(load_model_def(where).dataset(split))
    return count_path(Path(where))


def count_path(path: Path) -> int:
    if not path.exists():
        raise ValueError(f"dataset path {path} does not exist")
    if path.is_dir():
        return sum(
            1
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    suffix = path.suffix.lower()
    if suffix in _LINES | _TABLES:
        with path.open("rb") as stream:
            lines = sum(1 for line in stream if line.strip())
        return max(0, lines - 1) if suffix in _TABLES else lines
    if suffix == ".npy":
        import numpy

        return int(numpy.load(path, mmap_mode="r").shape[0])
    if suffix in _TORCH:
        import torch

        return _length(torch.load(path, map_location="cpu", weights_only=True), path)
    known = sorted(_LINES | _TABLES | _TORCH | {".npy"})
    raise ValueError(
        f"dataset file {path}: cannot count samples of {suffix or 'no suffix'!r} "
        f"files; use a directory or one of {', '.join(known)}"
    )


def _length(value: Any, path: Path) -> int:
    if hasattr(value, "shape"):
        return int(value.shape[0]) if len(value.shape) else 0
    if isinstance(value, dict):
        lengths = {_length(v, path) for v in value.values()}
    elif isinstance(value, tuple) and value and all(hasattr(v, "shape") for v in value):
        lengths = {_length(v, path) for v in value}  # (features, labels)
    else:
        return len(value)
    if len(lengths) > 1:
        raise ValueError(f"dataset file {path}: its tensors have different lengths {lengths}")
    return lengths.pop() if lengths else 0


def plan_shards(length: int, num_shards: int = 0, shard_size: int = 0) -> list[Shard]:
    """Contiguous shards covering ``range(length)``: ``num_shards`` of (almost) equal size, or
    shards of ``shard_size`` samples (the last one shorter); neither: 16 shards."""
    if length < 1:
        raise ValueError("the dataset is empty: nothing to train on")
    if num_shards < 0 or shard_size < 0:
        raise ValueError(f"num_shards and shard_size must be >= 0, got {num_shards}, {shard_size}")
    if num_shards and shard_size:
        raise ValueError("give num_shards or shard_size, not both")
    if shard_size:
        return [
            Shard(i, start, min(start + shard_size, length))
            for i, start in enumerate(range(0, length, shard_size))
        ]
    count = num_shards or min(DEFAULT_NUM_SHARDS, length)
    if count > length:
        raise ValueError(f"num_shards={count} is more than the {length} samples of the dataset")
    bounds = [i * length // count for i in range(count + 1)]
    return [Shard(i, bounds[i], bounds[i + 1]) for i in range(count)]


def build_manifest(
    dataset: str,
    model_def: str = "",
    split: str = "train",
    num_shards: int = 0,
    shard_size: int = 0,
) -> dict[str, Any]:
    """The manifest ``kfp-elastic master --shard-manifest`` reads (``shards``) plus what it was
    made from."""
    kind, where = resolve(dataset, model_def)
    length = count_samples(dataset, model_def, split)
    if length < 1:
        raise ValueError(
            f"dataset {dataset or model_def!r} (split {split!r}) has no samples: "
            "nothing to train on"
        )
    shards = plan_shards(length, num_shards, shard_size)
    return {
        "format": MANIFEST_FORMAT,
        "shards": [[s.shard_id, s.start, s.end] for s in shards],
        "num_samples": length,
        "num_shards": len(shards),
        "source": where,
        "source_kind": kind,
        "split": split,
    }


def read_manifest(path: str | Path) -> tuple[list[Shard], dict[str, Any]]:
    """Shards and the whole document of a manifest file; ``ValueError`` if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        shards = [Shard(*map(int, row)) for row in data["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"shard manifest {path} is unreadable: {error}") from error
    check_shards(shards)
    return shards, data


def check_shards(shards: Sequence[Shard]) -> None:
    """The shards must tile ``range(total)`` without gaps or overlaps (any order)."""
    if not shards:
        raise ValueError("the shard manifest has no shards: nothing to train on")
    covered = sorted((s.start, s.end) for s in shards)
    position = 0
    for start, end in covered:
        if start != position or end <= start:
            raise ValueError(
                f"shard [{start}, {end}) leaves a gap, overlaps or is empty: shards must tile 0..N"
            )
        position = end
    if len({s.shard_id for s in shards}) != len(shards):
        raise ValueError("shard ids in the manifest are not unique")
