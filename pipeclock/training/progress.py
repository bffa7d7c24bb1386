"""What rank 0 shows while a run goes: a bar on a terminal, a line every tenth of the run otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from pipeclock.models.text import bits_per_byte


class Progress:
    """Rank 0's progress: on a terminal a bar (step, loss, tokens/s, time left), a line every tenth of
    the run otherwise."""

    def __init__(
        self,
        steps: int,
        enabled: bool,
        per_byte: Callable[[float], float | None] = bits_per_byte,
        step_tokens: int = 0,
        stream=None,
    ):
        """``per_byte``: a validation loss (nats per token) in bits per byte of the text (None: unknown);
        ``step_tokens``: the tokens of a step (the bar shows tokens/s); ``stream``: where the bar goes."""
        self.steps, self.enabled, self.per_byte = steps, enabled, per_byte
        self.step_tokens, self.stream = step_tokens, stream or sys.stderr
        self.bar = None
        self.on_terminal = enabled and self.stream.isatty()

    def begin(self, step: int) -> None:
        """The run starts at ``step`` (after a resume: the bar counts only this run's steps in its rate)."""
        if self.on_terminal and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, initial=step, unit="step", dynamic_ncols=True, file=self.stream)
            self.began = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.on_terminal:
            self.begin(step)
            shown = {"loss": f"{loss:.4f}"}
            elapsed = time.perf_counter() - self.began
            if self.step_tokens and elapsed > 0:  # this run's steps so far, this one included
                shown["tok/s"] = f"{(self.bar.n + 1 - self.bar.initial) * self.step_tokens / elapsed:,.0f}"
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update()
        elif step % max(1, self.steps // 10) == 0 or step == self.steps - 1:
            print(f"step {step:5d}  loss {loss:.6f}", flush=True)

    def validation(self, steps_done: int, loss: float) -> None:
        if not self.enabled:
            return
        per_byte = self.per_byte(loss)
        line = f"validation after {steps_done} steps: {loss:.4f} nats/token" + (
            f", {per_byte:.3f} bits/byte" if per_byte is not None else ""
        )
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
