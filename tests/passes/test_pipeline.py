"""The pass runner: passes run in order, the graph is linted after each, failures name the pass."""

import time

import pytest
import torch
from torch.fx import GraphModule

from pagedattn.passes import (
    CANONICAL_PIPELINE,
    FunctionalCacheWrites,
    PassContext,
    PassError,
    PassReport,
    run_pipeline,
)

aten = torch.ops.aten


class Tiny(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _graph() -> GraphModule:
    return torch.fx.symbolic_trace(Tiny())


def negate_output(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Negate what the graph returns (a pass that changes the result)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        neg = gm.graph.call_function(torch.neg, (out.args[0],))
    out.args = (neg,)
    return PassReport("negate_output", True, "one node added")


def use_before_definition(gm: GraphModule, ctx: PassContext) -> PassReport:
    """Leave a node that reads a value computed after it: an invalid graph."""
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    with gm.graph.inserting_before(first):
        bad = gm.graph.call_function(torch.neg, (last,))
    first.args = (bad,)
    return PassReport("use_before_definition", True)


def raising(gm: GraphModule, ctx: PassContext) -> PassReport:
    raise KeyError("no such node")


def slow(gm: GraphModule, ctx: PassContext) -> PassReport:
    time.sleep(0.05)
    return PassReport("slow", False, "nothing to do")


def test_passes_run_in_order_and_each_report_is_timed():
    gm, seen = _graph(), []

    def record(name):
        def p(gm, ctx):
            seen.append(name)
            return PassReport(name, False)
        p.__name__ = name
        return p

    reports = run_pipeline(gm, PassContext(), (record("a"), slow, negate_output, record("b")))
    assert seen == ["a", "b"]
    assert [(r.name, r.changed) for r in reports] == [("a", False), ("slow", False), ("negate_output", True),
                                                     ("b", False)]
    assert reports[1].seconds >= 0.05 and reports[1].detail == "nothing to do"
    assert all(r.seconds >= 0 for r in reports)
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), -(torch.relu(x) + 1))  # recompiled after the pass that changed it


def test_a_pass_that_breaks_the_graph_is_named_and_the_rest_do_not_run():
    gm, after = _graph(), []
    with pytest.raises(PassError, match="pass use_before_definition left an invalid graph"):
        run_pipeline(gm, PassContext(), (negate_output, use_before_definition,
                                         lambda gm, ctx: after.append(1) or PassReport("after", False)))
    assert after == []


def test_a_pass_that_raises_is_named_with_its_error():
    with pytest.raises(PassError, match=r"pass raising failed: KeyError: 'no such node'") as e:
        run_pipeline(_graph(), PassContext(), (negate_output, raising))
    assert isinstance(e.value.__cause__, KeyError)


def test_a_pass_error_passes_through_unchanged():
    def refuses(gm, ctx):
        raise PassError("refused: reasons of its own")

    with pytest.raises(PassError, match="^refused: reasons of its own$"):
        run_pipeline(_graph(), PassContext(), (refuses,))


def test_configured_passes_are_named_by_their_name():
    gm = _graph()
    (report,) = run_pipeline(gm, PassContext(), (FunctionalCacheWrites("outputs"),))
    assert report.name == "functional_cache_writes" and not report.changed  # no cache writes here
    with pytest.raises(ValueError, match="mode must be"):
        FunctionalCacheWrites("sometimes")


def test_pipelines_are_tuples_of_passes():
    names = [getattr(p, "__name__", None) for p in CANONICAL_PIPELINE]
    assert names == ["match_attention", "classify_mask", "mark_varying_masks", "replace_attention", "remove_dead_code"]
