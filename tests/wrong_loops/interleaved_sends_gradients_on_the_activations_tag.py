"""Interleaved 1F1B that sends and receives its gradients with tag 0, the activations' tag."""

import torch
import torch.nn.functional as F

from pipeclock import comms, schedule

ACTIVATION, GRADIENT = 0, 1  # message tags


def interleaved_step(chunks, inputs, targets, num_microbatches, loss_fn=F.mse_loss):
    """One training step of ``chunks``, this rank's chunks of the model in order; returns the batch loss
    on the last rank (None elsewhere). Gradients accumulate in ``.grad`` as after ``loss.backward()`` on
    the whole model: each micro-batch's loss is weighted by its share of the batch."""
    rank, p, m, v = comms.get_rank(), comms.get_world_size(), num_microbatches, len(chunks)
    prev, next_ = (rank - 1) % p, (rank + 1) % p  # round the ring
    if rank == 0:
        inputs = schedule.split_microbatches(inputs, m)
    if rank == p - 1:
        batch_size, targets = len(targets), schedule.split_microbatches(targets, m)
    rounds = [range(start, start + p) for start in range(0, -(-m // p) * p, p)]
    forwards = [("F", i, c) for r in rounds for c in range(v) for i in r]
    backwards = [("B", i, c) for r in rounds for c in reversed(range(v)) for i in r]
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, len(forwards))
    steady = [a for pair in zip(forwards[warmup:], backwards, strict=False) for a in pair]
    order = forwards[:warmup] + steady + backwards[len(forwards) - warmup :]
    held, sending, total = {}, [], 0.0
    for op, i, c in order:
        if i >= m:
            continue  # a micro-batch of the last round that does not exist
        first, last = rank == 0 and c == 0, rank == p - 1 and c == v - 1
        chunk = chunks[c]
        if op == "F":
            x = inputs[i] if first else comms.recv_tensor(None, prev, tag=ACTIVATION).requires_grad_()
            y = chunk(x)
            if last:
                y = loss_fn(y, targets[i]) * len(targets[i]) / batch_size
                total += y.item()
            else:
                sending.append(comms.isend_tensor(y.detach(), next_, tag=ACTIVATION))
            held[i, c] = (x, y)
        else:
            x, y = held.pop((i, c))
            grad = None if last else comms.recv_tensor(y.shape, next_, tag=ACTIVATION)
            torch.autograd.backward(y, grad)
            if not first:
                sending.append(comms.isend_tensor(x.grad, prev, tag=ACTIVATION))
    for message in sending:
        message.wait()
    return total if rank == p - 1 else None
