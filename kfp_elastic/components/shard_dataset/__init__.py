"""``shard_dataset`` (README.md). The component is
``kfp_elastic.components.shard_dataset.component``; this package must not import kfp (under the KFP
runtime ``kfp.dsl`` has no ``component``)."""
