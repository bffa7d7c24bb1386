"""The models pipeclock trains, built stage by stage: only a rank's own layers are ever allocated.

Also the data they train on (``text``: a corpus of bytes; ``regression``: the MLP's synthetic task) and
what decoding needs per model (``decoding``, ``sampling``).

May import: comms, engine.
"""
