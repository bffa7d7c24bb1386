"""Checkpoints: writing and reading them with DCP (``save_load``), choosing which one to resume from and
pruning old ones (``choice``), their checksums (``integrity``), the lock that keeps two runs out of one
folder (``folder_lock``), and what may change on a resume (``resume``: a different layout, rate, or run).

May import: comms, engine, models, parallel.
"""
