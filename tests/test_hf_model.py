"""``pipeclock.models.hf`` in one process: what a split holds, and one clear line for what it cannot split."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock.engine.notices import RunWarning
from pipeclock.engine.ties import tie_key
from pipeclock.models import hf
from tests.hf_cases import gpt2_config, llama_config, padded_batch


def other_families():
    """Qwen2 (sliding-window layers), Mistral (a sliding window everywhere), Gemma (scaled embeddings)."""
    from transformers import GemmaConfig, MistralConfig, Qwen2Config

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300)  # fmt: skip
    return [
        Qwen2Config(**sizes, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        MistralConfig(**sizes, sliding_window=3, head_dim=4),
        GemmaConfig(**sizes, head_dim=4),
    ]


def chained(config, num_stages: int, inputs):
    """The stages of a split run one after the other in this process (evaluation mode)."""
    x = inputs
    for stage in range(num_stages):
        x = hf.split(config, stage, num_stages, seed=3).eval()(x)
    return x


@pytest.mark.parametrize(
    "family", [gpt2_config, llama_config, *other_families()], ids=lambda c: type(c).__name__
)
def test_any_cut_of_a_family_gives_the_unmodified_models_logits(family):
    from transformers import AutoModelForCausalLM

    config = family() if callable(family) else family
    whole = hf.whole(config, seed=3).eval()
    model = AutoModelForCausalLM.from_config(hf.build.prepared_config(config)).eval()
    model.load_state_dict(whole.state_dict())
    (ids, mask), _ = padded_batch(3, 8, seed=0)
    want = model(input_ids=ids, attention_mask=mask).logits
    for num_stages in (1, 3, config.num_hidden_layers + 2):
        assert torch.equal(chained(config, num_stages, (ids, mask)), want), num_stages


def test_a_rank_holds_only_its_pieces_under_hf_names_and_the_tied_head_is_declared():
    config = gpt2_config()
    first, last = hf.split(config, 0, 4, seed=1), hf.split(config, 3, 4, seed=1)
    first_names = [name for name, _ in first.named_parameters()]
    assert first_names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert all(
        name.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0.")) for name in first_names
    )
    head = dict(last.named_parameters())["lm_head.weight"]
    assert tie_key(head) == "transformer.wte.weight"
    assert torch.equal(head, first.transformer.wte.weight), "the copies start equal"
    assert not any(p.is_meta for stage in (first, last) for p in [*stage.parameters(), *stage.buffers()])
    untied = hf.split(llama_config(), 3, 4, seed=1)
    assert tie_key(dict(untied.named_parameters())["lm_head.weight"]) is None


def test_a_split_is_the_whole_model_built_the_same_way():
    config = llama_config()
    whole = dict(hf.whole(config, seed=4).named_parameters())
    for stage in range(3):
        for name, parameter in hf.split(config, stage, 3, seed=4).named_parameters():
            assert torch.equal(parameter, whole[name]), name


def test_a_model_already_built_is_split_with_its_own_weights():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(llama_config())
    state = model.state_dict()
    for name, parameter in hf.split(model, 2, 3).named_parameters():
        assert torch.equal(parameter, state[name]), name


def test_a_stage_sends_plain_tensors():
    (ids, mask), _ = padded_batch(2, 8, seed=0)
    out = hf.split(llama_config(), 0, 3, seed=0)((ids, mask))
    assert isinstance(out, dict) and all(type(t) is torch.Tensor for t in out.values())
    assert torch.equal(out["attention_mask"], mask) and torch.equal(out["input_ids"], ids)


def test_attention_dropout_stays_on_keyed_so_any_cut_gives_the_keyed_models_gradients():
    """GPT-2's attention dropout (drawn inside the attention kernel) with its other dropout: one step on
    1, 3 and 8 virtual stages leaves the loss and gradients of ``transformers``' model keyed alike."""
    from pipeclock import schedule
    from tests.hf_cases import reference, worst_gap

    config = gpt2_config(dropout=0.1)
    config.attn_pdrop = 0.3
    inputs, labels = padded_batch(4, 8, seed=2)
    want = reference(config, 5, inputs, labels)
    for chunks in (1, 3, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing is turned off
            stages = hf.split(config, 0, 1, chunks=chunks, seed=5)
        stages = stages if isinstance(stages, list) else [stages]
        name = "interleaved-1f1b" if chunks > 1 else "1f1b"
        loss = schedule.Pipeline(stages, name, 1, hf.loss()).step(inputs, labels)
        assert worst_gap(loss, stages, *want) <= 1e-5, chunks
    config.attn_pdrop = 0.0
    assert reference(config, 5, inputs, labels)[0] != want[0], "attention dropout is at work"


def one_line_error(call) -> str:
    with pytest.raises((ValueError, OSError)) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_what_cannot_be_split_is_one_clear_line(tmp_path):
    from transformers import BertConfig, T5Config, ViTConfig

    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig

    assert "encoder-decoder" in one_line_error(lambda: hf.split(T5Config(), 0, 2))
    assert "not a causal language model" in one_line_error(lambda: hf.split(ViTConfig(), 0, 2))
    assert "encoder models are not causal LMs" in one_line_error(lambda: hf.split(BertConfig(), 0, 2))
    assert "cannot be cut into 9 stages" in one_line_error(lambda: hf.split(llama_config(), 0, 9))
    small = tmp_path / "small"
    gpt2_config().save_pretrained(str(small))  # 300 tokens: enough
    tiny = llama_config()
    tiny.vocab_size = 100
    tiny.save_pretrained(str(tmp_path / "tiny"))
    message = one_line_error(lambda: HFTask(TrainConfig(model="hf", hf_config=str(tmp_path / "tiny"))))
    assert "vocabulary of 100 tokens" in message
    message = one_line_error(lambda: hf.split(str(small), 0, 2))
    assert "holds no weights" in message


# --- modules without parameters ------------------------------------------------------------------------


def norm_without_weights_families():
    """OLMo (a LayerNorm without weight or bias) and NanoChat (an RMSNorm without weight): the final norm
    holds no parameter, so only the model's own forward knows it is there."""
    from transformers import NanoChatConfig, OlmoConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)  # fmt: skip
    return [OlmoConfig(**sizes), NanoChatConfig(**sizes)]


@pytest.mark.parametrize("config", norm_without_weights_families(), ids=lambda c: type(c).__name__)
def test_a_final_norm_without_weights_is_run_so_the_exported_model_gives_the_pipelines_loss(config, tmp_path):
    """Three stages on one process (the norm on the last), one step; the stages' weights exported and
    read back by ``transformers``, whose ``labels=`` loss on the batch is the pipeline's."""
    from transformers import AutoModelForCausalLM

    from pipeclock import schedule

    stages = hf.split(config, 0, 1, chunks=3, seed=2)
    inputs, labels = padded_batch(5, 8, seed=1)
    loss = schedule.Pipeline(stages, "interleaved-1f1b", 2, hf.loss()).evaluate(inputs, labels)
    state = {name: t for stage in stages for name, t in stage.state_dict().items()}
    hf.save_pretrained(state, config, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    ids, mask = inputs
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert loss == pytest.approx(want, rel=1e-6)


def test_constants_the_familys_init_leaves_alone_are_the_constructors():
    """Apertus's xIELU activation sets its ``beta`` and ``eps`` buffers and its two parameters in its
    constructor, which ``_init_weights`` does not touch: every split holds the values ``transformers``
    gives when it builds the model for real (they were whatever memory held before)."""
    from transformers import ApertusConfig, AutoModelForCausalLM

    config = ApertusConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=300)  # fmt: skip
    real = {**dict(AutoModelForCausalLM.from_config(config).named_parameters()),
            **dict(AutoModelForCausalLM.from_config(config).named_buffers())}  # fmt: skip
    constants = [name for name in real if ".act_fn." in name]
    assert len(constants) == 4 * 3
    for stage in range(3):
        built = hf.split(config, stage, 3, seed=stage)
        held = {**dict(built.named_parameters()), **dict(built.named_buffers())}
        for name in constants:
            if name in held:
                assert torch.equal(held[name], real[name]), name


def test_a_bfloat16_checkpoint_trains_float32_master_weights_and_says_so(tmp_path):
    from transformers import LlamaForCausalLM

    config = llama_config(layers=2)
    config.dtype = "bfloat16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(tmp_path))
    with pytest.warns(RunWarning, match="weights stored as bfloat16 are trained as float32 master weights"):
        stages = hf.split(str(tmp_path), 0, 1)
    stored = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).state_dict()
    for name, parameter in stages.named_parameters():
        assert parameter.dtype == torch.float32 and torch.equal(parameter, stored[name].float()), name


def moe_families():
    """Mixtral and Qwen3-MoE: experts fused in memory (one gate_up_proj for all), per expert on disk."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2)  # fmt: skip
    return [MixtralConfig(**sizes, num_local_experts=4), Qwen3MoeConfig(**sizes, num_experts=4,
                                                                       moe_intermediate_size=16)]  # fmt: skip


def aux_loss_families():
    """Mixtral, Qwen2-MoE and Qwen3-MoE with their routers' auxiliary loss in the loss."""
    from transformers import Qwen2MoeConfig

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, num_experts_per_tok=2)  # fmt: skip
    qwen2 = Qwen2MoeConfig(
        **sizes, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )
    configs = [*moe_families(), qwen2]
    for config in configs:
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    return configs


@pytest.mark.parametrize("config", aux_loss_families(), ids=lambda c: type(c).__name__)
def test_the_routers_auxiliary_loss_is_summed_across_stages_as_transformers_adds_it(config):
    """One step on 1, 3 and 5 stages (every layer alone): the loss and gradients of transformers' own
    ``model(ids, attention_mask, labels=labels)``, auxiliary loss included (it moves the loss)."""
    from transformers import AutoModelForCausalLM

    from pipeclock import schedule
    from pipeclock.engine.ties import tie_key

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf.prepared_config(config))
    hf.keyed(model, 5)
    inputs, labels = padded_batch(4, 8, seed=3)
    out = model(input_ids=inputs[0], attention_mask=inputs[1], labels=labels)
    out.loss.backward()
    assert out.aux_loss.item() > 0.1, "the auxiliary loss counts"
    for chunks in (1, 3, 5):
        stages = hf.split(model, 0, 1, chunks=chunks, seed=5)
        stages = stages if isinstance(stages, list) else [stages]
        name = "interleaved-1f1b" if chunks > 1 else "1f1b"
        loss = schedule.Pipeline(stages, name, 1, hf.loss(config)).step(inputs, labels)
        assert loss == pytest.approx(out.loss.item(), rel=1e-6), chunks
        wanted = dict(model.named_parameters())
        for stage in stages:
            for name, parameter in stage.named_parameters():
                want = wanted[tie_key(parameter) or name].grad
                assert torch.allclose(parameter.grad, want, rtol=1e-5, atol=1e-7), (chunks, name)


@pytest.mark.parametrize("config", moe_families(), ids=lambda c: type(c).__name__)
def test_a_mixture_of_experts_reads_back_from_save_pretrained_and_from_its_own_export(config, tmp_path):
    """Each of 3 ranks reads its experts from the per-expert tensors transformers writes, fused as
    transformers fuses them; the stages written by ``hf.save_pretrained`` read back the same."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path / "saved"))
    state = model.state_dict()
    stages = [hf.split(str(tmp_path / "saved"), rank, 3) for rank in range(3)]
    assert any("experts.gate_up_proj" in name for stage in stages for name, _ in stage.named_parameters())
    for stage in stages:
        for name, parameter in stage.named_parameters():
            assert torch.equal(parameter, state[name]), name
    hf.save_pretrained(stages, config, tmp_path / "exported")
    read = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert all(torch.equal(tensor, state[name]) for name, tensor in read.state_dict().items())
    for rank in range(3):
        for name, parameter in hf.split(str(tmp_path / "exported"), rank, 3).named_parameters():
            assert torch.equal(parameter, state[name]), name


def model_with_its_own_code(directory: Path) -> None:
    """A config naming its own Python code (``auto_map``): a Llama under another model type."""
    directory.mkdir()
    (directory / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n"
        '    model_type = "tiny_own_code"\n'
    )
    (directory / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    code = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    }
    config = {**llama_config(layers=2).to_dict(), "model_type": "tiny_own_code", "auto_map": code}
    (directory / "config.json").write_text(json.dumps(config))


def test_a_models_own_code_runs_only_when_trusted_and_says_so(tmp_path, capsys):
    from pipeclock.cli.dispatch import main

    model_with_its_own_code(tmp_path / "own")
    message = one_line_error(lambda: hf.split(str(tmp_path / "own"), 0, 2))
    assert "holds the model's own Python code (auto_map): pass trust_remote_code=True" in message
    with pytest.warns(RunWarning, match="trust_remote_code: running the model's own Python code"):
        config = hf.config_of(str(tmp_path / "own"), trust_remote_code=True)
    stage = hf.split(config, 1, 2, trust_remote_code=True)
    assert type(stage._runner).__name__ == "TinyForCausalLM"  # the stage runs the model's own class
    args = ["train", "--model", "hf", "--hf-config", str(tmp_path / "own"), "--steps", "1", "--seq-len", "16",
            "--batch-size", "2", "--microbatches", "1", "--eval-batches", "1"]  # fmt: skip
    assert main(args) == 2
    assert "pass trust_remote_code=True (train --trust-remote-code)" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*args, "--trust-remote-code"]) == 0


# --- what train --model hf prints -------------------------------------------------------------------


def bigram_line(args: list[str], capsys) -> str:
    from pipeclock.cli.dispatch import main

    assert main(["train", *args]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "bigram byte model" in line]
    assert len(lines) == 1
    return lines[0].split(": ")[-1]


def test_the_bigram_baseline_of_an_hf_run_scores_each_byte_against_the_next_as_the_gpts(tmp_path, capsys):
    """The figure ``train --model hf`` prints beside its validation is the bigram byte model's bits per
    byte on the validation text's (byte, next byte) pairs: computed here from counts of the training
    split's pairs, and the same as ``train --model gpt`` prints on the same corpus."""
    from pipeclock.models.text import TextCorpus

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    llama_config(layers=2).save_pretrained(str(tmp_path / "llama"))
    common = ["--data", str(tmp_path / "corpus.txt"), "--steps", "1", "--batch-size", "4", "--seq-len", "16",
              "--eval-batches", "3", "--microbatches", "2"]  # fmt: skip
    hf_figure = bigram_line(["--model", "hf", "--hf-config", str(tmp_path / "llama"), *common], capsys)
    gpt = ["--model", "gpt", "--dim", "16", "--layers", "2", "--heads", "2"]
    gpt_figure = bigram_line([*gpt, *common], capsys)

    corpus = TextCorpus.from_path(tmp_path / "corpus.txt")
    train = corpus.train.tolist()
    counts = torch.ones(256, 256, dtype=torch.float64)  # add-one smoothing
    for previous, following in itertools.pairwise(train):
        counts[previous, following] += 1
    bits = []
    for inputs, targets in corpus.validation_batches(4, 16, 3):
        assert torch.equal(targets[:, :-1], inputs[:, 1:]), "each target is the byte after its input"
        for previous, following in zip(inputs.flatten().tolist(), targets.flatten().tolist(), strict=True):
            bits.append(-math.log2(counts[previous, following] / counts[previous].sum()))
    assert hf_figure == gpt_figure == f"{sum(bits) / len(bits):.3f} bits/byte"


# --- a model's own tokenizer ---------------------------------------------------------------------------


def test_a_model_directorys_tokenizer_reads_the_corpus_and_generate_decodes_with_it(tmp_path, capsys):
    """--hf-model DIR with a tokenizer in DIR: the corpus is its tokens, the checkpoint names it, export
    copies it, and generate (greedy) continues a prompt as the exported model and tokenizer do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeclock.cli.dispatch import main
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer

    text = Path(json.__file__).read_text()
    (tmp_path / "corpus.txt").write_text(text)
    model_with_tokenizer(tmp_path / "model", text)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    flags = dict(model="hf", hf_model=str(tmp_path / "model"), data=str(tmp_path / "corpus.txt"), seq_len=16)
    task = HFTask(TrainConfig(**flags, batch_size=4))
    train_text = text.encode()[: task.bytes.train.numel()].decode("utf-8", errors="replace")
    assert task.corpus.train.tolist() == tokenizer.encode(train_text, add_special_tokens=False)
    assert task.batch(0, 4)[0].max() >= 256  # tokens beyond the bytes' ids

    args = ["--model", "hf", "--hf-model", str(tmp_path / "model"), "--data", str(tmp_path / "corpus.txt"),
            "--seq-len", "16", "--steps", "2", "--batch-size", "4", "--microbatches", "2",
            "--checkpoint-dir", str(tmp_path / "run"), "--eval-batches", "1"]  # fmt: skip
    assert main(["train", *args]) == 0
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def f", "--tokens", "6",
                 "--temperature", "0"]) == 0  # fmt: skip
    generated = capsys.readouterr().out  # the text and a newline: strip() would also eat a generated \f
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ids = exported.encode("def f", add_special_tokens=False)
    with torch.no_grad():
        for _ in range(6):
            ids.append(model(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert generated == exported.decode(ids) + "\n"


def test_a_pretrained_model_trains_only_on_a_folder_its_own_tokenizer_prepared(tmp_path):
    """--hf-model DIR reads ids in DIR's tokenizer's words: a folder prepared as bytes, or by another
    tokenizer, is refused in one line naming the cure; one prepared by DIR's tokenizer is taken."""
    import shutil

    from pipeclock.cli.dispatch import main
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer
    from tests.token_cases import bpe_tokenizer, documents, write_jsonl

    texts = documents()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", texts)
    other = bpe_tokenizer(tmp_path / "other", texts)
    model_with_tokenizer(tmp_path / "model", "".join(texts))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the model's tokenizer becomes ``other``'s
        shutil.copy(other / name, tmp_path / "model" / name)
    other_again = bpe_tokenizer(tmp_path / "other_again", texts[::-1], vocab_size=300)
    for folder, tokenizer in (("bytes", "bytes"), ("own", tmp_path / "model"), ("another", other_again)):
        argv = ["prepare", str(jsonl), "--output", str(tmp_path / folder), "--tokenizer", str(tokenizer)]
        assert main([*argv, "--validation-fraction", "0.2"]) == 0
    flags = dict(model="hf", hf_model=str(tmp_path / "model"), seq_len=8, batch_size=4)
    assert HFTask(TrainConfig(**flags, data=str(tmp_path / "own"))).corpus.vocab_size <= 320
    for folder, prepared in (("bytes", "as bytes"), ("another", f"at {other_again}")):
        config = TrainConfig(**flags, data=str(tmp_path / folder))
        message = one_line_error(lambda config=config: HFTask(config))
        assert "was prepared" in message and prepared in message, message
        assert f"prepare --tokenizer {tmp_path / 'model'}" in message, message


def test_a_tokenizer_with_more_ids_than_the_model_is_one_clear_line(tmp_path):
    from pipeclock.training.hf_task import HFTask
    from pipeclock.training.loop import TrainConfig
    from tests.hf_cases import model_with_tokenizer

    model_with_tokenizer(tmp_path, "a few words to learn merges from")
    config = json.loads((tmp_path / "config.json").read_text())
    ids = config["vocab_size"]  # the tokenizer's, all of them
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": ids - 1}))
    message = one_line_error(lambda: HFTask(TrainConfig(model="hf", hf_model=str(tmp_path))))
    assert f"its tokenizer gives {ids} ids, more than the model's vocabulary of {ids - 1}" in message
