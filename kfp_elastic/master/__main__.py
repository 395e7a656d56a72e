"""``kfp-elastic master``: see ``master/cli.py``."""

import sys

from kfp_elastic.master.cli import main

sys.exit(main())
