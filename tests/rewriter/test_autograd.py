"""Gradients through a rewritten graph: the drop-in op differentiates the reference semantics."""

import pytest
import torch

import pagedattn

from ..support import tiny_model
from . import zoo


def _loss(out):
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float().logsumexp(-1).mean()


def _grads(model, fn, *args, **kwargs):
    model.zero_grad()
    loss = _loss(fn(*args, **kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, atol=1e-5):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=1e-5)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=atol, rtol=1e-4, msg=n)


def test_torch_compile_on_a_model_fresh_from_from_pretrained(tmp_path):
    """Gradients on, as ``from_pretrained`` leaves them: compiles, and trains like the eager model."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama", "eager").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert all(p.requires_grad for p in model.parameters())
    compiled = torch.compile(model, backend="pagedattn")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    _assert_same(_grads(model, compiled, input_ids=ids), _grads(model, model, input_ids=ids))


@pytest.mark.parametrize("name", ["nanogpt", "softcap", "alibi", "gqa_expand"])
def test_training_step_through_a_rewritten_graph(name):
    m = zoo.ATTENTION[name][0]().train()
    rm = pagedattn.rewrite(m, zoo.example_args(name))
    assert [r["status"] for r in rm.report] == ["rewritten"], rm.report
    x = zoo.example_args(name, 3, 13, seed=3)
    m.eval()
    _assert_same(_grads(m, rm, *x), _grads(m, m, *x))


def test_attention_sink_logits_get_their_gradient():
    from pagedattn.backends import AttentionParams
    from pagedattn.backends.reference import dense_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    p = AttentionParams(0.3, True, 0, 0.0, None, 4, 8, sinks)
    out = torch.ops.pagedattn.attention(q, k, v, None, *p.args())
    ref = dense_attention(q, k, v, p, exact=True)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), go)
    want = torch.autograd.grad(ref, (q, k, v, sinks), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_paged_mode_refuses_backward_with_a_clear_message():
    m = zoo.NanoGPT().train()
    rm = pagedattn.rewrite(m, zoo.example_args("nanogpt"))
    caches = rm.allocate_kv_caches(4)
    meta = pagedattn.build_metadata([(0, 5, [0])], rm.block_size)
    with pagedattn.paged_context(caches, meta):
        out = rm(torch.randn(1, 5, zoo.C))
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()
