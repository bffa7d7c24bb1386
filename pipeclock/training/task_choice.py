"""Which task a run trains: ``--model mlp|gpt|hf`` to a task object.

Its own module so that the tasks depend on nothing above them: ``hf_task`` builds on ``tasks``' language
task, and this module, which names them all, sits above both.
"""

from __future__ import annotations

from pipeclock.training.hf_task import HFTask
from pipeclock.training.tasks import LanguageTask, RegressionTask


def make_task(config) -> RegressionTask | LanguageTask:
    """The task ``config.model`` names; bad sizes or data fail here, before any run."""
    tasks = {"mlp": RegressionTask, "gpt": LanguageTask, "hf": HFTask}
    if config.model not in tasks:
        raise ValueError(f"unknown model {config.model!r}: use one of {', '.join(tasks)}")
    return tasks[config.model](config)
