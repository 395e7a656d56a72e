"""``stop_workers`` (README.md). The component is
``kfp_elastic.components.stop_workers.component``; this package must not import kfp (under the KFP
runtime ``kfp.dsl`` has no ``component``)."""
