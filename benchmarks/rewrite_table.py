"""The rewriter's results table: every attention style of the test zoo and tiny Hugging Face models.

For each: sites rewritten / skipped and the largest |rewritten - original| over drop-in runs at
sizes other than the traced one (Hugging Face: with and without a left-padded attention_mask).

    python benchmarks/rewrite_table.py
"""

from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pagedattn  # noqa: E402
from tests.rewriter import zoo  # noqa: E402
from tests.rewriter.hf_models import TINY, example_inputs, tiny_model  # noqa: E402


def row(name, report, err):
    rw = sum(r["status"] == "rewritten" for r in report)
    kinds = sorted({f"{r['mask']}" + (f"/{r['window']}" if r["window"] else "") + (" softcap" if r["softcap"] else "")
                    + (" alibi" if r["alibi"] else "") + (" +pad" if r.get("key_padding") else "")
                    for r in report if r["status"] == "rewritten"})
    reasons = sorted({r["reason"] for r in report if r["status"] != "rewritten"})
    print(f"| {name} | {rw} | {len(report) - rw} | {err:.1e} | {', '.join(kinds) or '-'} | {'; '.join(reasons) or ''} |")


def main() -> None:
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    print("| model | rewritten | skipped | max abs err | mask kinds | skip reasons |")
    print("|---|---|---|---|---|---|")
    for name, (cls, _) in {**zoo.ATTENTION, **zoo.NOT_ATTENTION}.items():
        m = cls().eval()
        rm = pagedattn.rewrite(m, zoo.example_args(name))
        err = 0.0
        with torch.no_grad():
            for B, T in [(3, 19), (2, 61)]:
                args = zoo.example_args(name, B, T, seed=T)
                err = max(err, (rm(*args) - m(*args)).abs().max().item())
        row(f"zoo: {name}", rm.report, err)
    for arch in sorted(TINY):
        for impl in ("eager", "sdpa"):
            try:
                m = tiny_model(arch, impl)
            except ValueError:
                continue
            ids, mask = example_inputs()
            rm = pagedattn.rewrite(m, (), {"input_ids": ids, "attention_mask": mask, "use_cache": False})
            err = 0.0
            for pad in ((), (0, 4, 1)):
                ids2, mask2 = example_inputs(3, 13, left_pad=pad, seed=5)
                with torch.no_grad():
                    ref = m(input_ids=ids2, attention_mask=mask2, use_cache=False).logits
                    out = rm(input_ids=ids2, attention_mask=mask2, use_cache=False).logits
                err = max(err, (out - ref).abs()[mask2.bool()].max().item())
            row(f"HF {arch} ({impl})", rm.report, err)


if __name__ == "__main__":
    main()
