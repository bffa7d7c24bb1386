"""Expert parallel: a mixture of experts whose experts are divided over the dp ranks gives one process's step.

Each MoE layer's experts are split over ``ep`` ranks carved from the dp ranks of a stage; tokens reach
their expert's rank and come back by all-to-all. For a Mixtral-like and a Qwen3-MoE-like model, with the
routers' auxiliary loss in the loss, the loss, every gradient (the experts' gathered whole) and the
gradient norm equal the unmodified ``transformers`` model's on one process, fed the same micro-batches
(the auxiliary loss is per micro-batch, weighted as the token loss). A router that sends every token to
the first rank's experts leaves the others' experts without a token: they still join every exchange.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock import parallel, schedule
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.microbatch import split_microbatches
from pipeclock.engine.ties import tie_key
from pipeclock.parallel.experts import WithExperts, expert_parallel
from tests.cases import PLACEMENT, SCHEDULE_CHUNKS
from tests.distributed import run_ok
from tests.hf_cases import padded_batch, relative_gap

TOLERANCE = 1e-5
SEED = 5
FAMILIES = ("mixtral", "qwen3_moe")


def moe_config(family: str):
    """Two layers, four experts, top 2, the auxiliary loss on (it moves the loss)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2, output_router_logits=True,
                 router_aux_loss_coef=0.5)  # fmt: skip
    if family == "mixtral":
        return MixtralConfig(**sizes, num_local_experts=4)
    return Qwen3MoeConfig(**sizes, num_experts=4, moe_intermediate_size=16)


def to_first_experts(model: torch.nn.Module) -> None:
    """Routers that send every token to the first k experts, all held by ep rank 0: the family's own
    router runs (its logits and weights, the auxiliary loss's input), its choice of experts overruled."""

    def first(module, args, output):
        logits, weights, chosen = output
        return logits, weights, torch.arange(chosen.shape[-1]).expand_as(chosen)

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(first)


def reference(family: str, pieces, routing: str) -> tuple[float, dict, list[torch.Tensor]]:
    """The whole HF model on one process over the same micro-batches (each weighted by its counted
    tokens, as gradient accumulation would): the loss, every gradient by name, the experts chosen."""
    from transformers import AutoModelForCausalLM

    from pipeclock.models import hf

    config = moe_config(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf.prepared_config(config))
    model.load_state_dict(hf.whole(config, seed=SEED).state_dict())
    if routing == "one rank":
        to_first_experts(model)
    chosen: list[torch.Tensor] = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
    counter = TokenCrossEntropy(shift=True)
    total = sum(counter.count(labels) for _, labels in pieces)
    loss = 0.0
    for (ids, mask), labels in pieces:
        piece = model(input_ids=ids, attention_mask=mask, labels=labels).loss * (
            counter.count(labels) / total
        )
        piece.backward()
        loss += piece.item()
    return loss, {name: p.grad for name, p in model.named_parameters()}, chosen


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient gathered whole: FSDP2's shards over dp, an expert block over its ep group."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def pieces_of(batch, dp: int, m: int) -> list:
    """The global batch as the mesh cuts it: dp contiguous shards, each in m micro-batches."""
    (ids, mask), labels = batch
    found = []
    for replica in range(dp):
        mine = parallel.shard_of(len(ids), dp, replica)
        parts = [split_microbatches(t[mine.start : mine.stop], m) for t in (ids, mask, labels)]
        found += [((i, k), y) for i, k, y in zip(*parts, strict=True)]
    return found


def ep_case(mesh, ep: int, family: str, name: str, m: int, routing: str) -> dict[str, float]:
    """One step of this mesh with experts over ``ep`` ranks: its gaps from one process."""
    from pipeclock.models import hf

    dp, pp = mesh["dp"].size(), mesh["pp"].size()
    config = moe_config(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = hf.split(
            config, parallel.pp_rank(mesh), pp, chunks=SCHEDULE_CHUNKS[name], placement=PLACEMENT.get(name),
            seed=SEED,
        )  # fmt: skip
    chunks = split if isinstance(split, list) else [split]
    if routing == "one rank":
        for chunk in chunks:
            to_first_experts(chunk)
    experts = expert_parallel(chunks, mesh, hf.ep_plan(config, ep), ep)
    replicas = parallel.data_parallel(chunks, mesh, "fsdp", experts.parameters)
    pipe = schedule.Pipeline(
        replicas.chunks, name, m, hf.loss(config), group=mesh.get_group("pp"),
        replicas=WithExperts(replicas, experts),
    )  # fmt: skip
    batch = padded_batch(2 * dp * m + 1, 8, seed=m + dp)
    (ids, mask), labels = batch
    mine = parallel.shard_of(len(ids), dp, parallel.dp_rank(mesh))
    loss = pipe.step(
        (ids[mine.start : mine.stop], mask[mine.start : mine.stop]), labels[mine.start : mine.stop]
    )
    want_loss, want, chosen = reference(family, pieces_of(batch, dp, m), routing)
    grads = [
        relative_gap(whole(p.grad), want[tie_key(p) or n])
        for chunk in replicas.modules
        for n, p in chunk.named_parameters()
    ]
    want_norm = torch.stack([g.norm() for g in want.values()]).norm().item()
    found = {
        "loss": abs(loss - want_loss) / abs(want_loss),
        "grad": max(grads),
        "norm": abs(parallel.grad_norm(pipe, mesh) - want_norm) / want_norm,
        "expert blocks held": float(sum(p.to_local().shape[0] for p in experts.parameters)),
        "decoder layers held": float(
            sum(type(m).__name__.endswith("DecoderLayer") for c in chunks for m in c.modules())
        ),
    }
    if routing == "one rank":  # the case is what it says: no token for any expert past the first two
        found["tokens routed past the first rank"] = float(sum(int((c >= 2).sum()) for c in chosen))
    return found


def ep_cases(rank: int, world: int, runs: list[tuple[int, int, list[tuple]]]) -> dict:
    """Each (dp, ep, cases) of ``runs`` on a mesh of its own: (family, schedule, m, routing) -> gaps."""
    found = {}
    for dp, ep, cases in runs:
        mesh = parallel.init_mesh(dp)
        for family, name, m, routing in cases:
            found[(dp, mesh["pp"].size(), ep, family, name, m, routing)] = ep_case(
                mesh, ep, family, name, m, routing
            )
    return found


def check(world: int, runs) -> None:
    """Every rank within tolerance, holding its 1/ep of each of its layers' experts (two fused weights
    per layer), and the ranks together holding each replica's two layers (a V may leave a rank none)."""
    per_rank = run_ok(ep_cases, world, runs, deadline=600)
    for rank, found in enumerate(per_rank):
        for key, gaps in found.items():
            ep = key[2]
            assert gaps["loss"] <= TOLERANCE, (rank, key, gaps)
            assert gaps["grad"] <= TOLERANCE, (rank, key, gaps)
            assert gaps["norm"] <= TOLERANCE, (rank, key, gaps)
            blocks = 2 * (4 // ep) * gaps["decoder layers held"]
            assert gaps["expert blocks held"] == blocks, (rank, key, gaps)
            assert gaps.get("tokens routed past the first rank", 0.0) == 0.0, (rank, key, gaps)
    for key in per_rank[0]:
        dp = key[0]
        assert sum(found[key]["decoder layers held"] for found in per_rank) == 2 * dp, key


def cases(m: int = 2) -> list[tuple]:
    return [(family, "1f1b", m, routing) for family in FAMILIES for routing in ("learned", "one rank")]


def test_dp2_x_ep2_gives_one_process_loss_gradients_and_norm_with_the_auxiliary_loss():
    check(2, [(2, 2, [("mixtral", "1f1b", 2, "learned"), ("qwen3_moe", "zb-h1", 2, "one rank")])])


@pytest.mark.long
def test_pp2_x_dp2_x_ep2_dp4_x_ep2_and_dp4_x_ep4_give_one_process_loss_gradients_and_norm():
    """pp 2 x dp 2 x ep 2 on every schedule kind: one chunk a rank, looped (interleaved) and V-placed."""
    other_schedules = [
        ("mixtral", "interleaved-1f1b", 2, "one rank"),
        ("qwen3_moe", "zb-h1", 3, "learned"),
        ("mixtral", "zb-v", 2, "learned"),  # two chunks a rank, placed in a V
        ("qwen3_moe", "dualpipev", 4, "one rank"),
    ]
    check(4, [(2, 2, cases() + other_schedules), (4, 2, cases(1)), (4, 4, cases(1))])
