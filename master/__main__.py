"""``python -m master``: see ``master/cli.py``."""

import sys

from master.cli import main

sys.exit(main())
