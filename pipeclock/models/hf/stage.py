"""One stage of a Hugging Face causal LM: some of its pieces, run by the model's own code.

A stage runs the family's own ``*ForCausalLM.forward``, whole, over a copy of the model whose decoder
layers are *slots*: a slot of a layer the stage holds calls that layer; the others stand in for layers
held elsewhere. So the causal mask, the rotary embedding's cos and sin, the position ids, whatever the
base model does between and after its layers (the final norm, with or without weights, OPT's output
projection), the logit scaling or soft-capping of the head: all of it is the family's code.

Where a stage starts and ends:

- every stage is fed the token ids (they travel with the hidden states: DeepSeek-V4's layers route by
  them); a stage without the embeddings runs stand-ins for them that give NaN of their output's shape
  (the base model reads only the shape and dtype there: a value read by mistake would show as NaN);
- a stage without the head stops when its last layer returns, and sends that layer's output, as it is
  (a tensor, or the tuple some families return); the embedding's stage alone sends the first layer's
  input;
- the next stage's slot for that last layer returns the received output (and every slot before it,
  whose value is never used, the same), so the base model's loop goes on exactly as it would have;
  where LayerDrop skipped that layer, the received hidden states go into the first layer it calls.

What travels is plain tensors: a tensor when the layer output is all there is, else a dict of the
output's tensors, the token ids and ``attention_mask`` (int64, forward only) and, when the loss needs
them, the routers' logits of the layers so far (`routers`). Positions are the model's own default,
``0 .. tokens - 1``, rebuilt on every stage, as ``model(input_ids, attention_mask, labels=...)`` does.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeclock.models.hf.routers import RouterLogits
from pipeclock.models.hf.structure import Layout

HIDDEN = "hidden"  # the message's key for a layer output that is one tensor
OUTPUT = "output"  # the message's keys for a tuple output's tensors: output0of2, output1of2 ...
MASK = "attention_mask"
IDS = "input_ids"
ROUTERS = "router_logits"


class _Stop(Exception):
    """Raised by the slot where a stage's work ends: the rest of the model's forward is skipped."""

    def __init__(self, output):
        super().__init__()
        self.output = output


@dataclass
class _Run:
    """What one forward of a stage knows: what it received, and the routers' logits it collects."""

    received: object = None  # the previous stage's last layer output (or the first layer's input)
    placed: bool = True  # ``received`` is in the model's forward (nothing to place on the first stage)
    routers: torch.Tensor | None = None  # the routers' logits of the layers before this stage's
    collected: list[torch.Tensor] = field(default_factory=list)  # this stage's layers' router logits


class _WithRouters(nn.Module):
    """The base model, whose output's ``router_logits`` become every layer's, received ones included."""

    def __init__(self, base: nn.Module, stage: HFStage):
        super().__init__()
        self.base = base
        object.__setattr__(self, "_stage", stage)

    def forward(self, *args, **kwargs):
        out = self.base(*args, **kwargs)
        run, routers = self._stage._run, self._stage.routers
        batch = out.last_hidden_state.shape[0]
        out["router_logits"] = tuple(routers.unpack(routers.pack(run.routers, run.collected, batch)))
        return out


class _Slot(nn.Module):
    """Decoder layer ``index`` inside the model's own forward (see the module's docstring)."""

    def __init__(self, index: int, layer: nn.Module, stage: HFStage, held: bool):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # the real layer, or a meta one held elsewhere
        object.__setattr__(self, "_stage", stage)
        self.index = index
        if held:  # the base's own parameters() (read for their dtype and device) are the held layers'
            self.held = layer

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)  # attention_type, layer_idx ...

    def forward(self, *args, **kwargs):
        return self._stage._slot(self.index, args, kwargs)


class HeldLayers(nn.ModuleDict):
    """A stage's decoder layers under their indices in the whole model ("3", "4"): a dict, which iterates
    over its layers as the model's ModuleList does (a family's init walks them so)."""

    def __iter__(self):
        return iter(self._modules.values())


class _Absent(nn.Module):
    """A module with parameters held by another stage, run before the layers: an embedding gives NaN of
    its output's shape (``width`` wide), anything else its input (their values are never used here).
    Its parameters read as tensors of their shape and dtype on the stage's device, holding no memory,
    for a forward that reads their device (Llama 4 moves the ids to the embedding's)."""

    def __init__(self, module: nn.Module, width: int | None, stage: nn.Module):
        super().__init__()
        self.width = module.embedding_dim if isinstance(module, nn.Embedding) else width
        self.dtype = next(module.parameters()).dtype
        self.shapes = {n: (p.shape, p.dtype) for n, p in module.named_parameters(recurse=False)}
        object.__setattr__(self, "_stage", stage)

    def __getattr__(self, name: str):
        shapes = self.__dict__.get("shapes", {})
        if name not in shapes:
            return super().__getattr__(name)
        shape, dtype = shapes[name]
        device = next((p.device for p in self._stage.parameters()), torch.device("cpu"))
        return torch.empty((), dtype=dtype, device=device).expand(shape)

    def forward(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        given = next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)
        if self.width is None:  # hidden states in, hidden states out (a norm, a projection)
            return given
        return torch.full((*given.shape, self.width), float("nan"), dtype=self.dtype, device=given.device)


def _shallow(module: nn.Module, children: dict[str, nn.Module], parameters: dict | None = None) -> nn.Module:
    """A copy of ``module`` that runs its own ``forward`` over other children, with the given parameters
    of its own and its buffers (constants every stage keeps)."""
    runner = copy.copy(module)
    runner._modules = dict(children)
    runner._parameters = dict(parameters or {})
    runner._buffers = dict(module._buffers)
    return runner


def _over(module: nn.Module, held: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """``module``'s own ``forward`` over ``children`` and the tensors of ``held``, the stage's copy of it
    (the same dictionaries: what the stage's tensors become, the runner's are)."""
    runner = copy.copy(module)
    runner._modules = dict(children)
    runner._parameters, runner._buffers = held._parameters, held._buffers
    return runner


class HFStage(nn.Module):
    """A run of consecutive pieces (embedding, decoder layers, head) of one causal LM, under HF's names.

    ``forward`` takes token ids (or ``(ids, attention_mask)``) on the first stage, the previous stage's
    message elsewhere; it returns its message, or the logits on the last stage (with the routers'
    auxiliary loss, as ``(logits, aux_loss)``, when the config asks for it).
    """

    def __init__(self, causal_lm: nn.Module, layout: Layout, pieces: range, routers: RouterLogits):
        super().__init__()
        self.layout, self.pieces = layout, pieces
        self.has_embedding = pieces.start == 0
        self.has_head = pieces.stop == layout.num_pieces
        self.layer_indices = [i - 1 for i in pieces if 0 < i <= layout.num_layers]
        self.routers = routers
        self.embedding_dim = causal_lm.get_input_embeddings().embedding_dim
        path = layout.base.split(".")
        self.add_module(path[0], self._own_tree(getattr(causal_lm, path[0]), path[0], path[1:]))
        for name, buffer in causal_lm.named_buffers(recurse=False):  # a constant of the head
            self.register_buffer(name, buffer, persistent=name not in causal_lm._non_persistent_buffers_set)
        for name, child in causal_lm.named_children():  # the head, and modules without parameters
            if name != path[0] and (self.has_head or name not in layout.head_side):
                self.add_module(name, child)
        self._run = _Run()
        object.__setattr__(self, "_runner", self._runner_tree(causal_lm, path))

    # --- what this stage holds, under the model's own names ---------------------------------------------

    def _own_tree(self, module: nn.Module, prefix: str, down: list[str]) -> nn.Module:
        """What this stage holds of ``module`` (at ``prefix``; ``down``: the way to the layer list): the
        way down, its own pieces, and every module without parameters."""
        layout, own = self.layout, {}
        for name, child in module.named_children():
            full = f"{prefix}.{name}"
            if down and name == down[0]:
                own[name] = self._own_tree(child, full, down[1:])
            elif not down and name == layout.layers:
                own[name] = HeldLayers({str(i): child[i] for i in self.layer_indices})
            elif full in layout.embeddings or full in layout.after:
                if self._holds(full):
                    own[name] = child
            else:  # without parameters: a rotary embedding, a norm without weights, dropout
                own[name] = child
        mine = {n: p for n, p in module.named_parameters(recurse=False) if self._holds(f"{prefix}.{n}")}
        held = _shallow(module, own, mine)
        for name, parameter in module.named_parameters(recurse=False):
            if name not in mine:  # held elsewhere: the family's init may still write to it
                object.__setattr__(held, name, torch.empty(parameter.shape, device="meta"))
        return held

    def _holds(self, path: str) -> bool:
        """Whether this stage holds what runs before the layers (``path`` among the embeddings) or
        after them."""
        if path in self.layout.embeddings:
            return self.has_embedding
        return self.has_head if path in self.layout.after else True  # a constant: every stage keeps it

    def _base(self) -> nn.Module:
        return self.layout.base_of(self)

    def _held_layers(self) -> nn.ModuleDict:
        return getattr(self._base(), self.layout.layers)

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order (the blocks ``--recompute every-K`` checkpoints)."""
        return list(self._held_layers().values())

    pipeline_blocks = decoder_layers

    # --- the model's own forward, over slots --------------------------------------------------------------

    def _runner_tree(self, causal_lm: nn.Module, path: list[str]) -> nn.Module:
        """The CausalLM with this stage's modules, slots for the layers, stand-ins for what it lacks."""
        top = {n: getattr(self, n) if self.has_head else nn.Identity() for n in self.layout.head_side}
        held = getattr(self, path[0])
        runner = self._runner_of(getattr(causal_lm, path[0]), path[0], path[1:], held)
        if self.routers.aux_loss and self.has_head:
            runner = _WithRouters(runner, self)
        top.update((n, c) for n, c in self.named_children() if n != path[0] and n not in top)
        return _over(causal_lm, self, {**top, path[0]: runner})

    def _runner_of(self, module: nn.Module, prefix: str, down: list[str], held: nn.Module) -> nn.Module:
        layout, children = self.layout, {}
        for name, child in module.named_children():
            full = f"{prefix}.{name}"
            if down and name == down[0]:
                children[name] = self._runner_of(child, full, down[1:], getattr(held, name))
            elif not down and name == layout.layers:
                mine = dict(self._held_layers().items())
                children[name] = nn.ModuleList(
                    _Slot(i, mine.get(str(i), meta), self, str(i) in mine) for i, meta in enumerate(child)
                )
            elif full in layout.embeddings and not self.has_embedding:
                embeds = isinstance(child, nn.Embedding) or layout.input_embedding.startswith(f"{full}.")
                children[name] = _Absent(child, self.embedding_dim if embeds else None, self)
            elif full in layout.after and not self.has_head:
                children[name] = nn.Identity()
            else:
                children[name] = getattr(held, name)
        runner = _over(module, held, children)
        for name, parameter in module.named_parameters(recurse=False):
            if not self._holds(f"{prefix}.{name}"):  # read only on the way to a slot whose value is unused
                object.__setattr__(runner, name, torch.full(parameter.shape, float("nan")))
        if not any(True for _ in runner.parameters()) and self.has_head:
            # a forward that reads next(self.parameters()) for their dtype finds the stage's head
            runner._modules["pipeclock_head"] = getattr(self, self.layout.head_side[0])
        return runner

    def _slot(self, index: int, args: tuple, kwargs: dict):
        """Layer ``index``'s call in the model's forward. What this stage received stands for what the
        layers before its own made: the output of the layer before (its slot returns it), or, when
        LayerDrop skipped that one (or it came from the embedding's stage), the input of the first layer
        this stage runs."""
        run, mine = self._run, self.layer_indices
        if index in mine:
            if not run.placed:
                args, kwargs = _with_hidden(args, kwargs, run.received)
                run.placed = True
            output = self._held_layers()[str(index)](*args, **kwargs)
            if index == mine[-1] and not self.has_head:
                raise _Stop(output)
            return output
        if not self.has_head and index > (mine[-1] if mine else -1):
            # past this stage's layers (its last ones skipped by LayerDrop; the embedding's stage alone):
            # the hidden states the next layer is given
            raise _Stop(_hidden_of(args, kwargs) if run.placed else run.received)
        run.placed = True
        return run.received  # a layer before this stage's: its output, as received

    # --- running ----------------------------------------------------------------------------------------

    def forward(self, inputs):
        ids, received, mask, routers = _unpack(inputs, self.has_embedding)
        self._run = run = _Run(received, self.has_embedding, routers)
        given = {IDS: ids} if ids is not None else {"inputs_embeds": self._unknown(received)}
        try:
            with self.routers.collecting(self.decoder_layers(), run.collected):
                out = self._runner(**given, attention_mask=mask, use_cache=False)
        except _Stop as stop:
            return self._message(stop.output, ids, mask, run)
        finally:
            self._run = _Run()
        aux_loss = getattr(out, "aux_loss", None) if self.routers.aux_loss else None
        return out.logits if aux_loss is None else (out.logits, aux_loss)

    def _message(self, output, ids: torch.Tensor | None, mask: torch.Tensor | None, run: _Run):
        """The layer output, with the token ids (layers of some families read them), the mask and the
        routers' logits so far: a tensor when it is all there is, else a dict of tensors."""
        routers = self.routers.pack(run.routers, run.collected, _first_tensor(output).shape[0])
        extras = {IDS: ids, MASK: mask, ROUTERS: routers}
        if isinstance(output, torch.Tensor) and all(v is None for v in extras.values()):
            return output
        return {**_encode(output), **{k: v for k, v in extras.items() if v is not None}}

    def forward_cached(self, inputs: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Generation's forward: the tokens at ``positions`` (``(1, n)``) after those whose keys and
        values ``cache`` holds (a transformers ``Cache``, None on a stage without layers; its layers grow
        by ``n``) -> their hidden states, or their logits on the head's stage."""
        received = None if self.has_embedding else self._as_layer_output(inputs)
        self._run = _Run(received, self.has_embedding)
        given = {"input_ids": inputs} if self.has_embedding else {"inputs_embeds": self._unknown(received)}
        prelude = {"position_ids": positions, "use_cache": cache is not None}
        if cache is not None:
            prelude[_cache_argument(self.layout.base_of(self._runner))] = cache
        try:
            out = self._runner(**given, **prelude)
        except _Stop as stop:
            return _first_tensor(stop.output)
        finally:
            self._run = _Run()
        return out.logits

    def _as_layer_output(self, hidden: torch.Tensor):
        """Generation hands on hidden states alone: as the tuple the family's layers return, if they do."""
        if self.pieces.start == 1 or not self.layout.tuple_outputs:
            return hidden
        return (hidden,)

    def train(self, mode: bool = True) -> HFStage:
        """The mode of the stage, and of the copies of the model's modules its forward runs."""
        super().train(mode)
        self._runner.train(mode)
        return self

    def _unknown(self, received) -> torch.Tensor:
        """Input embeddings of NaN, batch and tokens those of the received hidden states: what the base
        model reads of them on a stage without the embedding is their shape, dtype and device."""
        hidden = _first_tensor(received)
        shape = (*hidden.shape[:2], self.embedding_dim)
        return torch.full(shape, float("nan"), dtype=hidden.dtype, device=hidden.device)

    def extra_repr(self) -> str:
        return f"pieces={self.pieces.start}..{self.pieces.stop - 1} of {self.layout.num_pieces}"


def _unpack(inputs, first: bool) -> tuple:
    """(token ids, the received layer output, attention_mask, the routers' logits so far)."""
    if isinstance(inputs, dict) and first:
        return inputs[IDS], None, inputs.get(MASK), None
    if isinstance(inputs, dict):
        return inputs.get(IDS), _decode(inputs), inputs.get(MASK), inputs.get(ROUTERS)
    if isinstance(inputs, torch.Tensor):
        return (inputs, None, None, None) if first else (None, inputs, None, None)
    if isinstance(inputs, list | tuple) and len(inputs) == 2:
        return (inputs[0], None, inputs[1], None) if first else (None, inputs[0], inputs[1], None)
    raise TypeError("an HF stage takes token ids, (ids, attention_mask) or the previous stage's message")


def _encode(output) -> dict:
    """A layer's output as named tensors: ``hidden`` for a tensor, ``output<i>`` for a tuple's."""
    if isinstance(output, torch.Tensor):
        return {HIDDEN: output}
    if not isinstance(output, tuple | list):
        raise TypeError(
            f"a decoder layer returned {type(output).__name__}: a tensor or a tuple is understood"
        )
    strangers = [type(x).__name__ for x in output if x is not None and not isinstance(x, torch.Tensor)]
    if strangers:
        raise TypeError(
            f"a decoder layer returned a tuple holding {', '.join(strangers)}: only tensors travel"
        )
    return {f"{OUTPUT}{i}of{len(output)}": x for i, x in enumerate(output) if x is not None}


def _decode(message: dict):
    if HIDDEN in message:
        return message[HIDDEN]
    found = {}
    for key, value in message.items():
        if key.startswith(OUTPUT):
            index, length = key[len(OUTPUT) :].split("of")
            found[int(index)], size = value, int(length)
    return tuple(found.get(i) for i in range(size))


def _first_tensor(output) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple | list) else output


def _hidden_of(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden) -> tuple[tuple, dict]:
    hidden = _first_tensor(hidden)
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _cache_argument(base: nn.Module) -> str:
    """The name a base model's ``forward`` takes its cache by: ``cache``, or ``past_key_values`` before
    transformers 5.x renamed it."""
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
