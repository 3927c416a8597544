"""``python -m kit ...``: see :mod:`kit.cli`."""

import sys

from kit.cli import main

sys.exit(main())
