"""RealizeSharedValues: a costly elementwise value read by many nodes is marked for Inductor to compute once."""

import torch
from torch._inductor.utils import run_and_get_code

from pagedattn.backends.shared_values import RealizeSharedValues

aten = torch.ops.aten
MARK = "inductor_realize_to_strides"


def _graph(fn, *args) -> torch.fx.GraphModule:
    return torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)


def _marked(gm: torch.fx.GraphModule) -> list:
    RealizeSharedValues()(gm.graph)
    return [n.target for n in gm.graph.nodes if n.meta.get(MARK)]


def _rotary(x, y, pos, inv):
    """A rotary table (scaled, cast to the activations' dtype) read by two rotations, each through its own view."""
    angles = pos[:, None].float() * inv[None, :]  # [T, D]
    cos = (angles.cos() * 1.0).to(x.dtype)
    sin = (angles.sin() * 1.0).to(x.dtype)
    return x * cos.unsqueeze(0) + y * sin.unsqueeze(0), y * cos.unsqueeze(0) - x * sin.unsqueeze(0)


def _rotary_args(dtype=torch.float32, tokens=7):
    return (torch.randn(2, tokens, 16).to(dtype), torch.randn(2, tokens, 16).to(dtype), torch.arange(tokens),
            torch.rand(16))


def test_a_table_read_by_several_nodes_is_marked_after_its_scaling_and_cast():
    gm = _graph(_rotary, *_rotary_args(torch.bfloat16))
    marked = _marked(gm)
    assert len(marked) == 2  # cos and sin, each where it fans out: after the scaling and the cast
    assert all(t in (torch.ops.prims.convert_element_type.default, aten._to_copy.default) for t in marked)


def test_counter_examples_are_left_alone():
    # one reader: nothing to share
    assert _marked(_graph(lambda x, pos: x * pos.float().cos(), torch.randn(4), torch.arange(4))) == []
    # not a costly op (Inductor decides for exp itself)
    assert _marked(_graph(lambda x: (x.exp() + 1, x.exp() * 2), torch.randn(4))) == []


def test_the_mixed_counter_example_marks_nothing_before_the_second_input():
    def mixed(x, pos):
        c = pos.float().cos() * x  # the product fans out, not the cosine
        return c + 1, c * 2
    gm = _graph(mixed, torch.randn(4), torch.arange(4))
    RealizeSharedValues()(gm.graph)
    cos = next(n for n in gm.graph.nodes if n.target == aten.cos.default)
    assert not cos.meta.get(MARK)


def _layers(n):
    """``n`` layers each scaling its own activations by the same table, a matmul (a kernel of its own) between."""
    def fn(x, pos, inv, w):
        cos = (pos[:, None].float() * inv[None, :]).cos().to(x.dtype)
        for _ in range(n):
            x = (x * cos.unsqueeze(0)) @ w
        return x
    return fn


def _cos_in_code(fn, options, *args):
    out, (code,) = run_and_get_code(torch.compile(fn, backend="inductor", dynamic=True, options=options), *args)
    torch.testing.assert_close(out, fn(*args))
    return code.count(".cos()") + code.count("std::cos")


def test_compiled_code_evaluates_the_table_a_fixed_number_of_times_whatever_its_readers():
    torch._dynamo.reset()
    args = (torch.randn(2, 33, 16), torch.arange(33), torch.rand(16), torch.randn(16, 16) / 4)
    passed = {n: _cos_in_code(_layers(n), {"post_grad_custom_pre_pass": RealizeSharedValues()}, *args)
              for n in (2, 4)}
    assert passed[2] == passed[4] > 0  # once (a vector loop and its tail), wherever it is read
    # without the pass both readers' kernels evaluate it (from three readers on Inductor itself keeps it here)
    assert _cos_in_code(_layers(2), None, *args) == 2 * passed[2]
