"""1F1B whose rank 0 runs one warm-up forward more than p - r - 1, with non-blocking sends: the numbers are
right and nothing deadlocks, but rank 0 holds one micro-batch more than 1F1B allows."""

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
    held, sending, total = [], [], 0.0

    def forward(i):
        nonlocal total
        x = inputs[i] if prev is None else comms.recv_tensor(None, prev).requires_grad_()
        y = stage(x)
        if next_ is None:
            y = loss_fn(y, targets[i]) * len(targets[i]) / batch_size
            total += y.item()
        else:
            sending.append(comms.isend_tensor(y.detach(), next_))
        held.append((x, y))

    def backward():
        x, y = held.pop(0)
        torch.autograd.backward(y, None if next_ is None else comms.recv_tensor(y.shape, next_))
        if prev is not None:
            sending.append(comms.isend_tensor(x.grad, prev))

    warmup = min(world - rank - (0 if rank == 0 else 1), m)  # rank 0: one forward too many
    for i in range(warmup):
        forward(i)
    for i in range(warmup, m):
        forward(i)
        backward()
    while held:
        backward()
    for message in sending:
        message.wait()
    return total if next_ is None else None
