"""The pass runner: a pipeline is a tuple of passes run in order on one graph.

A pass is a callable ``(GraphModule, PassContext) -> PassReport`` that may change the graph in
place. After each pass the runner lints the graph and recompiles the module, times the pass, and
turns a failure into a :class:`PassError` that names the pass.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from torch.fx import GraphModule

from pagedattn.passes.context import PassContext, PassReport

log = logging.getLogger("pagedattn.passes")

__all__ = ["Pass", "PassError", "run_pipeline", "pass_name"]

Pass = Callable[[GraphModule, PassContext], PassReport]


class PassError(RuntimeError):
    """A pass failed or left an invalid graph; the message names the pass."""


def pass_name(p: Pass) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", None) or type(p).__name__


def run_pipeline(gm: GraphModule, ctx: PassContext, pipeline: Sequence[Pass]) -> list[PassReport]:
    """Run ``pipeline`` on ``gm`` in place; one report per pass."""
    reports = []
    for p in pipeline:
        name = pass_name(p)
        t0 = time.perf_counter()
        try:
            report = p(gm, ctx)
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"pass {name} failed: {type(e).__name__}: {e}") from e
        try:
            gm.graph.lint()
        except Exception as e:
            raise PassError(f"pass {name} left an invalid graph: {e}") from e
        gm.recompile()
        report = PassReport(report.name, report.changed, report.detail, time.perf_counter() - t0)
        log.debug("pass %s (%.3fs): %s", name, report.seconds, report.detail)
        reports.append(report)
    return reports
