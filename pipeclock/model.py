"""The stage modules' public face: the models, built stage by stage, and the cuts that split any model::

from pipeclock import model
stage = model.ShardedMLP(hidden=1024, num_layers=16, stage=rank, num_stages=world, seed=0)
part = model.split_sequential(seq, stage=rank, num_stages=world)
model.partition(num_layers, num_stages)   # balanced contiguous ranges
"""

from pipeclock.engine.rng import KeyedDropout
from pipeclock.engine.ties import tie
from pipeclock.models.gpt import GPT, GPTConfig, gpt_sequential
from pipeclock.models.mlp import ShardedMLP, full_mlp, parameter_bytes
from pipeclock.models.partition import partition
from pipeclock.models.split import split_sequential

__all__ = [
    "GPT",
    "GPTConfig",
    "KeyedDropout",
    "ShardedMLP",
    "full_mlp",
    "gpt_sequential",
    "parameter_bytes",
    "partition",
    "split_sequential",
    "tie",
]
