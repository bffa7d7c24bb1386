"""``pipeclock.models.hf`` in one process: what a split holds, and one clear line for what it cannot split."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from pipeclock.engine.notices import RunWarning
from pipeclock.engine.ties import tie_key
from pipeclock.models import hf
from tests.hf_cases import gpt2_config, llama_config, one_line_error, padded_batch


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
