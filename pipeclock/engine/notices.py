"""Warnings about a run as a whole, which every rank finds alike: the command line says each once.

A ``RunWarning`` is a plain ``UserWarning`` to a library user. The command line (``pipeclock.cli``)
shows it as one line, ``pipeclock train: warning: ...``, once per run and on rank 0 only, where Python
would print it once per place it was raised, on every rank, with the file and line that raised it.
"""

from __future__ import annotations


class RunWarning(UserWarning):
    """A fact about the run's configuration, the same on every rank (attention dropout turned off ...)."""
