"""Model definitions used by the tests."""
