"""Compile every component and the pipeline into the YAML files committed next to them.

kfp-elastic compile           # rewrite the YAML files
kfp-elastic compile --check   # exit 1 if a committed file differs from a compile

The check ignores what only kfp's patch release changes (the `sdkVersion` stamp): YAML compiled
with kfp 2.17.0 is current under 2.17.3 as long as every component and the pipeline are the same.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kfp import compiler

ROOT = Path(__file__).resolve().parent.parent


def targets() -> dict[Path, Callable]:
    """Committed YAML file → the component or pipeline compiled into it."""
    from kfp_elastic.components.elastic_train.component import elastic_train
    from kfp_elastic.components.evaluate.component import evaluate
    from kfp_elastic.components.shard_dataset.component import shard_dataset
    from kfp_elastic.components.stop_workers.component import stop_workers
    from kfp_elastic.pipelines.elastic_training import elastic_training

    return {
        ROOT / "components/shard_dataset/component.yaml": shard_dataset,
        ROOT / "components/elastic_train/component.yaml": elastic_train,
        ROOT / "components/evaluate/component.yaml": evaluate,
        ROOT / "components/stop_workers/component.yaml": stop_workers,
        ROOT / "pipelines/elastic_training.yaml": elastic_training,
    }


def compile_to(func: Callable, path: Path) -> str:
    compiler.Compiler().compile(func, str(path))
    return path.read_text()


# `sdkVersion: kfp-2.17.3` → `sdkVersion: kfp-2.17`: the only line of a compile that varies
# with kfp's patch release (a minor release may change the spec, so it still counts).
_SDK_PATCH = re.compile(r"^(sdkVersion: kfp-\d+\.\d+)\.\S+$", re.MULTILINE)


def comparable(compiled: str) -> str:
    """A compiled YAML text without what varies only with kfp's patch release."""
    return _SDK_PATCH.sub(r"\1", compiled)


def same_compile(committed: str, fresh: str) -> bool:
    """Whether a committed YAML is current: equal to a fresh compile up to kfp's patch release."""
    return comparable(committed) == comparable(fresh)


def stale() -> list[Path]:
    """Committed files that differ from a fresh compile (beyond kfp's patch release)."""
    differ = []
    with tempfile.TemporaryDirectory() as tmp:
        for path, func in targets().items():
            fresh = compile_to(func, Path(tmp) / path.name)
            if not path.exists() or not same_compile(path.read_text(), fresh):
                differ.append(path)
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kfp-elastic compile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for path in differ:
            print(f"stale: {path.relative_to(ROOT)} (run kfp-elastic compile)")
        return 1 if differ else 0
    for path, func in targets().items():
        compile_to(func, path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
