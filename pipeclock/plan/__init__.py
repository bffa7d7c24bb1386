"""Planning a run before it is run: memory per rank and step time, measured on this CPU (``profile``,
``rank_memory``, ``planner``, ``model_layers``), and the check that a run fits before it starts
(``memory_fit``).

May import: comms, engine, models, parallel, observe.
"""
