"""KFP component: turn a dataset into the shard manifest that ``elastic_train`` consumes."""

from kfp import dsl
from kfp.dsl import Dataset, Output

from kfp_elastic.components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def shard_dataset(
    manifest: Output[Dataset],
    dataset: str = "",
    model_def: str = "kfp_elastic.worker.examples.digits",
    split: str = "train",
    num_shards: int = 0,
    shard_size: int = 0,
) -> int:
    """Cut a dataset into contiguous shards; returns the number of samples.

    Args:
        manifest: JSON ``{"shards": [[id, start, end], ...], "num_samples", "source", ...}``.
        dataset: a path (file or directory), ``file://`` URI, ``example:digits``,
            ``model-def:pkg.module``, or empty for ``model_def``'s own ``dataset(split)``.
        model_def: the training module; its dataset is used when ``dataset`` is empty.
        split: the split to count (what the workers train on is ``train``).
        num_shards: shards of equal size (0: 16, or fewer for a tiny dataset).
        shard_size: samples per shard instead of ``num_shards`` (give one of them).
    """
    import json

    from kfp_elastic.components.shard_dataset.shard import build_manifest

    document = build_manifest(dataset, model_def, split, num_shards, shard_size)
    with open(manifest.path, "w") as stream:
        json.dump(document, stream)
    manifest.metadata.update(
        {
            key: document[key]
            for key in ("num_samples", "num_shards", "source", "source_kind", "split")
        }
    )
    print(
        f"shard manifest: {document['num_samples']} samples of {document['source']} "
        f"({split}) in {document['num_shards']} shards -> {manifest.path}",
        flush=True,
    )
    return int(document["num_samples"])
