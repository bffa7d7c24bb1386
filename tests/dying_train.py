"""The train command with one twist, run as a module under torchrun (``-m tests.dying_train STEP train ...``):
local rank 1 of torchrun's first attempt SIGKILLs itself after step STEP, so a death happens at a known
step and a test of the restart that follows depends on no timing.
"""

from __future__ import annotations

import os
import signal
import sys

from pipeclock import cli


def train_with_a_rank_that_dies(die_after: int, argv: list[str]) -> int:
    import pipeclock.cli.commands.train as command

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    victim = first_attempt and os.environ.get("LOCAL_RANK") == "1"
    real_train = command.train

    def train_that_dies(config, on_step=None, **others):
        def step(index: int, loss: float) -> None:
            if on_step:
                on_step(index, loss)
            if victim and index == die_after:
                os.kill(os.getpid(), signal.SIGKILL)

        return real_train(config, on_step=step, **others)

    command.train = train_that_dies
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(train_with_a_rank_that_dies(int(sys.argv[1]), sys.argv[2:]))
