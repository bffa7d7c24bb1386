"""The largest step the engine runs, in a module without torch: ``pipeclock schedule`` checks a step
against them before it simulates one, and a simulator command imports no torch.

A message's tag packs its kind, its pytree leaf, its virtual stage and its micro-batch into one integer
below 2**31, as gloo requires (``engine.messenger.message_tag``): each gets a fixed range.
"""

MAX_STAGES = 512  # virtual stages of one pipeline
MAX_MICROBATCHES = 65536  # micro-batch numbers of one step, 0 to MAX_MICROBATCHES - 1
