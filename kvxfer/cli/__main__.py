"""``python -m kvxfer.cli``: the same as the ``kvxfer`` command."""

import sys

from .app import main

sys.exit(main())
