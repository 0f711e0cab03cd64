"""Finding a model's per-sequence recurrent state, and the step wrapper that carries it (model adaptation).

Linear-attention, Mamba, short-convolution and RNN layers carry a fixed-size state along the
sequence instead of a growing K/V history. Hugging Face models keep it in the cache they build for
themselves: the ``LinearAttention`` layers of a ``DynamicCache`` (``conv_states`` /
``recurrent_states``), tensors a model's own cache class holds (MiniMax, xLSTM), or a ``state``
list the forward takes and returns (RWKV). The engine serves such a model by tracing a wrapper that
builds that cache from *state inputs* and returns the updated states, so the rewritten graph is a
pure step ``(tokens, positions, states) -> (logits, states)``; attention layers keep no K/V in Hugging
Face's cache (their history is in the paged cache). A sequence's first step runs a *fresh* trace in
which the model makes its own initial state (only ``LinearAttention`` layers, which start from zeros,
share the continuing trace), so prompts can be chunked and decode steps batched. As in vLLM's state
cache, each request owns one state slot.

Tokens of different sequences cannot share a row here (the recurrence runs along the row), so
steps run ``[B, T]``: decode tokens as one batch of rows, prefill chunks one row each.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pagedattn.runtime.state import StateSlot

log = logging.getLogger("pagedattn")

__all__ = ["StateLayout", "find_recurrent_state", "StatefulStep", "get_state", "set_state", "state_tensors"]

_KINDS = ("conv", "recurrent")
_STATE_ARGS = ("past_key_values", "cache_params", "state")  # how forwards take their cache or state


@dataclass(frozen=True)
class StateLayout:
    """What a model keeps per sequence besides attention, and how its forward takes it."""

    slots: tuple[StateSlot, ...]
    cache_arg: str  # the forward's keyword: "past_key_values", "cache_params" or "state"
    cache_class: type  # what the model builds for itself (a cache class, or list for a state list)

    @property
    def bytes_per_sequence(self) -> int:
        return sum(torch.Size(s.shape).numel() * torch.tensor([], dtype=s.dtype).element_size() for s in self.slots)

    @property
    def starts_from_zeros(self) -> bool:
        """Hugging Face's LinearAttention layers start from zeros: a new sequence may continue from zeros.
        Other states start where the model's own code puts them (RWKV's running maximum at -1e30)."""
        return all(s.in_linear_layer for s in self.slots)


def _cache_types():
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin
    except ImportError:  # transformers without linear-attention cache layers
        return None
    return Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin


def _cache_arg(model: nn.Module) -> Optional[str]:
    params = inspect.signature(model.forward).parameters
    return next((n for n in _STATE_ARGS if n in params), None)


def _probe(model: nn.Module, arg: str, cache, tokens: int = 3) -> Any:
    """One forward with ``cache`` (None: the model builds its own); returns the cache or state after it."""
    cfg = model.config
    device = next(model.parameters()).device
    vocab = getattr(cfg.get_text_config(), "vocab_size", None) or 2
    ids = (torch.arange(tokens, device=device)[None] * 5 + 3) % vocab
    kw = {arg: cache, "use_cache": True}
    if "cache_position" in inspect.signature(model.forward).parameters:
        kw["cache_position"] = torch.arange(ids.shape[1], device=device)  # see StatefulStep.forward
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
    return cache if cache is not None else getattr(out, arg, None)


def find_recurrent_state(model: nn.Module) -> Optional[StateLayout]:
    """The model's per-sequence state, from short forwards with its own cache; None without any.

    State is every tensor the cache (or state list) holds once it keeps no K/V and whose size does
    not grow with the tokens: the ``LinearAttention`` layers' conv/recurrent states, tensors a
    model's own cache class keeps beside its layers, the tensors of a ``state`` list.
    """
    types = _cache_types()
    cfg = getattr(model, "config", None)
    arg = _cache_arg(model)
    if types is None or cfg is None or arg is None:
        return None
    try:
        return _find_state(model, cfg, arg, types)
    except Exception as e:  # a cache that cannot be probed or taken apart holds nothing the engine carries
        log.debug("no recurrent state found in %s: %s: %s", type(model).__name__, type(e).__name__, e)
        return None


def _find_state(model: nn.Module, cfg, arg: str, types) -> Optional[StateLayout]:
    Cache, _, DynamicCache, Linear = types
    found = []
    for tokens in (3, 5):  # state keeps its size whatever the length; K/V and anything else grow
        try:
            own = _probe(model, arg, None, tokens)  # the cache the model builds for itself
        except Exception as e:  # e.g. a cache of linear-attention layers alone, which refuses mask questions
            log.debug("%s builds no cache that runs: %s", type(model).__name__, e)
            if not _lays_out(DynamicCache, cfg):
                return None
            try:
                own = _probe(model, arg, _fresh_cache(DynamicCache, cfg, 1, None), tokens)
            except Exception as e2:  # no cache this model runs with: nothing the engine can carry
                log.debug("%s runs with no DynamicCache either: %s", type(model).__name__, e2)
                return None
        if own is None or isinstance(own, (torch.Tensor, str, int, float)):
            return None
        if type(own) is DynamicCache and not any(isinstance(layer, Linear) for layer in own.layers):
            return None  # K/V alone
        found.append({path: t for path, t in state_tensors(own) if t.dim() > 0 and t.shape[0] == 1})
    slots = tuple(StateSlot(path, tuple(t.shape[1:]), t.dtype) for path, t in found[0].items()
                  if path in found[1] and found[1][path].shape == t.shape)
    cache_class = list if isinstance(own, (list, tuple)) else type(own)
    return StateLayout(slots, arg, cache_class) if slots else None


def _lays_out(DynamicCache, cfg) -> bool:
    try:
        DynamicCache(config=cfg)
        return True
    except Exception:  # a config the unified cache cannot lay out
        return False


def state_tensors(cache, path: tuple = ()):
    """(path, tensor) of every tensor a cache that keeps no K/V (or a state list) holds."""
    if isinstance(cache, torch.Tensor):
        yield path, cache
        return
    if isinstance(cache, (list, tuple)):
        for i, x in enumerate(cache):
            yield from state_tensors(x, path + (i,))
        return
    if isinstance(cache, dict):
        for k, x in cache.items():
            if isinstance(k, (int, str)):
                yield from state_tensors(x, path + (k,))
        return
    if path:  # objects below the top level: not ours to take apart
        return
    types = _cache_types()
    for li, layer in enumerate(getattr(cache, "layers", None) or ()):
        if isinstance(layer, types[3]):
            for kind in _KINDS:
                for i in range(layer.number_of_states):
                    if getattr(layer, f"is_{kind}_states_initialized")[i]:
                        yield ("layers", li, f"{kind}_states", i), getattr(layer, f"{kind}_states")[i]
    for name, value in vars(cache).items():
        if name != "layers" and not name.startswith("_"):
            yield from state_tensors(value, (name,))


def _fresh_cache(cache_class: type, cfg, batch, like: Optional[torch.Tensor]):
    """An empty cache of the model's own class whose attention layers keep nothing (the paged cache does)."""
    _, Attention, _, _ = _cache_types()
    extra = {} if like is None else {"dtype": like.dtype, "device": like.device}
    for kwargs in ({"config": cfg}, {}, {"config": cfg, "max_batch_size": batch, **extra}):
        try:
            cache = cache_class(**kwargs)
            break
        except TypeError:
            continue
    else:
        return None
    cache.update = _passthrough
    layers = getattr(cache, "layers", None)
    if layers is not None and not any(isinstance(layer, Attention) for layer in layers):
        # a cache of linear-attention layers alone refuses these questions, which models ask to build
        # masks even with no attention layer; the answers for a cache that holds no K/V
        cache.get_seq_length = lambda layer_idx=0: 0
        cache.get_mask_sizes = lambda query_length, layer_idx=0: (query_length, 0)
    return cache


def _passthrough(key_states, value_states, *args, **kwargs):
    return key_states, value_states


def set_state(cache, path: tuple, t: torch.Tensor):
    """Put a state where the cache's own code reads it, marked as carried over from earlier tokens.
    Returns the cache (a new container where a tuple had to be rebuilt)."""
    if path[0] == "layers" and not isinstance(cache, (list, tuple, dict)):  # a LinearAttention layer, with flags
        _, li, attr, i = path
        layer = cache.layers[li]
        getattr(layer, attr)[i] = t
        getattr(layer, f"is_{attr}_initialized")[i] = True
        layer.has_previous_state[i] = True  # always continue: the first step of a sequence starts it
        if attr == "conv_states":
            layer.conv_kernel_size[i] = t.shape[-1]
        layer.device, layer.dtype = t.device, t.dtype
        return cache
    head, rest = path[0], path[1:]
    if isinstance(cache, (list, tuple)):
        items = list(cache) + [[]] * (head + 1 - len(cache))  # the empty entries a cache itself leaves
        items[head] = set_state(items[head], rest, t) if rest else t
        return type(cache)(items) if isinstance(cache, tuple) else _replace_list(cache, items)
    if isinstance(cache, dict):
        cache[head] = set_state(cache[head], rest, t) if rest else t
        return cache
    setattr(cache, head, set_state(getattr(cache, head), rest, t) if rest else t)
    return cache


def _replace_list(old: list, items: list) -> list:
    old[:] = items  # in place: the cache object keeps its list
    return old


def get_state(cache, path: tuple) -> torch.Tensor:
    x = cache
    for p in path:
        x = x[p] if isinstance(p, int) or isinstance(x, dict) else getattr(x, p)
    return x


class StatefulStep(nn.Module):
    """``forward(input_ids, position_ids, states) -> (logits of each row's last token, new states)``.

    Traced by the engine in place of the model. ``states`` follow ``layout.slots``, batch first.
    ``fresh=True`` traces a sequence's first step: no states in, the model starts its own.
    """

    def __init__(self, model: nn.Module, layout: StateLayout, takes_positions: bool, fresh: bool = False):
        super().__init__()
        self.model = model
        self.layout = layout
        self.takes_positions = takes_positions
        self.fresh = fresh
        self.config = getattr(model, "config", None)
        self.generation_config = getattr(model, "generation_config", None)
        params = inspect.signature(model.forward).parameters
        self.takes_logits_to_keep = "logits_to_keep" in params
        self.takes_cache_position = "cache_position" in params

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                states: Sequence[torch.Tensor] = ()):
        cache = self._cache(input_ids, states)
        kw = {self.layout.cache_arg: cache, "use_cache": True}
        if self.takes_positions and position_ids is not None:
            kw["position_ids"] = position_ids
        if self.takes_logits_to_keep:
            kw["logits_to_keep"] = 1
        if self.takes_cache_position:
            # what the model derives itself from a cache that holds no K/V (the paged cache does); a cache
            # of linear-attention layers alone cannot tell it
            kw["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        out = self.model(input_ids=input_ids, **kw)
        logits = out.logits if hasattr(out, "logits") else out[0]
        after = getattr(out, self.layout.cache_arg, None) if cache is None or self.layout.cache_class is list \
            else cache
        new = [get_state(after, s.path) for s in self.layout.slots]
        # [B, V], then each state [B, ...]; clones: caches update the state inputs in place
        return (logits[:, -1], *(t.clone() for t in new))

    def _cache(self, input_ids: torch.Tensor, states: Sequence[torch.Tensor]):
        """The cache or state list to call the model with; None where the model must start its own."""
        Cache = _cache_types()[0]
        if self.layout.cache_class is list:
            return None if self.fresh else list(states)
        if self.fresh and not issubclass(self.layout.cache_class, Cache):
            return None  # e.g. xLSTM: the model builds and initialises its cache itself
        cache = _fresh_cache(self.layout.cache_class, self.config, input_ids.shape[0],
                             states[0] if states else None)
        if not self.fresh:
            for s, t in zip(self.layout.slots, states):
                set_state(cache, s.path, t)
        return cache
