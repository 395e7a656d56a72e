"""Worker runtime: snapshots, exactly-once data plan, LR/batch policy, the --model-def runner."""
