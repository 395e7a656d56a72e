"""``python -m kfp_elastic``: the same as the ``kfp-elastic`` console script."""

import sys

from kfp_elastic.cli import main

sys.exit(main())
