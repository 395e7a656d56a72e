"""``--model-def benchmarks.scheduling.paced_imagenet``: ``benchmarks.timed_model_def`` over
``kfp_elastic.testing.model_defs.counted_blobs``, every optimizer step as long as ImageNet's
(``TIMED_JOB_TYPE=imagenet``) at a global batch of 256 on the world's GPUs
(``TIMED_GLOBAL_BATCH=256``: 1.19 s on 1 GPU, 0.41 s on 4, 0.32 s on 8).

For jobs on the test cluster: worker pods get no environment of the benchmark's, only what the
master gives them, so the settings are this module's. Variables set in the environment win.
"""

from __future__ import annotations

import os

os.environ.setdefault("TIMED_MODEL_DEF", "kfp_elastic.testing.model_defs.counted_blobs")
os.environ.setdefault("TIMED_JOB_TYPE", "imagenet")
os.environ.setdefault("TIMED_GLOBAL_BATCH", "256")

from benchmarks.timed_model_def import *  # noqa: E402,F403 - the model definition's names
