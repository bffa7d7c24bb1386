"""1F1B whose ranks wait for their gradient before they send their activation on: each receives before
it sends, and the activation that would let the next rank go on is never sent."""

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule


def one_f_one_b_step(stage, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``stage``, this rank's part of the model; returns the batch loss on the last
    rank (None elsewhere). Gradients accumulate in ``.grad`` as after ``loss.backward()`` on the whole
    model: each micro-batch's loss is weighted by its share of the batch, so uneven splits are exact."""
    rank, world = comms.get_rank(), comms.get_world_size()
    prev, next_, m = comms.get_prev_rank(), comms.get_next_rank(), num_microbatches
    if prev is None:
        inputs = schedule.split_microbatches(inputs, m)
    if next_ is None:
        batch_size, targets = len(targets), schedule.split_microbatches(targets, m)
    held, total = [], 0.0

    def receive(i):  # micro-batch i's input
        return inputs[i] if prev is None else comms.recv_tensor(None, prev).requires_grad_()

    def forward(i, x):
        nonlocal total
        y = stage(x)
        if next_ is None:
            y = loss_fn(y, targets[i]) * len(targets[i]) / batch_size
            total += y.item()
        held.append((x, y))
        return y

    def backward():  # the oldest micro-batch held; returns its input's gradient
        x, y = held.pop(0)
        torch.autograd.backward(y, None if next_ is None else comms.recv_tensor(y.shape, next_))
        return x.grad

    warmup = min(world - rank - 1, m)
    for i in range(warmup):
        y = forward(i, receive(i))
        if next_ is not None:
            comms.send_tensor(y.detach(), next_)
    x = receive(warmup) if warmup < m else None
    for i in range(warmup, m):  # steady state: the forward of i, the backward of i - warmup
        y = forward(i, x)
        grad = backward()  # waits for a gradient before sending the activation below
        if next_ is not None:
            comms.send_tensor(y.detach(), next_)
        x = receive(i + 1) if i + 1 < m else None  # my next input first, then my gradient back
        if prev is not None:
            comms.send_tensor(grad, prev)
    for _ in range(warmup):  # cool-down
        grad = backward()
        if prev is not None:
            comms.send_tensor(grad, prev)
    return total if next_ is None else None
