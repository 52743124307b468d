"""How every script fails: one line `<script>: error: ...` and an exit status, never a traceback for an
expected failure.

    UsageError  the user asked for something wrong (bad argument, missing file, bad config): exit status 2
    RunError    the run itself failed (diverged, out of memory, damaged checkpoint):           exit status 1

Anything else is a bug and keeps its traceback. Set DEBUG=1 in the environment to get tracebacks for the
expected failures too.
"""

import os
import sys


class UsageError(Exception):
    """Bad input: names the argument, file or key, and what to do instead."""

    exit_status = 2


class RunError(Exception):
    """A run that started and failed: says what happened and what to change."""

    exit_status = 1


def run_main(script, main, argv=None, quiet=False):
    """Call main(argv); turn expected failures into one line on stderr and an exit status (0 on success).

    quiet=True prints nothing (ranks other than 0 under torchrun) but still returns the status."""
    try:
        main(argv)
    except (UsageError, RunError) as e:
        if os.environ.get("DEBUG"):
            raise
        if not quiet:
            print(f"{script}: error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        if not quiet:
            print(f"{script}: interrupted", file=sys.stderr)
        return 130
    return 0
