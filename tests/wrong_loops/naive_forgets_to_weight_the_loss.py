"""The naive loop whose last stage takes each micro-batch's mean loss as it is, unweighted by its share
of the batch: m times too big a gradient on even splits."""

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule


def naive_step(stage, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``stage``, this rank's part of the model; returns the batch loss on the last
    rank (None elsewhere). Gradients accumulate in ``.grad`` as after ``loss.backward()`` on the whole
    model: each micro-batch's loss is weighted by its share of the batch, so uneven splits are exact."""
    prev, next_ = comms.get_prev_rank(), comms.get_next_rank()
    if prev is None:
        inputs = schedule.split_microbatches(inputs, num_microbatches)
    if next_ is None:
        targets = schedule.split_microbatches(targets, num_microbatches)
    total = 0.0
    for i in range(num_microbatches):
        # forward: my input is the batch's piece i, or what the previous rank sends
        x = inputs[i] if prev is None else comms.recv_tensor(None, prev).requires_grad_()
        y = stage(x)
        if next_ is None:  # the last stage: the loss, weighted by this micro-batch's share of the batch
            loss = loss_fn(y, targets[i])  # unweighted
            total += loss.item()
            torch.autograd.backward(loss)
        else:
            comms.send_tensor(y.detach(), next_)
            # backward: wait for the gradient of my output; autograd runs my stage backwards with it
            torch.autograd.backward(y, comms.recv_tensor(y.shape, next_))
        if prev is not None:
            comms.send_tensor(x.grad, prev)
    return total if next_ is None else None
