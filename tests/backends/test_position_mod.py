"""Position programs (backends/position_mod.py): programs that read positions only through their distance are
evaluated once per distance a step spans and spread over its pairs; that must give exactly what evaluating every
pair gives, and programs that read positions any other way must not be taken for such programs."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedattn.backends import position_mod

from ..support import BUCKET_BIAS_MOD, BUCKET_TABLE, SINKS_WINDOW_MOD, prefix_lm_mod


def _program(nodes, allowed=None, bias=None) -> str:
    return json.dumps({"version": 1, "float": "float32", "nodes": nodes, "allowed": allowed, "bias": bias})


# T5's bucketed bias as the rewriter writes it: each position through an identity sum and product first, the
# distance's sign and size, a logarithmic bucket past 4, a table lookup per (bucket, head), causal
T5_LIKE = _program([
    ["k"], ["int", 0], ["add", 0, 1], ["int", 1], ["mul", 3, 2], ["q"], ["add", 5, 1], ["mul", 6, 3],
    ["sub", 4, 7], ["neg", 8], ["le", 8, 1], ["int", 4], ["lt", 9, 11], ["to_real", 9], ["real", 1.0],
    ["ite", 10, 13, 14], ["call", "log", 15], ["real", 3.0], ["mul", 16, 17], ["to_int", 18], ["add", 19, 11],
    ["int", 7], ["lt", 20, 21], ["ite", 22, 20, 21], ["ite", 12, 9, 23], ["h"], ["int", 8], ["mul", 25, 26],
    ["add", 27, 24], ["real", 0.0], ["lut", "real", 28, 0, 0, 64, 29]], allowed=10, bias=30)
T5_TABLE = torch.linspace(-4.0, 4.0, 64)

# a relative program that reads the sequence's length too (a distance bias scaled by it) and a huge multiple of the
# distance (int64 wraps it: the spread values must wrap alike)
LENGTH_SCALED = _program([
    ["q"], ["k"], ["sub", 1, 0], ["n"], ["to_real", 3], ["to_real", 2], ["div", 5, 4], ["int", 0], ["le", 2, 7],
    ["int", 1 << 62], ["mul", 2, 9], ["int", 3], ["mod", 10, 11], ["to_real", 12], ["add", 6, 13]],
    allowed=8, bias=14)

# a position's difference with itself (a form with no position in it, built from positions) read beside the distance
SELF_DIFFERENCE = _program([["q"], ["k"], ["sub", 0, 0], ["sub", 1, 0], ["add", 3, 2], ["int", 0], ["le", 4, 5],
                            ["to_real", 2]], allowed=6, bias=7)

NOT_RELATIVE = {
    "a sink key": SINKS_WINDOW_MOD,  # reads k alone
    "a sum of positions": _program([["q"], ["k"], ["add", 0, 1], ["int", 40], ["lt", 2, 3]], allowed=4),
    "a product of positions": _program([["q"], ["k"], ["mul", 0, 1], ["int", 40], ["lt", 2, 3]], allowed=4),
    "twice the key": _program([["q"], ["k"], ["int", 2], ["mul", 1, 2], ["sub", 0, 3], ["int", 0], ["ge", 4, 5]],
                              allowed=6),
    "positions as reals": _program([["q"], ["k"], ["to_real", 0], ["to_real", 1], ["sub", 2, 3]], bias=4),
    "per-request spans": prefix_lm_mod(1),
    "a query's parity": _program([["q"], ["k"], ["sub", 0, 1], ["int", 2], ["mod", 0, 3], ["add", 2, 4],
                                  ["int", 0], ["ge", 5, 6]], allowed=7),
}


@pytest.mark.parametrize("text", [BUCKET_BIAS_MOD, T5_LIKE, LENGTH_SCALED, SELF_DIFFERENCE],
                         ids=["bucket", "t5", "length", "self"])
def test_programs_that_read_positions_through_their_distance_are_found(text):
    assert position_mod.by_distance(text)


@pytest.mark.parametrize("name", sorted(NOT_RELATIVE))
def test_programs_that_read_positions_otherwise_are_not(name):
    assert not position_mod.by_distance(NOT_RELATIVE[name])


def _pair_by_pair(text, tables, q_pos, k_pos, seq_len, heads, values=None):
    """The program one query at a time (a single query is evaluated at every pair)."""
    outs = [position_mod.evaluate(text, tables, q_pos[:, i:i + 1], k_pos,
                                  seq_len if not isinstance(seq_len, torch.Tensor) or seq_len.dim() == 1
                                  else seq_len[:, i:i + 1], heads, values)
            for i in range(q_pos.shape[1])]
    allowed = None if outs[0][0] is None else torch.cat([o[0] for o in outs], 1)
    bias = None if outs[0][1] is None else torch.cat([o[1] for o in outs], 2)
    return allowed, bias


def _same(got, want):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            g, w = torch.broadcast_tensors(g, w)
            assert torch.equal(g, w)


PROGRAMS = {"t5": (T5_LIKE, T5_TABLE), "bucket": (BUCKET_BIAS_MOD, BUCKET_TABLE), "length": (LENGTH_SCALED, None),
            "self": (SELF_DIFFERENCE, None),
            "sinks": (SINKS_WINDOW_MOD, None), "sum": (NOT_RELATIVE["a sum of positions"], None)}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(PROGRAMS)),
    rows=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=3),
    queries=st.integers(1, 40),
    keys=st.integers(1, 70),
    per_query_length=st.booleans(),
)
def test_a_program_by_distance_equals_it_pair_by_pair(name, rows, queries, keys, per_query_length):
    # each row's queries and keys consecutive from its own first positions, its own length (one for all its
    # queries, or one per query: then by distance would be wrong for a program that reads it, and is not taken)
    text, tables = PROGRAMS[name]
    q_pos = torch.tensor([[q0 + i for i in range(queries)] for q0, _ in rows])
    k_pos = torch.tensor([[k0 + j for j in range(keys)] for _, k0 in rows])
    last = torch.maximum(q_pos[:, -1], k_pos[:, -1]) + 1
    seq_len = last[:, None] + torch.arange(queries) if per_query_length else last
    got = position_mod.evaluate(text, tables, q_pos, k_pos, seq_len, 4)
    _same(got, _pair_by_pair(text, tables, q_pos, k_pos, seq_len, 4))


def test_positions_with_gaps_are_evaluated_pair_by_pair():
    q_pos = torch.tensor([[10, 11, 13, 14]])
    k_pos = torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    got = position_mod.evaluate(T5_LIKE, T5_TABLE, q_pos, k_pos, 15, 4)
    _same(got, _pair_by_pair(T5_LIKE, T5_TABLE, q_pos, k_pos, 15, 4))


def test_a_relative_program_is_evaluated_once_per_distance(monkeypatch):
    # the work by distance: 2,047 evaluations of each operation for 1,024 queries over 1,024 keys, not a million
    sizes = []
    real = position_mod._node

    def counting(n, env, *rest):
        out = real(n, env, *rest)
        if isinstance(out, torch.Tensor):
            sizes.append(out.numel())
        return out

    monkeypatch.setattr(position_mod, "_node", counting)
    pos = torch.arange(1024)[None]
    allowed, bias = position_mod.evaluate(T5_LIKE, T5_TABLE, pos, pos, 1024, 4)
    assert bias.shape == (1, 4, 1024, 1024) and allowed.shape == (1, 1024, 1024)
    assert max(sizes) == 4 * 2047  # the lookup, per head
