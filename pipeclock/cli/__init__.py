"""The command line: ``python -m pipeclock <command>``, a thin layer over the rooms.

Each command (``commands/<name>.py``) parses its arguments and calls into ``training``, ``data``,
``checkpoints``, ``generation``, ``course``, ``plan``, ``observe`` or the engine; nothing here computes
what a room could.
``dispatch`` picks the command, ``arguments`` holds the checks the commands share, ``interrupts`` and
``stopping`` turn Ctrl-C, SIGTERM and a dying peer into one line.

May import: comms, faces, engine, models, data, parallel, observe, plan, checkpoints, generation, course,
training.
"""

from pipeclock.cli.dispatch import main

__all__ = ["main"]
