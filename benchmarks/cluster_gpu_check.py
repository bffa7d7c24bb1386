"""The cluster planner against one GPU measured: a Llama-shaped model trained eagerly in bf16, step by step.

    python -m benchmarks.cluster_gpu_check                 # on a CUDA machine; writes results/cluster_gpu.*
    python -m benchmarks.cluster_gpu_check --tiny --cpu    # the same loop, tiny, to try it here
    python -m benchmarks.cluster_gpu_check --report results/cluster_gpu_b4.json ...   # the table, in markdown

Each run builds ``transformers``' LlamaForCausalLM from a config (random weights, fp32 masters, sdpa
attention), trains it with torch.optim.AdamW under bf16 autocast on one micro-batch per step, with each
recompute policy the planner knows: none, selective (torchtitan's op-level policy: every other matrix
product's output and attention's kept, through ``torch.utils.checkpoint``'s selective contexts) and full
(each decoder layer one checkpoint). Measured: the median step of the timed steps, and the peak memory
allocated and reserved (``torch.cuda``). Predicted: ``plan --cluster 1x<this GPU> --fix`` for the same
run, eager kernels. Nothing here was used to fit the planner's constants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {  # a 1.2B Llama-shaped model; the tiny one tries the loop on a CPU
    "full": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
                 num_hidden_layers=16, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=500),
}  # fmt: skip


def selective_context():
    """torchtitan's op-level policy: keep attention's output and every other matrix product's."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}  # fmt: skip
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[key] += 1
        kept = func in keep and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_layers(model, recompute: str) -> None:
    """Run each decoder layer under the recompute policy (a checkpoint around the layer's forward)."""
    from torch.utils.checkpoint import checkpoint

    if recompute == "none":
        return
    for layer in model.model.layers:
        forward = layer.forward
        context = {"context_fn": selective_context} if recompute == "selective" else {}

        def checkpointed(*args, _forward=forward, _context=context, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **_context, **kwargs)

        layer.forward = checkpointed


def measure(sizes: dict, recompute: str, batch: int, seq: int, steps: int, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**sizes, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    wrap_layers(model, recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    times = []
    cuda = device.type == "cuda"
    for step in range(steps + 3):
        if cuda:
            torch.cuda.synchronize()
            if step == 3:
                torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= 3:
            times.append(time.perf_counter() - started)
    step_time = statistics.median(times)
    result = {"recompute": recompute, "step_s": step_time, "tokens_per_s": batch * seq / step_time}
    if cuda:
        result["allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del model, optimizer
    return result


def predicted(sizes: dict, recompute: str, batch: int, seq: int, kind_name: str) -> dict:
    from transformers import LlamaConfig

    from pipeclock.plan.cluster_config import Config, Job, Software
    from pipeclock.plan.cluster_plan import predict
    from pipeclock.plan.gpus import KINDS, Cluster
    from pipeclock.plan.hf_paper import paper_model

    model = paper_model(LlamaConfig(**sizes), "Llama 1.2B")
    config = Config(tp=1, pp=1, dp=1, schedule="1f1b", chunks=1, microbatch_size=batch, microbatches=1,
                    recompute={"selective": "selective-op"}.get(recompute, recompute), zero=0,
                    sequence_parallel=False)  # fmt: skip
    answer = predict(model, config, Job(batch, seq), Software("bf16"), Cluster(1, KINDS[kind_name]))
    return {"tokens_per_s": answer.tokens_per_second_per_gpu, "allocated_bytes": answer.memory.allocated,
            "total_bytes": answer.memory.total, "step_s": answer.time.step}  # fmt: skip


def matmul_tflops(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - started) / 1e12


def markdown(reports: list[dict]) -> str:
    """The measured runs beside the planner's predictions, one row per run."""
    lines = [
        "| GPU | tokens a step | recompute | measured tokens/s | predicted | error | measured GiB allocated "
        "| predicted | error |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        for run in report["runs"]:
            m, p = run["measured"], run["predicted"]
            memory_error = p["allocated_bytes"] / m["allocated_bytes"] - 1
            lines.append(
                f"| {report['device']} | {report['batch'] * report['seq']:,} | {m['recompute']} | "
                f"{m['tokens_per_s']:,.0f} | {p['tokens_per_s']:,.0f} | "
                f"{p['tokens_per_s'] / m['tokens_per_s'] - 1:+.1%} | {m['allocated_bytes'] / 2**30:.1f} | "
                f"{p['allocated_bytes'] / 2**30:.1f} | {memory_error:+.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print these results as a table")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.report:
        print(markdown([json.loads(Path(path).read_text()) for path in args.report]))
        return
    device = torch.device("cpu" if args.cpu else "cuda")
    sizes = SIZES["tiny" if args.tiny else "full"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kind = "H200" if "H200" in name else "H100-80GB"
    report = {"device": name, "kind": kind, "batch": args.batch, "seq": args.seq, "runs": []}
    if device.type == "cuda":
        report["matmul_8192_tflops"] = matmul_tflops(device)
    for recompute in ("none", "selective", "full"):
        run = {"measured": measure(sizes, recompute, args.batch, args.seq, args.steps, device),
               "predicted": predicted(sizes, recompute, args.batch, args.seq, kind)}  # fmt: skip
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}))


if __name__ == "__main__":
    main()
