"""``evaluate`` (README.md). The component is ``components.evaluate.component``;
this package must not import kfp (under the KFP runtime ``kfp.dsl`` has no ``component``)."""
