"""Lab 6 exercise: write the 1F1B schedule.

Check it:  python -m pipeclock lab 6 --check labs/exercises/one_f_one_b.py
(the answer, when you want it: labs/solutions/one_f_one_b.py)
"""

import torch  # noqa: F401  (you will need these)
import torch.nn.functional as F

from pipeclock import comms, schedule  # noqa: F401


def one_f_one_b_step(stage, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``stage``, this rank's part of the model; return the batch loss on the last
    rank (None elsewhere).

    ``inputs`` is the whole batch on rank 0 (None elsewhere), ``targets`` the whole batch's targets on the
    last rank (None elsewhere). Cut them with ``schedule.split_microbatches``. The order is 1F1B's: a
    warm-up of forwards, a steady state of one forward and one backward in turn, a cool-down of
    backwards (the page's "The idea" says how long each is). Mind the order of your messages:
    ``send_tensor`` waits until the receiver takes the tensor.
    Talk to your neighbours (``comms.get_prev_rank()``, ``comms.get_next_rank()``, None at the ends) with
    ``comms.send_tensor(t, dest)`` and ``comms.recv_tensor(shape_or_None, src)``. Gradients must end in
    ``.grad`` as after ``loss.backward()`` on the whole model and batch: weight each micro-batch's loss
    by its share of the batch. ``torch.autograd.backward(output, grad_of_output)`` runs a stage's backward.
    """
    raise NotImplementedError("write the 1F1B loop")
