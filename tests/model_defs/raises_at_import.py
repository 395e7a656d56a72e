"""A model definition that fails the same way at every start: it raises while imported."""

raise RuntimeError("raises_at_import: this model definition is broken on purpose")
