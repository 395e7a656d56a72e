"""``evaluate`` (README.md). The component is
``kfp_elastic.components.evaluate.component``; this package must not import kfp (under the KFP
runtime ``kfp.dsl`` has no ``component``)."""
