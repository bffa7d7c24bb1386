"""On a GPU: a Hugging Face model's dropout, attention dropout included, is the same on any cut.

    python -m benchmarks.hf_cuda_randomness

GPT-2 (6 layers, dropout 0.1, attention dropout 0.3: drawn inside the CUDA attention kernel) runs one
training forward and backward on the GPU as ``transformers`` builds it, keyed by ``hf.keyed``, and cut
into 1, 3 and 8 stages chained in this process. Each cut's loss and gradients (a tied weight's copies
summed) are printed as their largest relative gap from the whole model's; and the loss without attention
dropout, to show that it was at work. On the CPU the test suite checks the same
(``tests/test_hf_model.py``); this is what the CUDA generator does with the same keys.
"""

from __future__ import annotations

import warnings

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM

    from pipeclock.engine import rng
    from pipeclock.engine.ties import tie_key
    from pipeclock.models import hf
    from tests.hf_cases import gpt2_config, padded_batch

    warnings.simplefilter("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = gpt2_config(dropout=0.1)
    config.attn_pdrop = 0.3
    (ids, mask), labels = padded_batch(4, 16, seed=1)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    loss_fn = hf.loss()

    model = AutoModelForCausalLM.from_config(hf.build.prepared_config(config))
    model.load_state_dict(hf.whole(config, seed=5).state_dict())
    hf.keyed(model, 5)
    model.to(device).train()
    with rng.keyed(0, 0):
        want = loss_fn.mean(model(input_ids=ids, attention_mask=mask).logits, labels)
    want.backward()
    wanted = {name: p.grad for name, p in model.named_parameters()}
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {where}, torch {torch.__version__}")
    print(f"whole model: loss {want.item():.6f}")
    for stages in (1, 3, 8):
        chunks = [hf.split(config, s, stages, seed=5).to(device).train() for s in range(stages)]
        with rng.keyed(0, 0):
            out = (ids, mask)
            for chunk in chunks:
                out = chunk(out)
            loss = loss_fn.mean(out, labels)
        loss.backward()
        grads: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                key = tie_key(p) or name
                grads[key] = grads[key] + p.grad if key in grads else p.grad
        gap = max(((g - wanted[k]).abs().max() / wanted[k].abs().max()).item() for k, g in grads.items())
        print(f"{stages} stage(s): loss {loss.item():.6f}, worst relative gradient gap {gap:.2e}")
    config.attn_pdrop = 0.0
    quiet = AutoModelForCausalLM.from_config(hf.build.prepared_config(config))
    quiet.load_state_dict(model.state_dict())
    hf.keyed(quiet, 5)
    quiet.to(device).train()
    with rng.keyed(0, 0), torch.no_grad():
        other = loss_fn.mean(quiet(input_ids=ids, attention_mask=mask).logits, labels)
    print(f"without attention dropout: loss {other.item():.6f}")


if __name__ == "__main__":
    main()
