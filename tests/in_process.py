"""A script's `python <name> args` run in the test's own process: its __main__ block through runpy, its exit status,
its stdout and its stderr with the warnings it raised (in a process of its own a warning is a line of stderr, which
the one-line error checks must see; in pytest's process pytest would take it). A subprocess costs an interpreter
importing torch, seconds each on a 2-core machine; the tests that use this keep one real process per script."""

import contextlib
import os
import runpy
import sys
import types
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main_in_process(monkeypatch, capsys, name, *args):
    """A CompletedProcess-like (returncode, stdout, stderr) of `python <name> args`, run from the repository's root."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", [name, *args])
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            runpy.run_path(os.path.join(ROOT, name), run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
    out, err = capsys.readouterr()
    said = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return types.SimpleNamespace(returncode=status, stdout=out, stderr=err + said)
