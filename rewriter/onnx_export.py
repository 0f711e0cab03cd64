"""ONNX export of a rewritten (paged) program that onnxruntime runs on CPU.

The paged graph writes its caches in place, which ``torch.onnx.export`` cannot keep. The export
therefore runs on a functional form: every cache write returns the new cache, later reads use it,
and the new caches become extra outputs (``kv_cache_<i>_out``). The two pagedattn ops are
translated into standard ONNX ops (ScatterND, Gather, MatMul, Softmax, Where): onnxruntime's
``com.microsoft.PagedAttention`` has no CPU kernel. Padding tokens (slot -1) write into a scratch
row that is cut off again, because ScatterND would wrap -1 onto the cache's last slot.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch.fx import GraphModule

from pagedattn.backends import METADATA_FIELDS, build_metadata, position_mod
from pagedattn.passes import FunctionalCacheWrites, PassContext, run_pipeline
from pagedattn.passes.canonical import is_cache_write
from pagedattn.serialization import example_sequences
from pagedattn.tracing import copy_graph_module, flat_graph_module, quiet_tracing

log = logging.getLogger("pagedattn")

OPSET = 18


# ----------------------------------------------------------------------------- functional graph


def functional_graph(gm: GraphModule, num_caches: int) -> GraphModule:
    """A copy of the flat paged graph whose cache writes are functional and whose new caches are outputs."""
    for i in range(num_caches):
        cache = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == f"kv_cache_{i}")
        writes = sum(is_cache_write(u) for u in cache.users)
        if writes != 1:
            raise ValueError(f"kv_cache_{i} is written {writes} times; expected once")
    fgm = copy_graph_module(gm)
    run_pipeline(fgm, PassContext(), (FunctionalCacheWrites("outputs"),))
    return fgm


# ----------------------------------------------------------------------------- translations


def translations() -> dict:
    """onnxscript code for the two paged ops (``torch.onnx.export``'s ``custom_translation_table``): the
    reference semantics (``pagedattn.backends.reference``) in standard ONNX ops."""
    from onnxscript import opset18 as op

    def write_kv_cache(key, value, kv_cache, slot_mapping):
        # kv_cache [2, NB, BS, H, D] -> [2, NB*BS, H, D] plus one scratch row for padding tokens
        shape = op.Shape(kv_cache)
        flat = op.Reshape(kv_cache, op.Concat(op.Constant(value_ints=[2, -1]), op.Slice(shape, [3], [5]), axis=0))
        nslots = op.Mul(op.Slice(shape, [1], [2]), op.Slice(shape, [2], [3]))  # [1]
        scratch_shape = op.Concat(op.Constant(value_ints=[2, 1]), op.Slice(shape, [3], [5]), axis=0)
        ext = op.Concat(flat, op.Expand(op.CastLike(op.Constant(value_float=0.0), kv_cache), scratch_shape), axis=1)
        slots = op.Where(op.Less(slot_mapping, op.Constant(value_int=0)), nslots, slot_mapping)  # [T]
        slots = op.Unsqueeze(slots, [1])  # [T, 1]
        half = op.Constant(value_int=0)
        idx_k = op.Concat(op.Expand(op.CastLike(half, slots), op.Shape(slots)), slots, axis=1)  # [T, 2]: (0, slot)
        idx_v = op.Concat(op.Expand(op.CastLike(op.Constant(value_int=1), slots), op.Shape(slots)), slots, axis=1)
        indices = op.Concat(op.Unsqueeze(idx_k, [0]), op.Unsqueeze(idx_v, [0]), axis=0)  # [2, T, 2]
        updates = op.Concat(op.Unsqueeze(key, [0]), op.Unsqueeze(value, [0]), axis=0)  # [2, T, H, D]
        written = op.ScatterND(ext, indices, op.CastLike(updates, kv_cache))
        return op.Reshape(op.Slice(written, op.Constant(value_ints=[0]), nslots, op.Constant(value_ints=[1])), shape)

    def paged_attention(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, scale: float,
                        causal: bool, sliding_window: int, softcap: float, alibi_slopes=None, num_kv_heads: int = 1,
                        head_size_v: int = 0, sinks=None, chunk_size: int = 0, max_seq_len: int = 0,
                        positions_from_first_key: bool = False, position_mod: str = "", position_tables=None,
                        position_data=None):
        # max_seq_len: an ONNX graph cannot refuse a longer sequence; callers cap requests at the model's
        # length (the limit is each site's mask_up_to in the report)
        i64 = 7  # onnx TensorProto.INT64
        qshape = op.Shape(query)  # [T, Hq, D]
        T = op.Slice(qshape, [0], [1])
        t = op.Range(op.Constant(value_int=0), op.Squeeze(T, [0]), op.Constant(value_int=1))  # [T]
        qsl = op.Cast(query_start_loc, to=i64)
        sl = op.Cast(seq_lens, to=i64)
        ends = op.Slice(qsl, [1], [9223372036854775807])  # [S]
        num_seqs = op.Shape(ends)
        # which sequence each token belongs to, and its absolute position in that sequence
        seq_of = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, [0]), op.Unsqueeze(t, [1])), to=i64),
                              op.Constant(value_ints=[1]), keepdims=0)  # [T]
        valid = op.Less(seq_of, op.Squeeze(num_seqs, [0]))  # padding tokens belong to no sequence
        sidx = op.Min(seq_of, op.Sub(op.Squeeze(num_seqs, [0]), op.Constant(value_int=1)))
        seq_len_t = op.Gather(sl, sidx)
        pos = op.Sub(seq_len_t, op.Sub(op.Gather(ends, sidx), t))  # [T]
        # every token's sequence of keys and values: [T, L, H, D], L = blocks per table * block size
        tables = op.Cast(block_tables, to=i64)
        cshape = op.Shape(kv_cache)  # [2, NB, BS, H, D]
        seq_kv_shape = op.Concat(op.Constant(value_ints=[0, -1]), op.Slice(cshape, [3], [5]), axis=0)
        k_seq = op.Reshape(op.Gather(op.Gather(kv_cache, op.Constant(value_int=0), axis=0), tables, axis=0), seq_kv_shape)
        v_seq = op.Reshape(op.Gather(op.Gather(kv_cache, op.Constant(value_int=1), axis=0), tables, axis=0), seq_kv_shape)
        k_tok = op.Gather(k_seq, sidx, axis=0)
        v_tok = op.Gather(v_seq, sidx, axis=0)
        L = op.Slice(op.Shape(k_tok), [1], [2])
        j = op.Range(op.Constant(value_int=0), op.Squeeze(L, [0]), op.Constant(value_int=1))  # [L]
        jj = op.Unsqueeze(j, [0])  # [1, L]
        allowed = op.Less(jj, op.Unsqueeze(seq_len_t, [1]))  # [T, L]
        back = op.Sub(op.Unsqueeze(pos, [1]), jj)  # [T, L] distance back from the query
        if causal:
            allowed = op.And(allowed, op.GreaterOrEqual(back, op.Constant(value_int=0)))
            if sliding_window > 0:
                allowed = op.And(allowed, op.Less(back, op.Constant(value_int=sliding_window)))
            if chunk_size > 0:  # the query's own chunk: with j <= i, i // C == j // C is j >= i - i % C
                chunk = op.Constant(value_int=chunk_size)
                start = op.Sub(pos, op.Mod(pos, chunk))  # [T]
                allowed = op.And(allowed, op.GreaterOrEqual(jj, op.Unsqueeze(start, [1])))
        # scores [T, Hkv, G, L] without repeating K/V for the query heads of a group
        q4 = op.Reshape(query, op.Concat(T, op.Constant(value_ints=[num_kv_heads, -1]),
                                         op.Slice(qshape, [2], [3]), axis=0))
        scores = op.MatMul(op.Cast(q4, to=1), op.Cast(op.Transpose(k_tok, perm=[0, 2, 3, 1]), to=1))
        scores = op.Mul(scores, op.Constant(value_float=scale))
        if softcap > 0:
            scores = op.Mul(op.Tanh(op.Div(scores, op.Constant(value_float=softcap))), op.Constant(value_float=softcap))
        if alibi_slopes is not None:
            slopes = op.Reshape(op.Cast(alibi_slopes, to=1), op.Constant(value_ints=[1, num_kv_heads, -1, 1]))
            dist = op.Unsqueeze(op.Cast(op.Neg(back), to=1), [1, 2])  # [T, 1, 1, L]
            scores = op.Add(scores, op.Mul(slopes, dist))
        allowed = op.Unsqueeze(allowed, [1, 2])  # [T, 1, 1, L]
        if position_mod:  # the site's own program at every (token, key) pair: [T, Hkv|1, G|1, L]
            leaves = {"q": op.Reshape(pos, op.Constant(value_ints=[-1, 1, 1, 1])),
                      "k": op.Reshape(j, op.Constant(value_ints=[1, 1, 1, -1])),
                      "n": op.Reshape(seq_len_t, op.Constant(value_ints=[-1, 1, 1, 1])),
                      "h": op.Reshape(op.Range(op.Constant(value_int=0), op.Squeeze(op.Slice(qshape, [1], [2]), [0]),
                                               op.Constant(value_int=1)),
                                      op.Constant(value_ints=[1, num_kv_heads, -1, 1]))}  # query head = kv * G + g
            if position_data is not None:
                leaves["val"] = op.Gather(op.Cast(position_data, to=i64), sidx, axis=0)  # [T, count]
            mask, bias = _emit_program(op, position_mod, leaves, position_tables)
            if mask is not None:
                allowed = op.And(allowed, mask)
            if bias is not None:
                scores = op.Add(scores, bias)
        neg_inf = op.Constant(value_float=-math.inf)
        scores = op.Where(allowed, scores, neg_inf)
        if sinks is None:
            probs = op.Softmax(scores, axis=-1)
        else:  # one more logit per head, dropped after the softmax
            sink = op.Reshape(op.Cast(sinks, to=1), op.Constant(value_ints=[1, num_kv_heads, -1, 1]))
            col = op.Expand(sink, op.Concat(op.Slice(op.Shape(scores), [0], [3]), op.Constant(value_ints=[1]), axis=0))
            probs = op.Softmax(op.Concat(scores, col, axis=-1), axis=-1)
            probs = op.Slice(probs, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1]), op.Constant(value_ints=[3]))
        out = op.MatMul(probs, op.Cast(op.Transpose(v_tok, perm=[0, 2, 1, 3]), to=1))  # [T, Hkv, G, Dv]
        if position_mod:  # a program may hide every key of a query: zeros there, as the reference defines
            seen = op.ReduceMax(op.Cast(allowed, to=1), op.Constant(value_ints=[3]), keepdims=1)
            out = op.Where(op.Greater(seen, op.Constant(value_float=0.0)), out, op.Constant(value_float=0.0))
        out = op.Where(op.Unsqueeze(valid, [1, 2, 3]), out, op.Constant(value_float=0.0))
        out = op.Reshape(out, op.Concat(T, op.Constant(value_ints=[-1, head_size_v]), axis=0))
        return op.CastLike(out, query)

    return {
        torch.ops.pagedattn.write_kv_cache_functional.default: write_kv_cache,
        torch.ops.pagedattn.paged_attention.default: paged_attention,
    }


# ----------------------------------------------------------------------------- export


def export_onnx(model, path: str, example: Optional[tuple[list, dict]] = None) -> list[str]:
    """Write ``model`` (a ``RewrittenModel``, loaded or fresh) to ``path``; returns the input names.

    ``example`` is ``(model_inputs, metadata)``: flat model inputs and an ``AttentionMetadata``
    for one step; by default a two-sequence prefill of 12 tokens.
    """
    gm, names = _flat_paged(model)
    _refuse_float_functions(gm)
    inputs = example_inputs(model, names) if example is None else _inputs(model, *example)
    fgm = functional_graph(gm, model.num_sites).eval()
    dyn = [{d: torch.export.Dim.AUTO for d in range(x.dim())} if isinstance(x, torch.Tensor) else None for x in inputs]
    output_names = [f"output_{k}" for k in range(_num_outputs(gm))] + [f"kv_cache_{i}_out" for i in range(model.num_sites)]
    tensor_names = [n for n, x in zip(names, inputs) if isinstance(x, torch.Tensor)]
    # torch.onnx's own notes (its pytree deprecations, the torchvision ops it skips) go to the debug log
    with torch.no_grad(), quiet_tracing():
        prog = torch.onnx.export(fgm, tuple(inputs), dynamo=True, dynamic_shapes=tuple(dyn), opset_version=OPSET,
                                 custom_translation_table=translations(), input_names=tensor_names,
                                 output_names=output_names, verbose=False, report=False, optimize=True)
    prog.save(path)
    import onnx

    onnx.checker.check_model(path, full_check=True)
    return tensor_names


def _refuse_float_functions(gm: GraphModule) -> None:
    """Sites whose position program calls float functions (log, exp, ...) are refused before exporting:
    onnxruntime's may round differently from PyTorch's, and a program that floors such a value into a bucket
    (T5's relative positions, a logarithmic bias) would then pick another bucket at some distances. Everything
    else a program does (integer and boolean arithmetic, lookups, float add/mul/div, floor) rounds the same."""
    from pagedattn.passes.canonical import is_paged_attention, read_paged

    sites = [n.name for n in gm.graph.nodes if is_paged_attention(n) and _calls_functions(read_paged(n).params)]
    if sites:
        raise ValueError(f"ONNX export: {len(sites)} attention sites are served by a position program that calls "
                         "float functions (log, exp, ...), which onnxruntime may round differently from PyTorch "
                         "(a bucket could change); serve the model with PagedEngine instead")


def _calls_functions(params) -> bool:
    if not params.position_mod:
        return False
    return any(n[0] == "call" for n in position_mod.program_text(params.position_mod).nodes)


# ONNX TensorProto types; a program's values are bool, int64 or a float type (kinds ordered as torch promotes)
_BOOL, _INT, _F32, _F64 = 9, 7, 1, 11
_RANK = {_BOOL: 0, _INT: 1, _F32: 2, _F64: 3}
_ONNX_FLOAT = {torch.float32: _F32, torch.float64: _F64}


def _emit_program(op, text: str, leaves: dict, tables):
    """``position_mod.evaluate`` in ONNX ops: ``(allowed bool or None, bias float32 or None)``, broadcastable to
    the scores ``[T, Hkv, G, L]``. ``leaves``: ``q``, ``k``, ``n`` (int64), ``h`` (the query head), ``val``
    (``[T, count]`` per-request values). Types follow torch's promotion, node by node, so every value is
    computed in the dtype ``evaluate`` computes it in."""
    prog = position_mod.program_text(text)
    fdt = _ONNX_FLOAT[prog.float_dtype]
    env: list = []  # (value, onnx type)

    def cast(x, to):
        return x if x[1] == to else (op.Cast(x[0], to=to), to)

    def common(*xs):
        to = max((x[1] for x in xs), key=_RANK.__getitem__)
        return [cast(x, to)[0] for x in xs], to

    def real(v: float, to: int):
        return op.Constant(value=_scalar_tensor(v, to))

    for node in prog.nodes:
        kind, args = node[0], node[1:]
        if kind in ("q", "k", "n", "h"):
            env.append((leaves[kind], _INT))
        elif kind == "val":
            col = op.Slice(leaves["val"], op.Constant(value_ints=[args[0]]), op.Constant(value_ints=[args[0] + 1]),
                           op.Constant(value_ints=[1]))
            env.append((op.Reshape(col, op.Constant(value_ints=[-1, 1, 1, 1])), _INT))
        elif kind == "int":
            env.append((op.Constant(value_int=int(args[0])), _INT))
        elif kind == "real":
            env.append((real(float(args[0]), fdt), fdt))
        elif kind == "bool":
            env.append((op.Constant(value=_scalar_tensor(bool(args[0]), _BOOL)), _BOOL))
        elif kind in _ARITH:
            (a, b), to = common(env[args[0]], env[args[1]])
            env.append((_ARITH[kind](op, a, b), to))
        elif kind == "div":  # true division: ints divide as float32 (torch's default dtype)
            to = max(env[args[0]][1], env[args[1]][1], _F32, key=_RANK.__getitem__)
            env.append((op.Div(cast(env[args[0]], to)[0], cast(env[args[1]], to)[0]), to))
        elif kind in ("idiv", "mod"):
            (a, b), to = common(env[args[0]], env[args[1]])
            if to == _INT:  # Python-style remainder (the sign of the divisor), floor quotient
                r = op.Mod(a, b, fmod=0)
                env.append((r if kind == "mod" else op.Div(op.Sub(a, r), b), to))
            else:
                q = op.Floor(op.Div(a, b))
                env.append((q if kind == "idiv" else op.Sub(a, op.Mul(b, q)), to))
        elif kind in _COMPARE:
            (a, b), _ = common(env[args[0]], env[args[1]])
            env.append((_COMPARE[kind](op, a, b), _BOOL))
        elif kind in _LOGIC:
            env.append((_LOGIC[kind](op, cast(env[args[0]], _BOOL)[0], cast(env[args[1]], _BOOL)[0]), _BOOL))
        elif kind == "neg":
            env.append((op.Neg(env[args[0]][0]), env[args[0]][1]))
        elif kind == "not":
            env.append((op.Not(cast(env[args[0]], _BOOL)[0]), _BOOL))
        elif kind == "ite":
            (a, b), to = common(env[args[1]], env[args[2]])
            c = cast(env[args[0]], _BOOL)[0]
            if to == _BOOL:  # onnxruntime has no Where over booleans
                env.append((op.Or(op.And(c, a), op.And(op.Not(c), b)), to))
            else:
                env.append((op.Where(c, a, b), to))
        elif kind == "to_real":
            env.append(cast(env[args[0]], fdt))
        elif kind == "to_int":
            x, t = env[args[0]]
            if t in (_F32, _F64):  # floor; beyond int64 (an unused branch) clamped, NaN to 0, as evaluate does
                x = op.Clip(op.Floor(x), real(-2.0 ** 62, t), real(2.0 ** 62, t))
                x = op.Cast(op.Where(op.IsNaN(x), real(0.0, t), x), to=_INT)
                t = _INT
            env.append((x, t))
        elif kind == "tval":
            env.append(_table_values(op, op.Gather(tables, op.Constant(value_int=args[1])), args[0], fdt))
        elif kind == "lut":
            kind_, x, offset, lo, size, default = args
            idx = op.Sub(cast(env[x], _INT)[0], op.Constant(value_int=lo))
            inside = op.And(op.GreaterOrEqual(idx, op.Constant(value_int=0)), op.Less(idx, op.Constant(value_int=size)))
            part = op.Slice(tables, op.Constant(value_ints=[offset]), op.Constant(value_ints=[offset + size]))
            vals = _table_values(op, op.Gather(part, op.Clip(idx, op.Constant(value_int=0),
                                                             op.Constant(value_int=size - 1))), kind_, fdt)
            (a, b), to = common(vals, env[default])
            env.append((op.Where(inside, a, b), to))
        elif kind == "table":
            offset, sizes, idx = args[0], args[1], [cast(env[i], _INT)[0] for i in args[2:]]
            flat = op.Constant(value_int=0)
            for i, size in zip(idx, sizes):
                flat = op.Add(op.Mul(flat, op.Constant(value_int=size)),
                              op.Clip(i, op.Constant(value_int=0), op.Constant(value_int=size - 1)))
            part = op.Slice(tables, op.Constant(value_ints=[offset]),
                            op.Constant(value_ints=[offset + math.prod(sizes)]))
            env.append((op.Cast(op.Gather(part, flat), to=fdt), fdt))
        else:  # "call" is refused before export (_refuse_float_functions)
            raise ValueError(f"position program: no ONNX translation for {kind!r}")
    allowed = None if prog.allowed is None else cast(env[prog.allowed], _BOOL)[0]
    bias = None if prog.bias is None else cast(env[prog.bias], _F32)[0]
    return allowed, bias


def _table_values(op, vals, kind: str, fdt: int):
    """``position_mod._as``: a lookup's values as the program's kind."""
    if kind == "bool":
        return op.Not(op.Equal(vals, op.CastLike(op.Constant(value_int=0), vals))), _BOOL
    if kind == "int":
        return op.Cast(vals, to=_INT), _INT
    return op.Cast(vals, to=fdt), fdt


def _scalar_tensor(v, to: int):
    import onnx

    return onnx.helper.make_tensor("value", to, [], [v])


_ARITH = {"add": lambda op, a, b: op.Add(a, b), "sub": lambda op, a, b: op.Sub(a, b),
          "mul": lambda op, a, b: op.Mul(a, b)}
_COMPARE = {"lt": lambda op, a, b: op.Less(a, b), "le": lambda op, a, b: op.LessOrEqual(a, b),
            "gt": lambda op, a, b: op.Greater(a, b), "ge": lambda op, a, b: op.GreaterOrEqual(a, b),
            "eq": lambda op, a, b: op.Equal(a, b), "ne": lambda op, a, b: op.Not(op.Equal(a, b))}
_LOGIC = {"and": lambda op, a, b: op.And(a, b), "or": lambda op, a, b: op.Or(a, b),
          "xor": lambda op, a, b: op.Xor(a, b)}


def _num_outputs(gm: GraphModule) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return len(out) if isinstance(out, (list, tuple)) else 1


def _flat_paged(model) -> tuple[GraphModule, list[str]]:
    """The paged graph with flat inputs (model inputs, caches, metadata) and their names."""
    gm, _, _ = flat_graph_module(model.exported_program)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, names


def _inputs(model, model_inputs: list, meta) -> list:
    caches = model.allocate_kv_caches(int(meta.block_tables.max()) + 2, device="cpu")
    for c in caches:
        c.normal_()
    return [*model_inputs, *caches, *meta.tensors(), *_values(model, meta.seq_lens.shape[0])]


def _values(model, num_seqs: int) -> list:
    """The step's per-request values, for a program whose masks read some (the paged graph's last input): the
    first sequence with one span (tokens 1 to 3 of token type ``inside``, or a prefix of 3), the others none."""
    spec = model.value_spec
    if spec is None:
        return []
    rows = position_mod.default_values(spec, num_seqs)
    if spec.kind == "scalar":
        rows[0, 0] = 3
    else:
        types = torch.full((1, 5), spec.outside)
        types[0, 1:4] = spec.inside
        rows[0] = position_mod.values_from_input(spec, types)[0]
    return [rows]


def _num_model_inputs(model, names: list[str]) -> int:
    return len(names) - model.num_sites - len(METADATA_FIELDS) - (model.value_spec is not None)


def example_inputs(model, names: list[str], num_tokens: int = 12, vocab: int = 2) -> list:
    """A two-sequence prefill: token ids and positions for the model inputs the program takes."""
    vocab = model.info.vocab_size or vocab
    specs = example_sequences(num_tokens, model.block_size)
    meta = build_metadata(specs, model.block_size)
    pos = torch.cat([torch.arange(c, c + n) for c, n, _ in specs])[None]
    model_inputs = _model_inputs(names[:_num_model_inputs(model, names)], num_tokens, vocab, pos)
    return _inputs(model, model_inputs, meta)


def _model_inputs(names: list[str], num_tokens: int, vocab: int, positions: torch.Tensor) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in names:
        if n == "input_ids":
            out.append(torch.randint(0, vocab, (1, num_tokens), generator=g))
        elif n == "position_ids":
            out.append(positions)
        elif n == "use_cache":
            out.append(False)
        elif n == "logits_to_keep":
            out.append(torch.tensor([num_tokens - 1]))
        elif n == "token_type_ids":  # the masks read the step's values instead (its last input)
            out.append(torch.zeros((1, num_tokens), dtype=torch.long))
        else:
            raise ValueError(f"don't know how to make an example for the program input {n!r}")
    return out


# ----------------------------------------------------------------------------- check


def verify_onnx(model, path: str, num_tokens: int = 12) -> dict[str, float]:
    """Run the ONNX file in onnxruntime (CPU) on a prefill step and the decode step after it.

    Returns the largest absolute difference from PyTorch per step, for the outputs and the caches.
    """
    import onnxruntime as ort

    gm, names = _flat_paged(model)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed_names = [i.name for i in sess.get_inputs()]
    n_model = _num_model_inputs(model, names)
    vocab = model.info.vocab_size or 2
    specs = example_sequences(num_tokens, model.block_size)
    steps = [(specs, torch.cat([torch.arange(c, c + n) for c, n, _ in specs])[None])]
    decode = [(c + n, 1, table) for c, n, table in specs]
    # two padding tokens (slot -1) ride along, as in a batch padded to a fixed size
    steps.append((decode, torch.tensor([[c for c, _, _ in decode] + [0, 0]])))
    caches = None
    ort_caches = None
    errors = {}
    for step, (seqs, pos) in enumerate(steps):
        meta = build_metadata(seqs, model.block_size, pad_tokens_to=pos.shape[1])
        ins = _model_inputs(names[:n_model], pos.shape[1], vocab, pos)
        if caches is None:
            caches = _inputs(model, [], meta)[: model.num_sites]
            ort_caches = [c.clone() for c in caches]
        values = _values(model, meta.seq_lens.shape[0])
        flat = [*ins, *caches, *meta.tensors(), *values]
        with torch.no_grad():
            ref = gm(*flat)  # writes `caches` in place
        ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        feed_all = [*ins, *ort_caches, *meta.tensors(), *values]
        feed = {n: x.numpy() for n, x in zip(names, feed_all) if n in feed_names}
        got = sess.run(None, feed)
        outs, new = got[: len(got) - model.num_sites], got[len(got) - model.num_sites:]
        ort_caches = [torch.from_numpy(c) for c in new]
        name = "prefill" if step == 0 else "decode"
        errors[f"{name} outputs"] = max(_diff(r, o) for r, o in zip(ref, outs))
        errors[f"{name} caches"] = max(_diff(c, o) for c, o in zip(caches, ort_caches))
    return errors


def _diff(ref, got) -> float:
    if not isinstance(ref, torch.Tensor):
        return 0.0
    got = torch.as_tensor(got)
    if ref.shape != got.shape:
        raise AssertionError(f"onnxruntime returned shape {tuple(got.shape)}, PyTorch {tuple(ref.shape)}")
    return float((ref.double() - got.double()).abs().max()) if ref.numel() else 0.0
