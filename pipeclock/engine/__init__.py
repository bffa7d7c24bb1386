"""The engine: the Action IR, schedule generators, the lowering to a program, and the runtime on one rank.

May import: comms.
"""
