"""Observing runs: the simulator of a program, timelines, diagrams, metrics and reports.

May import: comms, engine, models.
"""
