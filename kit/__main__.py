"""``python -m kit ...``: see :mod:`kit.cli`."""

import sys

from kit.cli import block_stop_signals, install_process_handlers, main

install_process_handlers()
status = main()
# from here on a stop signal has nothing left to stop; blocked, it cannot kill the interpreter's shutdown
# (which puts the default handlers back) and turn a finished command's status into -15
block_stop_signals()
sys.exit(status)
