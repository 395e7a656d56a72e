"""Model definitions that record which samples every step consumed, so a run can check that each
sample was trained on exactly once per epoch."""
