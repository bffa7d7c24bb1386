"""1F1B in the right order whose backwards keep their graphs (``retain_graph=True``) and whose outputs
stay in a list for the whole step: the numbers and the order are right, the memory is GPipe's."""

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule


def one_f_one_b_step(stage, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``stage``, this rank's part of the model; returns the batch loss on the last
    rank (None elsewhere)."""
    rank, world = comms.get_rank(), comms.get_world_size()
    prev, next_, m = comms.get_prev_rank(), comms.get_next_rank(), num_microbatches
    if prev is None:
        inputs = schedule.split_microbatches(inputs, m)
    if next_ is None:
        batch_size, targets = len(targets), schedule.split_microbatches(targets, m)
    outputs, total, done = [], 0.0, 0  # every (input, output) of the step, kept to the end

    def receive(i):
        return inputs[i] if prev is None else comms.recv_tensor(None, prev).requires_grad_()

    def forward(i, x):
        nonlocal total
        y = stage(x)
        if next_ is None:
            y = loss_fn(y, targets[i]) * len(targets[i]) / batch_size
            total += y.item()
        else:
            comms.send_tensor(y.detach(), next_)
        outputs.append((x, y))

    def backward():
        nonlocal done
        x, y = outputs[done]
        done += 1
        grad = None if next_ is None else comms.recv_tensor(y.shape, next_)
        torch.autograd.backward(y, grad, retain_graph=True)  # keeps the graph for nothing
        return x.grad

    warmup = min(world - rank - 1, m)
    for i in range(warmup):
        forward(i, receive(i))
    x = receive(warmup) if warmup < m else None
    for i in range(warmup, m):
        forward(i, x)
        grad = backward()
        x = receive(i + 1) if i + 1 < m else None
        if prev is not None:
            comms.send_tensor(grad, prev)
    for _ in range(warmup):
        grad = backward()
        if prev is not None:
            comms.send_tensor(grad, prev)
    return total if next_ is None else None
