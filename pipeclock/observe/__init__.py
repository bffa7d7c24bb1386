"""Observing runs: the simulator, timelines, diagrams, metrics and reports."""
