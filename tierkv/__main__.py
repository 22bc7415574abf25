"""``python -m tierkv``: the ``tierkv`` command (as the console script and
``python -m tierkv.cli``)."""

import sys

from tierkv.cli import main

sys.exit(main())
