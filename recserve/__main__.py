"""``python -m recserve ...`` is the ``recserve`` command (used to spawn the stack's processes)."""

import sys

from recserve.cli import main

sys.exit(main())
