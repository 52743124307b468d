"""How every script fails: one line `<script>: error: ...` and an exit status, never a traceback for an
expected failure.

    UsageError  the user asked for something wrong (bad argument, missing file, bad config): exit status 2
    RunError    the run itself failed (diverged, out of memory, damaged checkpoint):           exit status 1
    Stopped     the run was asked to stop (Ctrl-C, SIGTERM) and stopped cleanly:            128 + the signal

Output cut off by its reader (`sample.py ... | head`) ends quietly with status 141 (128 + SIGPIPE, what a shell
reports for a tool killed by it, so `set -o pipefail` scripts still see that the output was not all read).

Anything else is a bug and keeps its traceback. Set DEBUG=1 in the environment to get tracebacks for the
expected failures too. check_device is the one check every entry point makes before using a device, and
ArgumentParser the parser of every script but train.py (helpers/config.py parses its --key=value).
"""

import argparse
import difflib
import os
import signal
import sys


class UsageError(Exception):
    """Bad input: names the argument, file or key, and what to do instead."""

    exit_status = 2


class RunError(Exception):
    """A run that started and failed: says what happened and what to change."""

    exit_status = 1


class Stopped(Exception):
    """Stopped on a signal after saving its work; the message says how to continue. Exit status 128 + signal,
    as a shell reports a process killed by it (130 for Ctrl-C), so that scripts see the run did not finish."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.exit_status = 128 + signum


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help as the scripts give it: the description as written (their docstrings), and after each option's help its
    default, unless the help names it already or there is none to give (None, a flag's False)."""

    def _get_help_string(self, action):
        help = action.help or ""
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS or \
                "default" in help or not action.option_strings:
            return help
        return help + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every script uses it: a bad argument is one line `<script>: error: ...` and exit status 2, as the
    other usage errors (no usage block before it: --help has it); an option is never guessed from a prefix
    (--num_sample is an error, not --num_samples); --help shows the defaults (HelpFormatter)."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog=prog, allow_abbrev=False, formatter_class=HelpFormatter, **kwargs)

    def parse_args(self, args=None, namespace=None):
        args, unknown = self.parse_known_args(args, namespace)
        if unknown:  # argparse's own message, and the option that was probably meant
            options = [o for action in self._actions for o in action.option_strings]
            close = difflib.get_close_matches(unknown[0].partition("=")[0], options, n=1)
            self.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else ""))
        return args

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_main(script, main, argv=None, quiet=False):
    """Call main(argv); turn expected failures into one line on stderr and an exit status (0 on success).

    quiet=True prints nothing (ranks other than 0 under torchrun) but still returns the status."""
    try:
        main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except BrokenPipeError:
        # The reader is gone. Point stdout at devnull so that the flush at exit does not fail again (as the
        # Python docs on SIGPIPE recommend), and say nothing: the user stopped reading on purpose.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + getattr(signal, "SIGPIPE", 13)  # 141
    except (UsageError, RunError, Stopped) as e:
        if os.environ.get("DEBUG"):
            raise
        if not quiet:
            print(f"{script}: {'' if isinstance(e, Stopped) else 'error: '}{e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        if not quiet:
            print(f"{script}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def check_device(name, arg="--device"):
    """name ("cpu", "cuda", "cuda:1", "mps") if this machine has it, else a UsageError naming arg. Asked before
    any work: PyTorch's own failure comes later, as a traceback ("Torch not compiled with CUDA enabled")."""
    import torch  # here, not at the top: prepare.py fails through this module too and never needs torch
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"{arg}={name} is not a device: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"{arg}={name}, but {why}: use {arg}=cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"{arg}={name}, but this machine has {count} CUDA GPU(s): cuda:0"
                             f"{f' to cuda:{count - 1}' if count > 1 else ''}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"{arg}={name}, but MPS (Apple GPU) is not available here: use {arg}=cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{arg}={name}: this repo runs on cpu, cuda or mps")
    return name
