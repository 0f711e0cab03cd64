"""Every causal-LM architecture of transformers, built tiny from its own config, and the checks run on it.

``tiny_config(arch)`` starts from the architecture's default config and shrinks widths, depth,
experts and vocabulary while keeping its features: per-layer attention types (a full and a
sliding/other layer both survive the cut to two layers), soft-caps, ALiBi, MLA ranks, MoE
routing, partial rotary, attention sinks. ``check(arch)`` runs one architecture through
``rewrite()`` (eager and sdpa), the compile backend and the engine, and returns a result row.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import traceback
from typing import Any, Optional

import torch

VOCAB = 256
HIDDEN, HEADS, HEAD_DIM, FFN = 64, 4, 16, 128

_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
           "num_decoder_layers", "num_encoder_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "embed_dim", "dim")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
          "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "n_kv_heads")
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size", "d_ff",
        "d_inner")
_SMALL_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
              "moe_shared_expert_intermediate_size", "dense_intermediate_size", "ffn_hidden_size_moe")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id")
_WINDOW = 6  # short enough that the probes and the generated sequences cross it


def _ids_in_vocab(v, vocab):
    if isinstance(v, int) and v >= vocab:
        return vocab - 1 - (v % 8)
    if isinstance(v, (list, tuple)):
        return type(v)(_ids_in_vocab(x, vocab) for x in v)
    return v


_HEAD_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "attention_head_dim", "kv_channels",
              "mamba_d_head", "mamba_headdim", "index_head_dim", "rotary_dim", "kv_head_dim", "qk_head_dim", "d_head")
# (heads, head size, expansion) triples of state-space blocks: heads * head size = expansion * hidden
_SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
              ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
# (heads, head size, inner width) of state-space blocks whose inner width is a field of its own
_SSM_WIDTH = (("mamba_n_heads", "mamba_d_head", "mamba_d_ssm"),)
# sizes of a sparse-attention token indexer (Qwen4-Exp's QSA): one key head, a budget of 4 blocks of 2
_INDEXER = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
            "indexer_compress_ratio": 2}
_NOT_WIDTH = ("vocab", "chunk", "batch", "patch", "window", "kernel", "conv", "block", "state", "position", "cache",
              "rank", "bucket", "image", "num_", "group", "max_", "seq")


def _first(d: dict, names) -> Optional[int]:
    return next((d[n] for n in names if isinstance(d.get(n), int) and not isinstance(d.get(n), bool)), None)


def _even(x: float) -> int:
    return max(2, int(round(x / 2)) * 2)


def _layer_numbers(n: str, v, layers) -> bool:
    """Whether ``v`` lists layer numbers (Zamba2's hybrid_layer_ids, Llama 4's moe_layers), not a value per layer."""
    return (isinstance(v, list) and bool(v) and ("layer" in n or "idx" in n) and bool(layers)
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < layers for x in v)
            and all(a < b for a, b in zip(v, v[1:])))


def _pick_layers(o: dict, layers0: Optional[int], most: int = 4) -> Optional[list[int]]:
    """Indices of the layers to keep: the fewest layers (at most ``most``, else the first two) that hold
    every kind of layer of the per-layer kind lists (``*layer_types``, ``layers_block_type``) and of the
    per-layer flags with two values (Llama 4's ``no_rope_layers``), two layers where all are alike.
    Layers that reuse an earlier layer's keys and values (the last ``num_kv_shared_layers``) keep one of
    each kind on both sides of that boundary, and Zamba's ``hybrid`` layers, which all run one shared
    block, keep two, so that the sharing stays. None where the config has no per-layer kinds."""
    lists = [v for n, v in o.items() if n.endswith(("layer_types", "layers_block_type"))
             and isinstance(v, (list, tuple)) and len(v) > 2 and len(v) == (layers0 or len(v))]
    if not lists:
        return None
    n_kinds = len(lists)
    lists += [v for n, v in o.items() if isinstance(v, list) and len(v) == len(lists[0]) and v not in lists
              and not _layer_numbers(n, v, len(v)) and len(set(map(str, v))) == 2]
    sig = [tuple(map(str, s)) for s in zip(*lists)]  # each layer's kinds

    def cover(lo, hi):
        firsts = sorted(sig.index(k, lo) for k in dict.fromkeys(sig[lo:hi]))
        if len(firsts) == 1:
            return list(range(lo, min(lo + 2, hi)))
        need = {(j, k) for i in firsts for j, k in enumerate(sig[i])}
        for size in range(2, min(most, len(firsts)) + 1):
            for pick in itertools.combinations(firsts, size):
                if {(j, k) for i in pick for j, k in enumerate(sig[i])} == need:
                    return list(pick)
        return [lo, lo + 1]

    shared = o.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < len(sig):
        boundary = len(sig) - shared
        picked = cover(0, boundary)
        kind = [s[:n_kinds] for s in sig]  # sharing goes by layer type
        picked += [kind.index(kind[i], boundary) for i in picked if kind[i] in kind[boundary:]]
        return sorted(dict.fromkeys(picked))
    picked = cover(0, len(sig))
    blocks = o.get("layers_block_type")
    if isinstance(blocks, list) and blocks.count("hybrid") > 1 and sum(blocks[i] == "hybrid" for i in picked) == 1:
        picked = sorted(picked + [next(i for i, b in enumerate(blocks) if b == "hybrid" and i not in picked)])
    return picked


def _shrink(d: dict) -> dict:
    """A shrunk copy of a config dict (sub-config dicts recursively)."""
    d = dict(d)
    subs = {n: sub for n, sub in d.items() if isinstance(sub, dict) and "model_type" in sub}
    rope = d.get("rope_parameters")
    for name, sub in subs.items():
        if (sub.get("model_type") == "" and isinstance(rope, dict) and "rope_theta" in rope
                and not any("rope" in k for k in sub) and any("head" in k or "attn" in k for k in sub)):
            # a group of the parent's attention parameters, no model of its own (DBRX's attn_config): the
            # modelling code reads the RoPE base from it, where checkpoints store it
            sub = {**sub, "rope_theta": rope["rope_theta"]}
            if "clip_qkv" in sub and sub["clip_qkv"] is None:
                sub["clip_qkv"] = 8.0  # DBRX's attention clamps q, k, v whether it is set or not
        d[name] = _shrink(sub)
    for name, sub in subs.items():  # widths named after a sibling sub-config (BLT's hidden_size_global)
        for other, osub in subs.items():
            h_old = _first(osub, _HIDDEN)
            if other == name or not other.endswith("_config") or not h_old:
                continue
            for k, v in sub.items():
                if other[:-len("_config")] in k and v == h_old and ("size" in k or "dim" in k):
                    d[name][k] = _first(d[other], _HIDDEN)
    o = dict(d)
    hidden0, heads0 = _first(o, _HIDDEN), _first(o, _HEADS)
    kv0 = _first(o, _KV_HEADS)
    hd0 = o.get("head_dim") if isinstance(o.get("head_dim"), int) else (
        hidden0 // heads0 if hidden0 and heads0 else None)
    new_kv = HEADS if kv0 is None or heads0 is None or kv0 >= heads0 else (1 if kv0 == 1 else 2)

    def put(names, value):
        for n in names:
            if isinstance(o.get(n), int) and not isinstance(o.get(n), bool):
                d[n] = value(o[n]) if callable(value) else value

    # defaults left unset (None) that the modelling code needs
    for names, v in ((("head_dim",), HEAD_DIM), (_KV_HEADS, new_kv), (_EXPERTS, 4), (_TOPK, 2),
                     (("n_shared_experts",), 1)):
        for n in names:
            if n in o and o[n] is None:
                # routing counts only where the experts are set (or were just given a count above)
                if n in _TOPK + ("n_shared_experts",) and not any(isinstance(d.get(e), int) for e in _EXPERTS):
                    continue
                d[n] = v
    # a sparse-attention indexer whose sizes the default config leaves all unset although its default
    # layers use it (Qwen4-Exp's `indexed_attention`): a small one, its budget shorter than the probes
    if all(n in o and o[n] is None for n in _INDEXER):
        d.update(_INDEXER)
    # layer kinds left unset where the config does not derive them (LFM2-MoE): for a short-convolution
    # hybrid (`conv_*` fields) one convolution and one attention layer, else attention
    if "layer_types" in o and o["layer_types"] is None and _first(o, _LAYERS):
        kinds = ["conv" if any(k.startswith("conv_") for k in o) else "full_attention", "full_attention"]
        o["layer_types"] = (kinds * _first(o, _LAYERS))[:_first(o, _LAYERS)]
    # per-layer-type RoPE left empty by the default config (Cohere Compass): default RoPE for each type,
    # with M-RoPE sections for the new head size (the modelling code's default, [22, 22, 20] of 64
    # frequencies, fits a head size of 128 only)
    if o.get("rope_parameters") == {} and isinstance(o.get("layer_types"), list):
        half = HEAD_DIM // 2
        t = round(half * 20 / 64)
        d["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [(half - t) // 2, half - t - (half - t) // 2, t]}
                                for k in dict.fromkeys(o["layer_types"])}
    put(_LAYERS, 2)
    put(_HIDDEN, HIDDEN)
    put(_HEADS, HEADS)
    put(_KV_HEADS, new_kv)
    put(_FFN, FFN)
    put(_SMALL_FFN, 32)
    put(_EXPERTS, lambda v: 4 if v > 1 else v)
    put(_TOPK, lambda v: 2 if v > 1 else v)
    put(("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "n_groups",
         "mamba_n_groups", "mamba_ngroups", "num_dense_layers"), lambda v: min(v, 1))
    if hd0:
        put(_HEAD_DIMS, lambda v: _even(v * HEAD_DIM / hd0))
    put(("q_lora_rank",), 32)
    put(("kv_lora_rank",), 16)
    if isinstance(d.get("qk_rope_head_dim"), int) and isinstance(d.get("qk_nope_head_dim"), int) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
    for h, hd, ex in _SSM_HEADS:
        if all(isinstance(o.get(n), int) for n in (h, hd)) and hidden0 and o[h] * o[hd] == o.get(ex, 0) * hidden0:
            d[h] = HEADS
            d[hd] = o[ex] * HIDDEN // HEADS
    for h, hd, width in _SSM_WIDTH:
        if all(isinstance(o.get(n), int) for n in (h, hd, width)) and o[h] * o[hd] == o[width]:
            d[h], d[hd], d[width] = HEADS, HEAD_DIM, HEADS * HEAD_DIM
    # other widths that are multiples of the hidden size stay such multiples
    handled = set(_HIDDEN + _FFN + _SMALL_FFN + _HEAD_DIMS)
    for n, v in o.items():
        if (hidden0 and n not in handled and isinstance(v, int) and not isinstance(v, bool) and v >= hidden0
                and v % hidden0 == 0 and ("size" in n or "dim" in n or "hidden" in n)
                and not any(w in n for w in _NOT_WIDTH)):
            d[n] = v // hidden0 * HIDDEN
    if isinstance(o.get("vocab_size"), int):
        d["vocab_size"] = VOCAB
        for n in _TOKEN_IDS:
            if n in d:
                d[n] = _ids_in_vocab(d[n], VOCAB)
    for n, v in o.items():
        if isinstance(v, int) and "vocab" in n and n != "vocab_size" and v > 4 * VOCAB:
            d[n] = 4 * VOCAB
    for n in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length"):
        if isinstance(o.get(n), int) and o[n] > 512:
            d[n] = 512
    for n in ("sliding_window", "attention_window", "window_size"):
        if isinstance(o.get(n), int) and o[n] > _WINDOW:
            d[n] = _WINDOW
    # chunked local attention (Llama 4's attention_chunk_size, 8192 by default) with chunks longer than the
    # tiny model's 512 positions is plain causal attention there: chunks as short as the windows instead
    if isinstance(o.get("attention_chunk_size"), int) and o["attention_chunk_size"] > 512:
        d["attention_chunk_size"] = _WINDOW
    if "is_decoder" in d:
        d["is_decoder"] = True
    layers0 = _first(o, _LAYERS) or next((len(v) for n, v in o.items() if n.endswith("layers_block_type")
                                          and isinstance(v, list)), None)  # Nemotron-H: from its pattern
    picked = _pick_layers(o, layers0)
    if picked:
        put(_LAYERS, len(picked))
    for n, v in o.items():
        if picked and _layer_numbers(n, v, layers0 or len(picked)):  # layer numbers: those of the layers kept
            d[n] = [j for j, i in enumerate(picked) if i in v]
        elif isinstance(v, list) and layers0 and len(v) == layers0 and layers0 > 2:  # a value per layer
            d[n] = [FFN if n in _FFN and isinstance(v[i], int) else v[i] for i in (picked or [0, 1])]
    shared = o.get("num_kv_shared_layers")
    if picked and isinstance(shared, int) and 0 < shared <= layers0:
        d["num_kv_shared_layers"] = sum(i >= layers0 - shared for i in picked)
    if isinstance(o.get("attention_types"), list) and all(isinstance(t, list) and len(t) == 2 for t in o["attention_types"]):
        kinds = list(dict.fromkeys(k for t in o["attention_types"] for k in t[0]))
        d["attention_types"] = [[kinds, 1]]  # GPT-Neo's [[kinds, repeats]]
        put(_LAYERS, len(kinds))
    # hybrids that place attention every `period` layers from `offset`: keep one of each in two layers
    if isinstance(o.get("attn_layer_period"), int) and isinstance(o.get("attn_layer_offset"), int) \
            and o["attn_layer_offset"] >= 2:
        d["attn_layer_period"], d["attn_layer_offset"] = 2, 1
    plc = o.get("per_layer_config")
    if isinstance(plc, dict) and plc and all(str(k).isdigit() for k in plc):
        width = len(next(iter(plc)))  # per-layer overrides follow the layers kept, head sizes scaled
        keep = {}
        for new_i, old_i in enumerate(picked or [0, 1]):
            entry = plc.get(str(old_i).zfill(width))
            if isinstance(entry, dict):
                keep[str(new_i).zfill(width)] = {k: (_even(v * HEAD_DIM / hd0) if k in _HEAD_DIMS and hd0 and isinstance(v, int)
                                                     else v) for k, v in entry.items()}
        d["per_layer_config"] = keep
    # widths set as factors of the hidden size, rounded up to multiples of 64 by the config but not by
    # the layers (xLSTM's qk_dim): a hidden size whose factors are such multiples already
    if isinstance(o.get("qk_dim_factor"), float):
        for n in ("hidden_size", "embedding_dim"):
            if isinstance(d.get(n), int):
                d[n] = 2 * HIDDEN
    if isinstance(o.get("num_blocks"), int) and isinstance(d.get("num_hidden_layers"), int):
        d["num_blocks"] = d["num_hidden_layers"]  # another name for the layer count
    return d


def tiny_config(arch: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(arch)
    if "text_config" in getattr(cfg, "sub_configs", {}) and getattr(cfg, "text_config", 0) is None:
        try:  # a text config left unset (Gemma 4's assistant heads): the default one its class makes from {}
            cfg = AutoConfig.for_model(arch, text_config={})
        except Exception:
            pass
    small = _shrink(cfg.to_dict())
    try:
        return type(cfg).from_dict(small)
    except Exception:  # a config class that does not take its own dict back: set the values in place
        _assign(cfg, small)
        return cfg


def _assign(cfg, values: dict) -> None:
    from transformers import PretrainedConfig

    for k, v in values.items():
        cur = getattr(cfg, k, None)
        if isinstance(cur, PretrainedConfig) and isinstance(v, dict):
            _assign(cur, v)
        elif (k in cfg.__dict__ and cur != v) or not hasattr(cfg, k):  # or one _shrink adds (a sub-config's rope_theta)
            cfg.__dict__[k] = v


def tiny_model(arch: str, attn_implementation: str = "eager", seed: int = 0):
    """A tiny random-weight instance of ``arch`` (the class transformers maps it to for causal LM)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    langs = getattr(cfg, "languages", None)
    if hasattr(model, "set_default_language") and langs:  # X-MOD: one adapter per language, none chosen by default
        model.set_default_language(list(langs)[0])
    return model.eval().float()


def vocab_of(model) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    return min(int(n), VOCAB)


def inputs(model, batch=3, seq=13, left_pad=(), seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_of(model) - 8, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, n in enumerate(left_pad):
        mask[row, :n] = 0
    return ids, mask


PAD = (0, 4, 1)
PROMPT_LENS = (5, 17, 9)
NEW_TOKENS = 8


def prompts(model, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_of(model) - 8, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_generate(model, ps, new=NEW_TOKENS) -> list[list[int]]:
    """Plain greedy decoding: no logits processors from the model's generation config (forced EOS,
    repetition penalties, suppressed tokens), which the engine's greedy sampling does not apply."""
    gc = copy.deepcopy(model.generation_config)
    for k, v in dict(do_sample=False, num_beams=1, max_new_tokens=new, min_length=0, min_new_tokens=None,
                     forced_eos_token_id=None, forced_bos_token_id=None, repetition_penalty=1.0,
                     no_repeat_ngram_size=0, suppress_tokens=None, begin_suppress_tokens=None, bad_words_ids=None,
                     temperature=None, top_k=None, top_p=None, max_length=None,
                     pad_token_id=getattr(model.config.get_text_config(), "pad_token_id", None) or 0).items():
        setattr(gc, k, v)
    out = []
    saved, model.generation_config = model.generation_config, gc  # generate fills unset values from it
    try:
        for p in ps:
            ids = torch.tensor([p])
            with torch.no_grad():
                g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            out.append(g[0, len(p):].tolist())
    finally:
        model.generation_config = saved
    return out


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _summary(report: list[dict]) -> dict:
    """Counts over attention sites; softmaxes that are no attention (MoE routers) are counted apart."""
    other = [r for r in report if not r.get("attention", True)]
    report = [r for r in report if r.get("attention", True)]
    rw = [r for r in report if r["status"] == "rewritten"]
    kinds = sorted({f"{r['mask']}" + (f"/{r['window']}" if r["window"] else "") + (f"/{r['chunk']}" if r.get("chunk") else "")
                    + (" softcap" if r["softcap"] else "")
                    + (" alibi" if r["alibi"] else "") + (" sinks" if r.get("sinks") else "") for r in rw})
    return {"sites": len(report), "rewritten": len(rw), "other_softmax": len(other),
            "skipped": sorted({r["reason"] for r in report if r["status"] != "rewritten"}), "kinds": kinds}


def dropin_error(model, rm, ref_model) -> float:
    err = 0.0
    for pad in ((), PAD):
        ids, mask = inputs(model, left_pad=pad)
        with torch.no_grad():
            ref = _logits(ref_model(input_ids=ids, attention_mask=mask, use_cache=False))
            out = _logits(rm(input_ids=ids, attention_mask=mask, use_cache=False))
        keep = mask.bool()
        err = max(err, float((out.float() - ref.float()).abs()[keep].max()))
    return err


def check(arch: str, stages=("eager", "sdpa", "compile")) -> dict:
    """One architecture through everything; a dict row (errors are caught per stage).

    eager: ``rewrite()`` traced the way the engine calls the model (``[1, T]`` steps with position ids),
    drop-in logits vs the original, then greedy generation through ``PagedEngine`` vs ``generate``.
    sdpa: ``rewrite()`` traced with an ``attention_mask``, drop-in logits with and without left padding.
    compile: ``torch.compile(backend="pagedattn")`` on the eager model, logits with and without padding.
    """
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    row: dict[str, Any] = {"arch": arch}
    t0 = time.perf_counter()
    try:
        eager = tiny_model(arch, "eager")
    except Exception as e:
        row["built"] = False
        row["error"] = _first_line(e)
        row["time_s"] = time.perf_counter() - t0
        return row
    row["built"] = True
    row["class"] = type(eager).__name__
    ids, mask = inputs(eager, 2, 8, seed=1)
    example = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    try:
        with torch.no_grad():
            eager(**example)
    except Exception as e:
        row["error"] = "forward: " + _first_line(e)
        row["time_s"] = time.perf_counter() - t0
        return row
    if "eager" in stages:
        row["eager"], row["engine"] = check_eager(eager)
    if "sdpa" in stages:
        row["sdpa"] = check_sdpa(arch, eager, example)
    no_attention = any(i in stages for i in ("eager", "sdpa")) and all(isinstance(row.get(i), dict) and row[i].get("sites") == 0 for i in ("eager", "sdpa")
                       if i in stages)
    if "compile" in stages and not no_attention:
        row["compile"] = check_compile(eager, example)
    row["time_s"] = time.perf_counter() - t0
    return row


def check_sdpa(arch, eager, example) -> dict:
    """The sdpa stage of ``check``: the architecture's SDPA model rewritten on ``example``, drop-in vs ``eager``."""
    import pagedattn

    try:
        m = tiny_model(arch, "sdpa")
    except Exception as e:
        return {"error": "no sdpa: " + _first_line(e)}
    try:
        rm = pagedattn.rewrite(m, (), example)
    except Exception as e:
        return {"error": _first_line(e), "export_failed": "torch.export could not trace" in str(e)}
    res = _summary(rm.report)
    try:
        res["max_err"] = dropin_error(m, rm, eager)
    except Exception as e:
        res["error"] = "drop-in run: " + _first_line(e)
    return res


def check_compile(model, example) -> dict:
    """The compile stage of ``check``: ``torch.compile(backend="pagedattn")`` logits vs the model's, and its sites."""
    import torch._dynamo

    from pagedattn.compile import compiled_graphs

    torch._dynamo.reset()
    try:
        c = torch.compile(model, backend="pagedattn", options={"inner": "eager"})
        with compiled_graphs() as graphs:
            err = dropin_error(model, c, model)
        report = [s for g in graphs for s in g.report]
        res = _summary(report)
        res["max_err"] = err
        return res
    except Exception as e:
        return {"error": _first_line(e)}
    finally:
        torch._dynamo.reset()


def check_eager(model) -> tuple[dict, dict]:
    """The eager stage of ``check``: the rewrite the engine makes, drop-in error, and the engine's greedy tokens vs
    Hugging Face ``generate`` (the model itself for models with recurrent state); (sites row, engine row)."""
    import pagedattn
    from pagedattn.adapter import accepted_inputs, example_inputs

    names = accepted_inputs(model)
    try:
        rm = pagedattn.rewrite(model, (), example_inputs(names, vocab_of(model)))
    except Exception as e:
        return {"error": _first_line(e), "export_failed": "torch.export could not trace" in str(e)}, {}
    res = _summary(rm.report)
    from pagedattn.tracing import without_hf_cache

    try:  # drop-in, called the way the engine calls it: [1, T] tokens, explicit positions
        ids, _ = inputs(model, 1, 13)
        kw = {"input_ids": ids}
        if "position_ids" in names:
            kw["position_ids"] = torch.arange(13)[None]
        if "use_cache" in names:
            kw["use_cache"] = False
        if "logits_to_keep" in names:
            kw["logits_to_keep"] = torch.arange(13)
        spec = rm.value_spec
        if "token_type_ids" in names and spec is not None:  # a prefix-LM: one span of the bidirectional type
            tt = torch.full((1, 13), spec.outside)
            tt[0, 3:7] = spec.inside
            kw["token_type_ids"] = tt
        with torch.no_grad(), without_hf_cache(model):  # also where use_cache comes from the config
            res["max_err"] = float((_logits(rm(**kw)).float() - _logits(model(**kw)).float()).abs().max())
    except Exception as e:
        res["error"] = "drop-in run: " + _first_line(e)
    from pagedattn.hf_state import find_recurrent_state

    try:
        stateful = find_recurrent_state(model) is not None
    except Exception as e:
        return res, {"error": "state probe: " + _first_line(e)}
    if res["sites"] == 0 and not stateful:
        return res, {}
    res["state"] = stateful
    ps = prompts(model)
    try:
        ref = hf_generate(model, ps)
    except Exception as e:  # the model's own forward stays the oracle when HF's generation loop fails on it
        ref, hf_error = None, "HF generate: " + _first_line(e)
    try:
        # a model with recurrent state goes in itself: the engine traces it with its state as inputs
        got = pagedattn.PagedEngine(model if stateful else rm, compile=False, block_size=4).generate(ps, max_new_tokens=NEW_TOKENS)
    except Exception as e:
        return res, {"error": _first_line(e)}
    if ref is None:
        try:
            return res, {"equal": False, "hf_error": hf_error, "first_diff": hf_error,
                         "equal_to_forward": got == _greedy_by_forward(model, ps, names)}
        except Exception as e:
            return res, {"error": f"{hf_error}; forward: {_first_line(e)}"}
    eng = {"equal": got == ref}
    if got != ref:
        eng["first_diff"] = next(f"prompt {i}: {a} vs HF {b}" for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        try:  # the model's own forward as the tie-breaker: HF generate's cache may not match it
            eng["equal_to_forward"] = got == _greedy_by_forward(model, ps, names)
        except Exception as e:
            eng["forward_error"] = _first_line(e)
    return res, eng


def _greedy_by_forward(model, ps, names, new=NEW_TOKENS) -> list[list[int]]:
    """Greedy decoding by running the whole sequence through the model's forward each step (no cache)."""
    from pagedattn.tracing import without_hf_cache

    out = []
    for p in ps:
        ids = list(p)
        for _ in range(new):
            kw = {"input_ids": torch.tensor([ids])}
            if "use_cache" in names:
                kw["use_cache"] = False
            with torch.no_grad(), without_hf_cache(model):  # also where use_cache comes from the config
                ids.append(int(_logits(model(**kw))[0, -1].argmax()))
        out.append(ids[len(p):])
    return out


def traceback_text() -> str:
    return traceback.format_exc()
