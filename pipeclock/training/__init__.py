"""The main job: ``train``'s loop (``loop``), what it trains (``tasks``, ``hf_task``, ``task_choice``),
the checks run before the first step (``checks``) and the cut of the model by time or memory (``balance``).

May import: comms, faces, engine, models, data, parallel, observe, plan, checkpoints.
"""
