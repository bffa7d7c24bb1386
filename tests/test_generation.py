"""Generation: the key/value cache gives the uncached text, and the text is the same byte for byte on 1, 2
and 3 ranks with 1, 2 or 3 groups of prompts, greedy or sampled, from GPT checkpoints trained with the loop
and the V placement and from a Hugging Face Llama, whose greedy tokens are those of transformers' own
``generate``; the decode loop as a program, and its bubble; and one clear line for each bad input."""

from __future__ import annotations

import functools
import importlib.util
import io
import os
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import pytest
import torch

from pipeclock import cli, comms
from pipeclock.checkpoints import choice as checkpoint_choice
from pipeclock.checkpoints import save_load as checkpoint
from pipeclock.engine.program import check, describe
from pipeclock.generation.decode_program import decode_program, simulate
from pipeclock.generation.pipeline import split_groups
from pipeclock.models.decoding import PromptCache, forward_cached
from pipeclock.models.gpt import GPTConfig, gpt_sequential
from pipeclock.models.sampling import choose, sample, uniform_for
from pipeclock.training.loop import TrainConfig, train
from tests.distributed import run_ok, start_ranks
from tests.generation_cases import CASES, PROMPTS, STOP, TOKENS, case_name, generate_cases, on_ranks, stop_for

TINY = GPTConfig(dim=16, layers=2, heads=2, seq_len=16, seed=3)
TRAIN = dict(model="gpt", dim=16, layers=2, heads=2, seq_len=16, batch_size=4, microbatches=2, steps=1)


@pytest.fixture
def one_thread():
    """One intra-op thread, as the generate command runs (batch-one steps: more threads only spin)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_cache_gives_the_uncached_text_greedy_and_sampled_through_a_sliding_window(one_thread):
    model = gpt_sequential(TINY).eval()
    for temperature in (0.0, 1.0):
        for index, prompt in enumerate(PROMPTS):
            ids = torch.tensor(list(prompt))
            cached = sample(model, ids, 24, TINY.seq_len, temperature, 0, 5, index, cache=True)
            plain = sample(model, ids, 24, TINY.seq_len, temperature, 0, 5, index, cache=False)
            assert torch.equal(cached, plain) and len(cached) == len(prompt) + 24


def test_a_cached_step_computes_the_full_forwards_last_logits():
    model = gpt_sequential(TINY).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = PromptCache(model, TINY.seq_len)
    forward_cached(model, ids[:, :5], cache)
    for end in range(6, 13):
        logits = forward_cached(model, ids[:, end - 1 : end], cache)
        with torch.no_grad():
            assert torch.allclose(logits, model(ids[:, :end])[0, -1], atol=1e-5)
    assert cache.length == 12 and all(layer.length == 12 for layer in cache.layers.values())
    several = PromptCache(model, TINY.seq_len)
    forward_cached(model, ids[:, :5], several)
    logits = forward_cached(
        model, ids[:, 5:9], several
    )  # four tokens after a cached prefix: causal among them
    with torch.no_grad():
        assert torch.allclose(logits, model(ids[:, :9])[0, -1], atol=1e-5)


def test_a_gpt_with_an_end_of_text_id_is_sampled_among_the_bytes_alone():
    """A GPT trained on a prepared bytes folder has 257 ids (256 ends a document): generation, which
    writes bytes, reads only the first 256 logits of the head, even where id 256 is the likeliest."""
    from pipeclock.generation.stage_model import StageModel

    config = replace(TINY, vocab_size=257)
    stage = StageModel.of({"model": "GPT", "gpt": vars(config)}, "run", world=1)
    pieces = stage.build(0, 1).eval()
    with torch.no_grad():
        pieces.head.ln_f.weight.zero_()  # every hidden state becomes the norm's bias: all ones
        pieces.head.ln_f.bias.fill_(1.0)
        pieces.head.lm_head.weight[256] = 100.0  # the end-of-text id beats every byte by far
    ids = torch.tensor([list(b"hello")])
    with torch.no_grad():
        logits = stage.decoding.forward(pieces, ids, stage.decoding.new_cache(pieces, config.seq_len))
    assert logits.shape == (256,)
    full = forward_cached(pieces, ids, PromptCache(pieces, config.seq_len))
    assert full.shape == (257,) and int(full.argmax()) == 256 and torch.equal(logits, full[:256])


def test_draws_depend_on_seed_prompt_and_position_alone_and_temperature_zero_is_greedy():
    assert uniform_for(1, 2, 3) == uniform_for(1, 2, 3)
    assert len({uniform_for(1, 2, 3), uniform_for(1, 2, 4), uniform_for(1, 3, 3), uniform_for(2, 2, 3)}) == 4
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert choose(logits, 0.0, 0, 0.99) == 1
    assert choose(logits, 1e-45, 0, 0.99) == 1, "a tiny temperature tends to greedy, with no overflow"
    assert {choose(logits, 1.0, 2, d / 10) for d in range(10)} == {1, 3}, "top-k keeps the two likeliest"


def test_groups_are_contiguous_and_even():
    assert split_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_groups(3, 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="--groups must be between 1 and the number of prompts"):
        split_groups(2, 3)


def test_one_group_leaves_p_minus_1_of_p_ranks_idle_and_p_groups_keep_the_ring_full():
    for p in (2, 3, 4):
        alone = simulate(p, [1], 50)
        full = simulate(p, [1] * p, 50)
        assert alone.bubble_share == pytest.approx((p - 1) / p)
        assert full.bubble_share < 0.1
        assert 50 * p / full.makespan > 0.9 * p * (50 / alone.makespan), "p groups: about p times the bytes/s"


def test_the_decode_loop_is_a_forward_only_program_whose_last_rank_sends_each_byte_to_rank_0():
    programs = decode_program(2, 2, 2)  # 2 ranks, 2 groups, 2 tokens: virtual stage = token * 2 + rank
    check(programs)
    assert describe(programs) == (
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1\n"
        "rank 1: 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3F1"
    )
    assert {(i.stage, i.peer) for i in programs[1] if i.kind == "SEND_F"} == {(1, 0)}, "the byte goes round"
    assert [str(i) for i in decode_program(1, 2, 2)[0]] == ["0F0", "0F1", "1F0", "1F1"], "one rank: in memory"


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HF_TRAIN = {k: v for k, v in TRAIN.items() if k not in ("model", "dim", "layers", "heads")}


def train_every_kind(rank: int, world: int, root: str) -> None:
    """The GPT on the loop and the V placement; Hugging Face's Llama (rotary positions, grouped-query
    attention, a byte vocabulary) where transformers is installed."""
    for name, schedule in (("loop", "interleaved-1f1b"), ("v", "zb-v")):
        train(TrainConfig(**TRAIN, schedule=schedule, chunks=2, checkpoint_dir=f"{root}/{name}"))
    if HAS_TRANSFORMERS:
        llama = TrainConfig(**HF_TRAIN, model="hf", hf_config=f"{root}/llama.json")
        train(replace(llama, checkpoint_dir=f"{root}/llama"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("generation")
    kinds = ["loop", "v"]
    if HAS_TRANSFORMERS:
        from tests.hf_cases import llama_config

        llama = llama_config(layers=2)
        llama.vocab_size = 256  # every token a byte: transformers' generate picks among the same ones
        llama.to_json_file(str(root / "llama.json"))
        kinds.append("llama")
    run_ok(train_every_kind, 2, str(root), deadline=300)
    return [str(root / kind) for kind in kinds]


class AmongBytes(torch.nn.Module):
    """A model's logits cut to the 256 bytes, as generation samples a larger vocabulary."""

    def __init__(self, whole: torch.nn.Module) -> None:
        super().__init__()
        self.whole = whole

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.whole(ids)[..., :256]


@functools.cache
def reference(directory: str, temperature: float, cache: bool, stop: bytes) -> list[str]:
    """One process, the whole model, ``sampling.sample``: each prompt's generated bytes (hex)."""
    model, run = checkpoint.load_model(checkpoint_choice.resolve(directory))
    seq_len = run["gpt"]["seq_len"] if run["model"] == "GPT" else run["seq_len"]
    texts = []
    for index, prompt in enumerate(PROMPTS):
        ids = sample(AmongBytes(model), torch.tensor(list(prompt)), TOKENS, seq_len, temperature, 0, 7, index,
                     cache)  # fmt: skip
        made = bytes(ids.tolist()[len(prompt) :])
        if stop and stop in made:
            made = made[: made.index(stop) + len(stop)]
        texts.append(made.hex())
    return texts


@pytest.fixture(scope="module")
def generated(checkpoints) -> dict[int, dict[str, list[str]]]:
    """Every case of ``tests.generation_cases`` on 1, 2 and 3 ranks: {ranks: {case: bytes per prompt}}."""
    launches = {p: start_ranks(on_ranks, p, checkpoints, deadline=300) for p in (2, 3)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = {1: generate_cases(checkpoints)}
    finally:
        comms.shutdown()
        torch.set_num_threads(threads)
    for p, launch in launches.items():
        found[p] = launch.values()[-1]  # the last rank's
    return found


def test_the_text_is_the_same_on_1_2_and_3_ranks_with_any_groups_and_either_placement(
    checkpoints, generated, one_thread
):
    for directory in checkpoints:
        for groups, temperature, cache, stop in CASES:
            name = case_name(directory, groups, temperature, cache, stop)
            if stop:
                stop = stop_for(bytes.fromhex(reference(directory, 0.0, cache=False, stop=b"")[0]))
            expected = reference(directory, temperature, cache=False, stop=stop)
            for p in (1, 2, 3):
                assert generated[p][name] == expected, (p, name)
        stopped = generated[1][case_name(directory, 3, 0.0, True, STOP)][0]
        assert len(bytes.fromhex(stopped)) <= 3, (
            "the stop string ends the first prompt's text at its third byte"
        )


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers (pip install pipeclock[hf])")
def test_a_hugging_face_model_gives_transformers_generates_greedy_tokens_on_any_cut(
    checkpoints, generated, one_thread
):
    from transformers import AutoModelForCausalLM

    from pipeclock.models.registry import hf_config

    directory = next(d for d in checkpoints if d.endswith("llama"))
    whole, run = checkpoint.load_model(checkpoint_choice.resolve(directory))
    model = AutoModelForCausalLM.from_config(hf_config(run)).eval()
    model.load_state_dict(whole.state_dict())
    for index, prompt in enumerate(PROMPTS):
        within = run["seq_len"] - len(prompt) + 1  # the bytes made before the window slides
        ids = torch.tensor([list(prompt)])
        made = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=within,
                              do_sample=False, use_cache=True, pad_token_id=0)[0, len(prompt) :]  # fmt: skip
        for p in (1, 2, 3):
            for groups in (1, 2, 3):
                ours = bytes.fromhex(generated[p][case_name(directory, groups, 0.0, True, b"")][index])
                assert list(ours[:within]) == made.tolist(), (p, groups, index)


@pytest.fixture
def one_checkpoint(checkpoints):
    return checkpoints[0]


def error_of(*argv: str, world: int = 1) -> tuple[int, str]:
    stderr, saved = io.StringIO(), os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        with redirect_stderr(stderr), redirect_stdout(io.StringIO()):
            code = cli.main(["generate", *argv])
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.update(WORLD_SIZE=saved)
    return code, stderr.getvalue().strip()


def test_bad_input_is_one_clear_line(one_checkpoint, checkpoints, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"\n\n")
    cases = {
        "prompt longer than the context": (["--prompt", "x" * 17], 1,
            "prompt is 17 bytes, longer than the model's context of 16 bytes"),
        "empty prompts file": (["--prompts", str(empty)], 1, f"--prompts {empty} holds no prompt"),
        "negative temperature": (["--temperature", "-0.5"], 1,
            "argument --temperature: must be a number >= 0"),
        "more ranks than pieces": ([], 5,
            "has 4 pieces (embedding, blocks, head): it cannot be cut into 5 stages"),
        "more groups than prompts": (["--groups", "2"], 1,
            "--groups must be between 1 and the number of prompts"),
    }  # fmt: skip
    for name, (flags, world, expected) in cases.items():
        code, message = error_of(one_checkpoint, *flags, world=world)
        assert code == 2 and expected in message and message.count("\n") == 0, (name, message)
    for directory in (d for d in checkpoints if d.endswith("llama")):
        code, message = error_of(directory, world=5)
        expected = "has 4 pieces (embedding, layers, head): it cannot be cut into 5 stages"
        assert code == 2 and expected in message and message.count("\n") == 0, message


def test_prompts_are_bytes_invalid_utf8_included_and_temperature_zero_stays_greedy(one_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"ab\xff\n\nimport os\n")
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        flags = ["--prompts", str(prompts), "--tokens", "5", "--temperature", "0"]
        assert cli.main(["generate", one_checkpoint, "--prompt", os.fsdecode(b"def "), *flags]) == 0
    lines = out.getvalue().splitlines()
    made = reference(one_checkpoint, 0.0, cache=False, stop=b"")
    expected_first = (b"def " + bytes.fromhex(made[0])[:5]).decode("utf-8", "replace")
    assert lines[0].startswith("[0] ") and (lines[0][4:] + "\n").startswith(expected_first.split("\n")[0])
    assert sum(line.startswith("[1] ab\ufffd") for line in lines) == 1, "the bad byte reads as U+FFFD"
