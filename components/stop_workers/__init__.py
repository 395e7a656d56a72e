"""``stop_workers`` (README.md). The component is ``components.stop_workers.component``;
this package must not import kfp (under the KFP runtime ``kfp.dsl`` has no ``component``)."""
