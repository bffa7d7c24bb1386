"""The course's checker: ``lab N --check FILE`` runs a learner's loop on real processes and says what is
wrong (``check``: the launch and the answer; ``learner_file``: the file imported where it is watched;
``check_rank``: one rank's run against the one-process model of ``reference``; ``recorder`` and
``computes``: the calls and the computations a loop makes; ``watch``: the ranks followed, the verdict;
``order``: the loop held to its lab's schedule), and ``beside``: a lab's reference loop run next to the
engine.

May import: comms, faces, engine, models, observe.
"""
