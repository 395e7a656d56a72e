"""``elastic_train`` (README.md). The component is
``kfp_elastic.components.elastic_train.component``; this package must not import kfp (under the KFP
runtime ``kfp.dsl`` has no ``component``)."""
