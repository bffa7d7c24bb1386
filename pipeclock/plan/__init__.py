"""Planning a run before it is run: memory per rank and step time, measured on this CPU (``profile``,
``rank_memory``, ``planner``, ``model_layers``, ``tensor_parallel``), and the check that a run fits before
it starts (``memory_fit``); or on paper for a cluster of GPUs (``paper_model`` and ``hf_paper`` for the
model, ``gpus`` for the hardware, ``cluster_memory`` and ``cluster_time`` for one configuration,
``search`` for all of them, ``calibration`` for the constants checked against published runs).

May import: comms, engine, models, parallel, observe.
"""
