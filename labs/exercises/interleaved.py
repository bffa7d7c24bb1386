"""Lab 7 exercise: write interleaved 1F1B, several chunks of the model on each rank.

Check it:  python -m pipeclock lab 7 --check labs/exercises/interleaved.py
(the answer, when you want it: labs/solutions/interleaved.py)
"""

import torch  # noqa: F401  (you will need these)
import torch.nn.functional as F

from pipeclock import comms, schedule  # noqa: F401


def interleaved_step(chunks, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``chunks``, this rank's v chunks of the model in order; return the batch loss
    on the last rank (None elsewhere).

    With p ranks, rank r's chunk c is virtual stage c * p + r: activations go round the ranks (rank p - 1
    sends to rank 0), gradients the other way. ``inputs`` is the whole batch on rank 0, ``targets`` its
    targets on rank p - 1 (None elsewhere); cut them with ``schedule.split_microbatches``. The order is
    interleaved 1F1B's (``python -m pipeclock schedule interleaved-1f1b --stages 2 --microbatches 4
    --chunks 2`` draws one). Send activations with tag 0 and gradients with tag 1
    (``comms.isend_tensor(t, dest, tag=...)`` returns at once: ``.wait()`` for each at the end;
    ``comms.recv_tensor(shape, src, tag=...)``). Gradients must end in ``.grad`` as after
    ``loss.backward()`` on the whole model and batch.
    """
    raise NotImplementedError("write the interleaved 1F1B loop")
