"""Generation across stages: the decode loop as a forward-only program (``decode_program``), a rank's
share of the model with its cache (``stage_model``), and the runtime that walks the program (``pipeline``).

May import: comms, engine, models, observe.
"""
