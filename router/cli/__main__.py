"""``python -m router.cli``: the ``kvledger`` command."""

import sys

from router.cli import main

sys.exit(main())
