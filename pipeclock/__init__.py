"""pipeclock: pipeline-parallel training for PyTorch, built from first principles on torch.distributed.

The public modules are ``comms`` (process group and point-to-point tensors), ``model`` (the stage
modules) and ``schedule`` (micro-batches, schedules and the ``Pipeline`` that runs them).
"""

__version__ = "0.1.0"
