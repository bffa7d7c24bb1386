"""GPipe whose first rank sends micro-batch 1 before micro-batch 0."""

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule


def gpipe_step(stage, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``stage``, this rank's part of the model; returns the batch loss on the last
    rank (None elsewhere). Gradients accumulate in ``.grad`` as after ``loss.backward()`` on the whole
    model: each micro-batch's loss is weighted by its share of the batch, so uneven splits are exact."""
    prev, next_ = comms.get_prev_rank(), comms.get_next_rank()
    if prev is None:
        inputs = schedule.split_microbatches(inputs, num_microbatches)
        if len(inputs) > 1:
            inputs[0], inputs[1] = inputs[1], inputs[0]  # micro-batch 1 first
    if next_ is None:
        batch_size, targets = len(targets), schedule.split_microbatches(targets, num_microbatches)
    held, total = [], 0.0  # (input, output) of every micro-batch, until its backward
    for i in range(num_microbatches):  # fill: all the forwards
        x = inputs[i] if prev is None else comms.recv_tensor(None, prev).requires_grad_()
        y = stage(x)
        if next_ is None:  # the output kept is the micro-batch's loss, weighted by its share
            y = loss_fn(y, targets[i]) * len(targets[i]) / batch_size
            total += y.item()
        else:
            comms.send_tensor(y.detach(), next_)
        held.append((x, y))
    for x, y in held:  # drain: all the backwards, in the same order
        grad = None if next_ is None else comms.recv_tensor(y.shape, next_)
        torch.autograd.backward(y, grad)
        if prev is not None:
            comms.send_tensor(x.grad, prev)
    return total if next_ is None else None
