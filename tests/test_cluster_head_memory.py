"""The loss's memory at the head, measured: a real forward and backward of the cross-entropy over bf16
logits cast to fp32, plain and under torch's vocabulary-parallel loss, in a fresh process whose peak
resident memory the kernel counts (each tensor here is far above malloc's mmap threshold, so it is
mapped when written and returned when freed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeclock.plan.activations import head_backward_bytes
from pipeclock.plan.paper_model import PaperModel
from tests.distributed import free_port

PROBE = r"""
import gc, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

def rss(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
tokens, vocab = 2048, 32768
hidden = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
head = torch.randn(vocab, 64, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, vocab, (tokens,))

def loss(parallel):
    logits = hidden @ head.t()
    if not parallel:
        return torch.nn.functional.cross_entropy(logits.float(), labels)
    with loss_parallel():
        return torch.nn.functional.cross_entropy(DTensor.from_local(logits, mesh, [Shard(1)]).float(), labels)

def backward(value, parallel):
    if parallel:
        with loss_parallel():
            value.backward()
    else:
        value.backward()

for parallel in (False, True):
    backward(loss(parallel), parallel)  # warm up
    hidden.grad = head.grad = None
    gc.collect()
    base = rss("VmRSS:")
    value = loss(parallel)  # its logits are freed here, as torchtitan frees them before the backward
    kept = rss("VmRSS:") - base
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
    backward(value, parallel)
    peak = rss("VmHWM:") - base
    print(kept / (tokens * vocab), peak / (tokens * vocab))
    del value
    hidden.grad = head.grad = None
    gc.collect()
dist.destroy_process_group()
"""

MODEL = PaperModel("test", layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=256, vocab=32768)


def measured() -> dict[str, tuple[float, float]]:
    """Bytes per logit kept after the loss's forward, and at its backward's peak: plain, and parallel."""
    probe = [sys.executable, "-c", PROBE, str(free_port())]
    out = subprocess.run(probe, capture_output=True, text=True, check=True,
                         timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})  # fmt: skip
    plain, parallel = (tuple(float(x) for x in line.split()) for line in out.stdout.splitlines())
    return {"plain": plain, "parallel": parallel}


@pytest.mark.long  # about 25 s: fresh processes measured one by one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's peak resident memory")
def test_the_loss_keeps_its_fp32_log_probabilities_and_peaks_as_the_planner_counts():
    found = measured()
    for kind, tp in (("plain", 1), ("parallel", 8)):
        kept, peak = found[kind]
        per_logit = (
            MODEL.vocab / tp
        )  # what head_bytes counts per logit beyond its norm: the log-probabilities
        assert kept == pytest.approx(4.0, abs=0.05)
        assert peak == pytest.approx(4.0 + head_backward_bytes(MODEL, 2, tp) / per_logit, abs=0.05)
