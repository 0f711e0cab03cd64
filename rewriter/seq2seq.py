"""Encoder-decoder models (BART, mBART, Marian, Pegasus, T5, Whisper, a hand-written ``nn.Transformer``).

An encoder-decoder is served in two parts, as vLLM's encoder-decoder support does:

- at admission, the **encoder** runs once per request (batched across the requests admitted in a
  step, padded, non-causal over each request's own tokens, no cache) and the **cross-attention K/V**
  of every decoder layer are projected from its output and written into the request's
  cross-attention blocks (``RewrittenModel.write_cross_kv``: the K/V projections cut out of the
  decoder step's graph, ``passes.cross_attention``);
- every **decoder step** is the usual packed ``[1, T]`` paged step: self-attention writes and reads
  the request's KV blocks (causal), cross-attention reads its cross blocks (non-causal, no write)
  through the step's ``CrossMetadata``.

:class:`Seq2SeqSpec` says how to run a model's two parts; :func:`hf_seq2seq` builds it for Hugging
Face seq2seq and speech-seq2seq models, and a hand-written model passes its own.
:func:`prepare_seq2seq` rewrites the decoder step and checks paged steps against the model's own
decoder before anything is served.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from pagedattn.backends import AttentionBackend, build_cross_metadata, build_metadata, cross_slot_mapping
from pagedattn.program import ModelInfo, RewrittenModel, inductor_freezing
from pagedattn.runtime.context import paged_context
from pagedattn.tracing import uncompiled

log = logging.getLogger("pagedattn")

__all__ = ["Seq2SeqSpec", "Seq2SeqServing", "hf_seq2seq", "is_seq2seq", "prepare_seq2seq", "encoder_key",
           "encoder_states_output", "length_groups", "example_sources"]

ENCODER_STATES = "encoder_hidden_states"


@dataclass(frozen=True)
class Seq2SeqSpec:
    """How to run an encoder-decoder.

    ``encoder(**inputs, attention_mask=[B, L])`` maps a padded batch of a request's encoder inputs
    (``encoder_input``: ``input_ids [B, L]``, or e.g. Whisper's ``input_features [B, mels, frames]``)
    to ``[B, L', hidden]``. ``decoder(input_ids [B, T], encoder_hidden_states [B, L', hidden])`` (and
    ``position_ids [B, T]`` when its forward takes them) returns the logits ``[B, T, vocab]``.
    ``decoder_prompt`` starts every decoder sequence (the decoder start token); ``forced_bos`` /
    ``forced_eos`` are the generation config's forced first and last tokens.
    """

    encoder: nn.Module
    decoder: nn.Module
    hidden_size: int
    decoder_prompt: tuple[int, ...]
    encoder_input: str = "input_ids"
    pad_token_id: int = 0
    forced_bos: Optional[int] = None
    forced_eos: Optional[int] = None
    eos_token_id: Optional[int | Sequence[int]] = None
    vocab_size: Optional[int] = None
    max_source_len: Optional[int] = None  # the longest encoder input the encoder takes
    max_target_len: Optional[int] = None  # the decoder positions it has (learned or tabled position embeddings)


class _HFEncoder(nn.Module):
    """A Hugging Face seq2seq model's encoder: ``[B, L', hidden]`` for a padded batch."""

    def __init__(self, model: nn.Module, input_name: str):
        super().__init__()
        self.encoder, self.input_name = model.get_encoder(), input_name

    def forward(self, attention_mask: Optional[torch.Tensor] = None, **inputs) -> torch.Tensor:
        if self.input_name == "input_features":  # Whisper's encoder takes whole 30 s windows, unmasked
            attention_mask = None
        return self.encoder(**inputs, attention_mask=attention_mask).last_hidden_state


class CompiledEncoder(nn.Module):
    """An encoder compiled with ``torch.compile`` (Inductor, dynamic shapes), with Inductor's freezing on the CPU."""

    def __init__(self, encoder: nn.Module, freeze: bool):
        super().__init__()
        self.compiled, self.freeze = torch.compile(encoder, dynamic=True), freeze

    def forward(self, **inputs) -> torch.Tensor:
        with inductor_freezing(self.freeze):  # Dynamo reads it when it traces: at every call that may compile
            return self.compiled(**inputs)


class _HFDecoderStep(nn.Module):
    """A Hugging Face seq2seq model's decoder and LM head over given encoder states (no HF cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model(encoder_outputs=encoder_states_output(encoder_hidden_states), decoder_input_ids=input_ids,
                          use_cache=False).logits


def encoder_states_output(states: torch.Tensor):
    """Encoder states as ``generate`` hands them to the model: a model output (models read
    ``encoder_outputs.last_hidden_state``, which a plain tuple lacks) whose other fields are None, whatever
    their names (an encoder's own output class may have more: NLLB-MoE's ``router_logits``, Canary's
    ``attention_mask``; the decoder step sees one request's unpadded states, so it needs no encoder mask)."""
    return _encoder_states_class()(last_hidden_state=states)


@functools.lru_cache(maxsize=1)
def _encoder_states_class() -> type:
    from transformers.modeling_outputs import BaseModelOutput

    class EncoderStates(BaseModelOutput):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return EncoderStates


class _HFDecoderStepWithPositions(_HFDecoderStep):
    """The same for models whose forward takes ``decoder_position_ids`` (Whisper): explicit positions, so
    that packed steps number each sequence's tokens from its own start."""

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(encoder_outputs=encoder_states_output(encoder_hidden_states), decoder_input_ids=input_ids,
                          decoder_position_ids=position_ids, use_cache=False).logits


class _SameBatch(nn.Module):
    """A decoder step whose encoder states have the decoder tokens' batch size, as export is told: without
    it a decoder that reshapes the states by ``-1`` (``nn.MultiheadAttention``'s cross-attention) traces
    a head size over two unrelated batch sizes."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        torch._check(encoder_hidden_states.shape[0] == input_ids.shape[0])
        if position_ids is None:
            return self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states)
        return self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states,
                            position_ids=position_ids)


def is_seq2seq(model) -> bool:
    """A Hugging Face encoder-decoder (``config.is_encoder_decoder``) or a :class:`Seq2SeqSpec`."""
    if isinstance(model, Seq2SeqSpec):
        return True
    cfg = getattr(uncompiled(model), "config", None)
    return bool(getattr(cfg, "is_encoder_decoder", False)) and hasattr(model, "get_encoder")


def hf_seq2seq(model: nn.Module) -> Seq2SeqSpec:
    """The :class:`Seq2SeqSpec` of a Hugging Face seq2seq or speech-seq2seq model (its generation config's
    decoder start and forced tokens, as ``generate`` uses them)."""
    cfg, gen = model.config, getattr(model, "generation_config", None)

    def setting(name):
        v = getattr(gen, name, None) if gen is not None else None
        return v if v is not None else getattr(cfg, name, None)

    start = setting("decoder_start_token_id")
    if start is None:  # as generate: the BOS token starts the decoder when no start token is set
        start = setting("bos_token_id")
    if start is None:
        raise ValueError(f"{type(model).__name__} has no decoder_start_token_id or bos_token_id in its generation "
                         "config or config")
    main = getattr(model, "main_input_name", "input_ids")
    if main not in ("input_ids", "input_features"):
        raise ValueError(f"{type(model).__name__}'s encoder takes {main!r}; served are input_ids and input_features")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = getattr(text, "d_model", None) or text.hidden_size
    src = getattr(cfg, "max_source_positions", None) or getattr(cfg, "max_position_embeddings", None)
    # a decoder with a position table (BART's learned one, Marian's sinusoidal one) has no position past it;
    # relative position biases (T5) have no such limit
    has_table = isinstance(getattr(model.get_decoder(), "embed_positions", None), nn.Embedding)
    tgt = getattr(cfg, "max_target_positions", None) or (getattr(cfg, "max_position_embeddings", None)
                                                         if has_table else None)
    positions = "decoder_position_ids" in inspect.signature(model.forward).parameters
    step = (_HFDecoderStepWithPositions if positions else _HFDecoderStep)(model).eval()
    return Seq2SeqSpec(
        encoder=_HFEncoder(model, main).eval(), decoder=step, hidden_size=int(hidden),
        decoder_prompt=(int(start),), encoder_input=main, pad_token_id=int(setting("pad_token_id") or 0),
        forced_bos=setting("forced_bos_token_id"), forced_eos=setting("forced_eos_token_id"),
        eos_token_id=ModelInfo.of(model).eos_token_id, vocab_size=getattr(text, "vocab_size", None),
        max_source_len=src if main == "input_ids" else None, max_target_len=tgt)


def encoder_key(inputs: Mapping[str, torch.Tensor]) -> int:
    """A hash of a request's encoder inputs: decoder blocks are shared by prefix caching only between
    requests whose encoders saw the same inputs (the decoder's K/V depend on them through cross-attention)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(inputs):
        t = inputs[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class Seq2SeqServing:
    """An encoder-decoder ready to serve: its spec and the rewritten decoder step (whose cross-attention
    caches are the last ``step.num_cross_sites`` of its caches)."""

    spec: Seq2SeqSpec
    step: RewrittenModel
    takes_positions: bool
    # the encoder compiled (:meth:`compile_encoder`), run instead of ``spec.encoder``
    compiled_encoder: Optional[nn.Module] = None

    @property
    def max_decoder_len(self) -> Optional[int]:
        """Decoder tokens a request may reach, its start tokens and completion together (None: no limit): one
        more than the decoder's positions, since the last token generated is never fed back."""
        return None if self.spec.max_target_len is None else self.spec.max_target_len + 1

    # --- requests

    def request_inputs(self, prompt) -> dict[str, torch.Tensor]:
        """A request's encoder inputs: token ids (a list, 1-D array or tensor) or a dict of tensors (e.g.
        ``{"input_features": [mels, frames]}``), each without the batch dimension."""
        if isinstance(prompt, Mapping):
            if self.spec.encoder_input not in prompt:
                raise ValueError(f"the request's encoder inputs {sorted(prompt)} lack {self.spec.encoder_input!r}")
            out = {}
            for k, v in prompt.items():
                t = torch.as_tensor(v)
                if t.dim() == 0:
                    raise ValueError(f"encoder input {k!r} is a scalar; give it without the batch dimension")
                out[k] = t
            return out
        from pagedattn.runtime.engine import token_ids

        if self.spec.encoder_input != "input_ids":
            raise ValueError(f"this model's encoder takes {self.spec.encoder_input!r}: give each request as a dict "
                             f"{{'{self.spec.encoder_input}': tensor}}")
        return {"input_ids": torch.tensor(token_ids(prompt), dtype=torch.long)}

    def encoder_len(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Encoder tokens (cross-attention keys) a request's inputs give."""
        x = inputs[self.spec.encoder_input]
        if self.spec.encoder_input == "input_ids":
            return int(x.shape[-1])
        return int(self._encoded_len(x.shape[-1]))

    def _encoded_len(self, frames: int) -> int:
        """Encoder output length of a features input (Whisper: two convolutions, the second of stride 2)."""
        enc = getattr(self.spec.encoder, "encoder", None)
        convs = [m for m in (enc.modules() if enc is not None else ()) if isinstance(m, nn.Conv1d)]
        n = frames
        for c in convs:
            n = (n + 2 * c.padding[0] - c.dilation[0] * (c.kernel_size[0] - 1) - 1) // c.stride[0] + 1
        return n

    # --- the encoder, once per request

    def encode(self, batch: Sequence[Mapping[str, torch.Tensor]], device,
               bucketed: bool = False) -> tuple[torch.Tensor, list[int]]:
        """``[B, L, hidden]`` encoder states of a padded batch of requests, and each one's length.

        ``bucketed``: the batch is padded to a power-of-two number of rows and of tokens (at most the encoder's
        longest input), so that a device compiling one graph per shape (XLA) compiles a bounded number; the
        padding rows (one visible pad token each, never written to a cache) follow the requests' rows."""
        name = self.spec.encoder_input
        lens = [int(x[name].shape[-1]) for x in batch]
        longest = max(lens)
        rows = len(batch)
        if bucketed:
            rows = _power_of_two(rows)
            if name == "input_ids":
                cap = self.spec.max_source_len  # positions past it do not exist (learned position tables)
                longest = max(longest, min(_power_of_two(max(longest, 16)), cap or 1 << 62))
        if self.compiled_encoder is not None:  # sizes 0 and 1 specialise a compiled graph: one graph serves sizes >= 2
            rows = max(rows, 2)
            if name == "input_ids":
                longest = max(longest, min(2, self.spec.max_source_len or 2))
        pad_value = self.spec.pad_token_id if name == "input_ids" else 0
        padded, mask = [], torch.zeros(rows, longest, dtype=torch.long)
        for i, x in enumerate(batch):
            t = x[name]
            padded.append(torch.nn.functional.pad(t, (0, longest - t.shape[-1]), value=pad_value))
            mask[i, :lens[i]] = 1
        for i in range(len(batch), rows):
            padded.append(torch.full_like(padded[0], pad_value))
            mask[i, 0] = 1  # a row with no visible key would be NaN in some encoders' attention
        inputs = {name: torch.stack(padded).to(device), "attention_mask": mask.to(device)}
        with torch.no_grad():
            states = (self.compiled_encoder or self.spec.encoder)(**inputs)  # [rows, L', hidden]
        if states.shape[1] == longest:
            return states, lens
        return states, [self.encoder_len(x) for x in batch]

    def encode_groups(self, batch: Sequence[Mapping[str, torch.Tensor]], device, bucketed: bool = False
                      ) -> Iterator[tuple[list[int], torch.Tensor, list[int]]]:
        """The encoder over ``batch`` in groups of similar lengths (:func:`length_groups`): per group, the
        requests' indices in ``batch``, their padded ``[B, L, hidden]`` states (``B`` may exceed the group:
        ``bucketed``, see :meth:`encode`) and their lengths. Padding every request to the longest of a ragged
        batch (16-128 tokens) spends ~40 % of the encoder on pads."""
        name = self.spec.encoder_input
        lens = [int(x[name].shape[-1]) for x in batch]
        for group in length_groups(lens):
            states, enc_lens = self.encode([batch[i] for i in group], device, bucketed)
            yield group, states, enc_lens

    def compile_encoder(self, device) -> "Seq2SeqServing":
        """The same serving with its encoder compiled by Inductor (dynamic shapes; on the CPU with freezing: the
        linear layers' weights are repacked once, and later changes to them are not seen), compiled here on two
        example requests, with the step's cross-attention writer, so that the first admission does not pay for it."""
        compiled = CompiledEncoder(self.spec.encoder, freeze=torch.device(device).type == "cpu")
        serving = dataclasses.replace(self, compiled_encoder=compiled)
        states, lens = serving.encode(example_sources(serving, device), device)
        # and the cross-attention writer, when the step is compiled (RewrittenModel.compile_paged)
        bs = self.step.block_size
        tables, used = consecutive_tables([-(-n // bs) for n in lens])
        serving.write_cross(self.step.allocate_kv_caches(used, device, self._dtype()), states, lens, tables, bs)
        return serving

    def write_cross(self, caches: Sequence[torch.Tensor], states: torch.Tensor, lens: Sequence[int],
                    tables: Sequence[Sequence[int]], block_size: int) -> None:
        """Write each request's cross-attention K/V (from its rows of ``states``; rows past ``len(lens)`` are
        padding) into its cross blocks."""
        slots = cross_slot_mapping(tables, lens, states.shape[1], block_size, device="cpu")
        extra = (states.shape[0] - len(lens)) * states.shape[1]
        slots = torch.nn.functional.pad(slots, (0, extra), value=-1).to(states.device)
        self.step.write_cross_kv({ENCODER_STATES: states.to(self._dtype())}, caches, slots)

    def _dtype(self) -> torch.dtype:
        return self.step.cache_specs[-1].dtype

    # --- decoder steps

    def step_inputs(self, ids: Sequence[int], pos: Sequence[int], device) -> dict:
        """Keyword inputs of a packed decoder step (the encoder states input is a placeholder: the paged
        graph reads the cross-attention caches instead)."""
        kw = {"input_ids": torch.tensor([list(ids)], device=device),
              ENCODER_STATES: torch.zeros((1, 2, self.spec.hidden_size), dtype=self._dtype(), device=device)}
        if self.takes_positions:
            kw["position_ids"] = torch.tensor([list(pos)], device=device)
        return kw


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# a group's fixed cost (the encoder's per-call work: Python, small ops), in padded tokens: measured on the
# BART-like model of benchmarks/seq2seq_cpu.py, one encoder call costs about what 64 more tokens do
_GROUP_COST_TOKENS = 64


def length_groups(lens: Sequence[int], group_cost: int = _GROUP_COST_TOKENS) -> list[list[int]]:
    """Indices of ``lens`` split into groups of neighbouring lengths (sorted) that minimise the padded tokens
    of the encoder's batches plus ``group_cost`` per group (a batch's cost is its size times its longest
    length): one group when the lengths are alike, several for a ragged batch. Exact, O(n^2) in requests."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j requests (sorted)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lens[order[j - 1]]
        for i in range(j):  # the last group: sorted requests i .. j-1
            c = best[i] + group_cost + (j - i) * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def prepare_seq2seq(model, backend: AttentionBackend, block_size: int) -> Seq2SeqServing:
    """Rewrite an encoder-decoder's decoder step (self-attention paged, cross-attention over blocks filled
    once per request) and check paged steps against its own decoder; ``ValueError`` says why it cannot be
    served. ``model`` is a Hugging Face seq2seq model or a :class:`Seq2SeqSpec`."""
    spec = model if isinstance(model, Seq2SeqSpec) else hf_seq2seq(model)
    decoder = spec.decoder.eval()
    device = next(iter(decoder.parameters())).device
    if device.type == "xla":
        # torch.export cannot trace some ops on XLA tensors (layer norm's decomposition reads symbolic sizes):
        # the decoder step is rewritten on the CPU and moved with its program
        from pagedattn.xla import to_xla

        modules = {id(m): m for m in (spec.encoder, spec.decoder)}.values()
        try:
            for m in modules:
                m.to("cpu")
            step = to_xla(_rewrite_step(spec, backend, block_size), device)
        finally:
            for m in modules:
                m.to(device)
    else:
        step = _rewrite_step(spec, backend, block_size)
    serving = Seq2SeqServing(spec, step, _takes_positions(decoder))
    check_seq2seq(serving, backend, block_size)
    return serving


def _takes_positions(decoder: nn.Module) -> bool:
    return "position_ids" in inspect.signature(decoder.forward).parameters


def _rewrite_step(spec: Seq2SeqSpec, backend: AttentionBackend, block_size: int) -> RewrittenModel:
    """The decoder step rewritten where its parameters are: self-attention paged, cross-attention over blocks."""
    from pagedattn.api import rewrite

    decoder = spec.decoder
    takes_positions = _takes_positions(decoder)
    device = next(iter(decoder.parameters())).device
    dtype = next(iter(decoder.parameters())).dtype
    vocab = spec.vocab_size or 2
    # the example's encoder is longer than its decoder: queries are read as the last of the keys' positions
    ids = (torch.arange(16, device=device).reshape(2, 8) * 5 + 3) % vocab
    example = {"input_ids": ids, ENCODER_STATES: torch.randn(2, 11, spec.hidden_size, device=device, dtype=dtype)}
    if takes_positions:
        example["position_ids"] = torch.arange(8, device=device).expand(2, 8).contiguous()
    step = rewrite(_SameBatch(decoder).eval(), (), example, target=backend, block_size=block_size, encoder_inputs=(ENCODER_STATES,))
    refused = [r for r in step.report if r["status"] != "rewritten" and r.get("attention", True)]
    if refused:
        raise ValueError("the decoder step has attention left as it was: " +
                         "; ".join(f"{r['name']}: {r['reason']}" for r in refused))
    if not step.num_cross_sites:
        raise ValueError("no cross-attention found in the decoder step (keys and values computed from the encoder "
                         "output alone, every encoder token visible): see its report")
    dense = [r["name"] for r in step.report if r["status"] == "rewritten" and not r.get("attention_type")]
    if dense:
        raise ValueError(f"attention sites {dense} are neither self-attention over the step's tokens nor "
                         "cross-attention over the encoder's output: a paged step would mix its sequences there")
    return step


def check_seq2seq(serving: Seq2SeqServing, backend: AttentionBackend, block_size: int) -> None:
    """Refuse a model whose paged decoder steps differ from its own decoder: two requests with different
    encoder inputs, run alone, packed together, and in chunks, against the decoder's dense forward."""
    spec = serving.spec
    device = next(iter(spec.decoder.parameters())).device
    vocab = spec.vocab_size or 2
    srcs = example_sources(serving, device)
    states, lens = serving.encode(srcs, device)
    decs = [[(3 + 5 * i) % vocab for i in range(7)], [(11 + 3 * i) % vocab for i in range(5)]]
    bs = block_size
    tables, nxt = consecutive_tables([-(-len(d) // bs) for d in decs])
    cross_tables, nxt = consecutive_tables([-(-n // bs) for n in lens], nxt)

    def run(steps) -> torch.Tensor:
        caches = backend.allocate_kv_caches(serving.step.cache_specs, nxt, bs, device=device)
        serving.write_cross(caches, states, lens, cross_tables, bs)
        done, out = {}, None
        for step in steps:
            specs, ids, pos, seqs = [], [], [], []
            for seq, toks in step:
                start = done.get(seq, 0)
                specs.append((start, len(toks), tables[seq]))
                ids += toks
                pos += list(range(start, start + len(toks)))
                seqs.append(seq)
                done[seq] = start + len(toks)
            meta = build_metadata(specs, bs, device=device)
            cross = build_cross_metadata([cross_tables[s] for s in seqs], [lens[s] for s in seqs], bs, device=device)
            with torch.no_grad(), paged_context(caches, meta, backend, cross=cross):
                out = serving.step(**serving.step_inputs(ids, pos, device))
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
        return logits[0, -1].float()

    try:
        with torch.no_grad():
            kw = {"input_ids": torch.tensor([decs[1]], device=device), ENCODER_STATES: states[1:, :lens[1]]}
            if serving.takes_positions:
                kw["position_ids"] = torch.arange(len(decs[1]), device=device)[None]
            ref = spec.decoder(**kw)[0, -1].float()
        checks = {"alone": run([[(1, decs[1])]]),
                  "after another request in the same step": run([[(0, decs[0]), (1, decs[1])]]),
                  "in two chunks": run([[(1, decs[1][:3])], [(0, decs[0]), (1, decs[1][3:])]])}
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"PagedEngine cannot serve this encoder-decoder: a paged decoder step failed "
                         f"({type(e).__name__}: {msg})") from e
    tol = max(1e-4, 8 * torch.finfo(serving._dtype()).eps) * max(1.0, float(ref.abs().max()))
    for how, got in checks.items():
        diff = float((ref - got).abs().max())
        if diff > tol:
            raise ValueError(f"PagedEngine cannot serve this encoder-decoder: a request's decoder logits run {how} "
                             f"differ from the model's own decoder (max difference {diff:.3g}); it numbers decoder "
                             "tokens by their index in the step, or mixes tokens outside attention")


def consecutive_tables(counts: Sequence[int], first: int = 0) -> tuple[list[list[int]], int]:
    """Block tables of ``counts`` blocks each, numbered on from ``first``, and the next free block."""
    tables = []
    for n in counts:
        tables.append(list(range(first, first + n)))
        first += n
    return tables, first


def example_sources(serving: Seq2SeqServing, device) -> list[dict[str, torch.Tensor]]:
    """Two requests' encoder inputs of different lengths (token ids), or two feature windows."""
    spec = serving.spec
    if spec.encoder_input == "input_ids":
        vocab = spec.vocab_size or 2
        return [{"input_ids": (torch.arange(n) * 7 + 5 + n) % vocab} for n in (9, 4)]
    enc = getattr(spec.encoder, "encoder", None)
    mels = getattr(getattr(enc, "config", None), "num_mel_bins", None)
    frames = 2 * getattr(getattr(enc, "config", None), "max_source_positions", 0)
    if not mels or not frames:
        raise ValueError(f"cannot make example {spec.encoder_input!r} for this encoder: served are Whisper-style "
                         "[mels, frames] windows (an encoder config with num_mel_bins and max_source_positions); "
                         "pass a Seq2SeqSpec with an encoder of that kind")
    g = torch.Generator().manual_seed(0)
    return [{"input_features": torch.randn(mels, frames, generator=g)} for _ in range(2)]


def with_decoder(serving: Seq2SeqServing, step: RewrittenModel) -> Seq2SeqServing:
    """The same serving with another decoder step (a compiled one)."""
    return dataclasses.replace(serving, step=step)


EncoderRunner = Callable[[Sequence[Mapping[str, torch.Tensor]]], tuple[torch.Tensor, list[int]]]
