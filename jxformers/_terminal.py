"""Whether this process's stderr is a terminal, for progress bars: a process that a
supervisor (`jxformers.train.supervise`) started writes to a pipe, and the supervisor
tells it whether the stream the pipe leads to is a terminal."""

from __future__ import annotations

import os
import sys

# Set by the supervisor in its child's environment: "1" when its own stderr is a terminal.
STDERR_IS_TERMINAL = "JXFORMERS_STDERR_IS_TERMINAL"


def stderr_is_terminal() -> bool:
    """True when what this process writes to stderr reaches a terminal."""
    if STDERR_IS_TERMINAL in os.environ:
        return os.environ[STDERR_IS_TERMINAL] == "1"
    return sys.stderr.isatty()
