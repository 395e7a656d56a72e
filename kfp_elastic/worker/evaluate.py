"""Evaluate a trained model of a ``--model-def`` on its test split (accuracy, loss, confusion).

kfp-elastic evaluate --model-def kfp_elastic.worker.examples.digits --model model.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kfp_elastic.job_spec import DEFAULT_DEVICE, DEVICES
from kfp_elastic.worker.device import DeviceError, device_of_this_process, to_device
from kfp_elastic.worker.model_def import ModelDefError, load_model_def


@dataclass
class Evaluation:
    samples: int
    loss: float
    accuracy: float
    labels: list[str] = field(default_factory=list)
    confusion: list[list[int]] = field(default_factory=list)  # rows: true, columns: predicted


def evaluate(
    model_def_name: str,
    model_path: str | Path,
    split: str = "test",
    batch_size: int = 256,
    device: str = DEFAULT_DEVICE,
) -> Evaluation:
    """``device``: as the training's ``--device`` (``auto``: the GPU when there is one)."""
    model_def = load_model_def(model_def_name)
    where = device_of_this_process(device)
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    model = model_def.model()
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as error:  # noqa: BLE001 - any failure means "not this model's weights"
        raise ValueError(
            f"{path} is not a state_dict of {model_def_name}.model(): {error}"
        ) from error
    model.to(where).eval()
    data = model_def.dataset(split)
    if len(data) == 0:
        raise ValueError(f"dataset({split!r}) of {model_def_name} is empty")
    total_loss, count, correct = 0.0, 0, 0
    confusion: dict[tuple[int, int], int] = {}
    classes: set[int] = set()
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            batch = to_device(
                model_def.collate(
                    [data[i] for i in range(start, min(len(data), start + batch_size))]
                ),
                where,
            )
            total_loss += float(model_def.loss(model, batch)) * _size(batch)
            count += _size(batch)
            if isinstance(batch, list | tuple) and len(batch) == 2:
                logits = model(batch[0])
                predicted = logits.argmax(dim=1).tolist()
                truth = batch[1].tolist()
                for t, p in zip(truth, predicted, strict=True):
                    confusion[(t, p)] = confusion.get((t, p), 0) + 1
                    correct += int(t == p)
                classes.update(range(logits.shape[1]))
    labels = sorted(classes)
    matrix = [[confusion.get((t, p), 0) for p in labels] for t in labels]
    return Evaluation(
        count,
        total_loss / max(1, count),
        correct / max(1, count),
        [str(label) for label in labels],
        matrix,
    )


def _size(batch: object) -> int:
    first = batch[0] if isinstance(batch, list | tuple) else batch
    return len(first)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kfp-elastic evaluate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model-def", required=True)
    parser.add_argument("--model", required=True, help="state_dict written by the trainer")
    parser.add_argument("--split", default="test")
    parser.add_argument("--device", choices=DEVICES, default=DEFAULT_DEVICE, help="as training's")
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.model_def, args.model, args.split, device=args.device)
    except (ModelDefError, FileNotFoundError, ValueError, DeviceError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
