"""Shared cases for the tensor-parallel tests: the MLP, the GPT and a Hugging Face Llama split by their
own plans on a mesh, each step's distance from the whole model's on one process, and tp's collectives."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from pipeclock import parallel, schedule
from pipeclock.engine import rng
from pipeclock.engine.losses import TokenCrossEntropy
from pipeclock.engine.ties import tie_key
from pipeclock.models import gpt, mlp
from tests.cases import PLACEMENT, SCHEDULE_CHUNKS
from tests.hf_cases import llama_config, padded_batch, reference

TOLERANCE = 1e-5
GPT_CONFIG = dict(dim=16, layers=2, heads=2, seq_len=8, seed=11)
MLP_WIDTH, MLP_LAYERS = 16, 8  # two layers per virtual stage even on 2 ranks x 2 chunks: a pair each


# tp's collectives per micro-batch on each stage of the GPT at pp 2 (docs/three-axes.md): stage 0 the
# embedding's all-reduce and h0's 2 forward and 4 backward ones; stage 1 h1's 6, the head's all-gather
# forward and all-reduce backward
CALLS_PER_MICROBATCH = {0: 1 + 6, 1: 6 + 2}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor gathered whole: a DTensor (split by tp, sharded by FSDP2) is a collective of its mesh."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def gaps(loss: float, want_loss: float, chunks, want: dict, pipe, mesh) -> dict[str, float]:
    """How far the pipelined step is from one process: its loss, its worst gradient, its gradient norm."""
    grads = [
        relative_gap(whole(p.grad), want[tie_key(p) or name])
        for chunk in chunks
        for name, p in chunk.named_parameters()
    ]
    want_norm = torch.stack([g.norm() for g in want.values()]).norm().item()
    norm = parallel.grad_norm(pipe, mesh)
    return {
        "loss": abs(loss - want_loss) / abs(want_loss),
        "grad": max(grads),
        "norm": abs(norm - want_norm) / want_norm,
        "stages on another replica or tp rank": float(len(strangers(pipe.peers, mesh))),
    }


def strangers(peers: list[int], mesh) -> list[int]:
    """The ranks of this rank's pipeline that are not its replica's ranks of its own tp index."""
    tp, per_replica = mesh["tp"].size(), mesh["pp"].size() * mesh["tp"].size()
    me = torch.distributed.get_rank()
    return [p for p in peers if p % tp != me % tp or p // per_replica != me // per_replica]


def token_batch(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets where sample i ends in ``i % 5`` padding positions (ignored by the loss)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, 8), generator=generator)
    targets = torch.randint(0, vocab, (batch, 8), generator=generator)
    for sample in range(batch):
        if sample % 5:
            targets[sample, -(sample % 5) :] = -100
    return ids, targets


def pipeline(mesh, name: str, chunks, m: int, loss_fn, replicas=None):
    if replicas is not None:
        chunks = replicas.chunks
    return schedule.Pipeline(chunks, name, m, loss_fn, group=mesh.get_group("pp"), replicas=replicas)


def built(mesh, chunks, plan):
    """The chunks split by tp, then replicas over dp (FSDP2) when the mesh has several."""
    parallel.tensor_parallel(chunks, mesh, plan)
    if mesh["dp"].size() == 1:
        return chunks, None
    replicas = parallel.data_parallel(chunks, mesh, "fsdp")
    return replicas.modules, replicas


def my_shard(mesh, *batch):
    mine = parallel.shard_of(len(batch[0]), mesh["dp"].size(), parallel.dp_rank(mesh))
    return [tensor[mine.start : mine.stop] for tensor in batch]


def mlp_case(mesh, name: str, m: int) -> dict[str, float]:
    pp, tp, chunks_per_rank = mesh["pp"].size(), mesh["tp"].size(), SCHEDULE_CHUNKS[name]
    placement = PLACEMENT.get(name)
    chunks = mlp.ShardedMLP.for_rank(
        MLP_WIDTH, MLP_LAYERS, parallel.pp_rank(mesh), pp, chunks_per_rank, seed=3, placement=placement
    )
    stages = mlp.partition(MLP_LAYERS, pp * chunks_per_rank)
    chunks, replicas = built(mesh, chunks, mlp.tp_plan(MLP_WIDTH, stages, tp))
    generator = torch.Generator().manual_seed(m)
    inputs, targets = (
        torch.randn(2 * m + 1, MLP_WIDTH, generator=generator),
        torch.randn(2 * m + 1, MLP_WIDTH, generator=generator),
    )
    pipe = pipeline(mesh, name, chunks, m, F.mse_loss, replicas)
    loss = pipe.step(*my_shard(mesh, inputs, targets))
    reference = mlp.full_mlp(MLP_WIDTH, MLP_LAYERS, seed=3)
    want_loss = F.mse_loss(reference(inputs), targets)
    want_loss.backward()
    want = {
        f"layers.{i // 2}.{n}": p.grad
        for i, layer in enumerate(reference)
        for n, p in layer.named_parameters()
    }
    return gaps(loss, want_loss.item(), chunks, want, pipe, mesh)


def gpt_case(mesh, name: str, m: int, dropout: float = 0.2) -> dict[str, float]:
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    config = gpt.GPTConfig(**GPT_CONFIG, dropout=dropout)
    chunks = gpt.GPT.for_rank(config, parallel.pp_rank(mesh), pp, SCHEDULE_CHUNKS[name], PLACEMENT.get(name))
    chunks, replicas = built(mesh, chunks, gpt.tp_plan(config, tp))
    ids, targets = token_batch(2 * m + 1, config.vocab_size, seed=m)
    pipe = pipeline(mesh, name, chunks, m, TokenCrossEntropy(), replicas)
    loss = pipe.step(*my_shard(mesh, ids, targets))
    reference = gpt.gpt_sequential(config)
    with rng.keyed(step=0, first_sample=0):
        want_loss = TokenCrossEntropy().mean(reference(ids), targets)
    want_loss.backward()
    found = gaps(
        loss, want_loss.item(), chunks, {n: p.grad for n, p in reference.named_parameters()}, pipe, mesh
    )
    if dropout:  # the masks matter: without them the loss is another
        with rng.keyed(step=0, first_sample=0):
            undropped = TokenCrossEntropy().mean(
                gpt.gpt_sequential(gpt.GPTConfig(**GPT_CONFIG))(ids), targets
            )
        found["dropout changed the loss"] = float(abs(undropped.item() - loss) > 1e-3)
    return found


def llama_case(mesh, name: str, m: int, tied: bool = False) -> dict[str, float]:
    from pipeclock.models import hf

    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    config = llama_config(layers=2)
    config.tie_word_embeddings = tied
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = hf.split(
            config,
            parallel.pp_rank(mesh),
            pp,
            chunks=SCHEDULE_CHUNKS[name],
            placement=PLACEMENT.get(name),
            seed=5,
        )
    chunks, replicas = built(mesh, split if isinstance(split, list) else [split], hf.tp_plan(config, tp))
    (ids, mask), labels = padded_batch(2 * m + 1, 8, seed=m)
    pipe = pipeline(mesh, name, chunks, m, hf.loss(), replicas)
    shard_ids, shard_mask, shard_labels = my_shard(mesh, ids, mask, labels)
    loss = pipe.step((shard_ids, shard_mask), shard_labels)
    want_loss, want = reference(config, 5, (ids, mask), labels)
    return gaps(loss, want_loss, chunks, want, pipe, mesh)


CASES = {
    "mlp": mlp_case,
    "gpt": gpt_case,
    "llama": llama_case,
    "llama-tied": lambda mesh, name, m: llama_case(mesh, name, m, tied=True),
}


def layouts(rank: int, world: int, runs: list[tuple[int, int, list[tuple[str, str, int]]]]) -> dict:
    """Each (dp, tp, cases) of ``runs`` on a mesh of its own: (model, schedule, m) -> its gaps."""
    found = {}
    for dp, tp, cases in runs:
        mesh = parallel.init_mesh(dp, tp)
        for model, name, m in cases:
            found[(dp, mesh["pp"].size(), tp, model, name, m)] = CASES[model](mesh, name, m)
    return found
