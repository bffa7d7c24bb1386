"""The course's checker: ``lab N --check FILE`` runs a learner's loop on real processes and says what is
wrong (``check``: the launch, the verdict and its messages; ``check_rank``: one rank's run against one
process; ``recorder``: the calls a loop makes), and ``beside``: a lab's reference loop run next to the engine.

May import: comms, faces, engine, models, observe.
"""
