"""Reproducible comparisons: pipeclock against ``torch.distributed.pipelining`` and one process.

``python -m benchmarks.run`` (or ``python -m pipeclock bench``) plans a sweep, runs it under torchrun and
writes JSON, Markdown and plots; ``docs/benchmarks.md`` reads the results. The pieces:

- ``plan``: the cases, their step counts, and the torch schedule that runs the same order as ours;
- ``launch``: torchrun with a deadline, leaving no process behind;
- ``worker``: what every rank runs: each (hidden, m) group, every participant in turn;
- ``case``, ``engines``, ``probe``: both engines on copies of the same modules, measured alike;
- ``baseline``: T1, the whole model on each core at once;
- ``rss``, ``load``: peak memory per step, and how busy other processes kept the machine;
- ``overhead``: the engines' own cost per action, with layers so small that compute is ~0;
- ``summary``, ``results_model``, ``report``, ``figures``: from samples to tables and plots.
"""
