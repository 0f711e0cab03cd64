"""Export + rewrite time against the number of layers.

(a) A Llama-7B-shaped config (hidden 4096, 32 heads, 11008 MLP) on the meta device: no weights and
    no example values, so the mask's padding input cannot be given its role and sites are reported
    skipped; this isolates export and matching cost at full width.
(b) The same architecture at a small width with real weights: every site rewritten, the mask proof
    included (``proofs s``: the classify_mask pass; ``programs``: distinct mask programs it proved).

    python benchmarks/rewrite_time.py [--layers 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedattn.backends import get_backend
from pagedattn.driver import rewrite_graph
from pagedattn.tracing import export_model, flat_graph_module


def _timed_rewrite(model, kwargs):
    """(export s, passes s, mask proofs s, distinct mask programs, rewritten sites, total sites)."""
    t0 = time.perf_counter()
    gm, _, _ = flat_graph_module(export_model(model, (), kwargs))
    t1 = time.perf_counter()
    flat = torch.utils._pytree.tree_flatten(((), kwargs))[0]
    res = rewrite_graph(gm, flat, get_backend("cpu"), max_length=model.config.max_position_embeddings)
    t2 = time.perf_counter()
    (proof,) = [p for p in res.passes if p.name == "classify_mask"]
    programs = int(proof.detail.split(" from ")[1].split()[0])
    return (t1 - t0, t2 - t1, proof.seconds, programs, sum(s.status == "rewritten" for s in res.sites),
            len(res.sites))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    a = p.parse_args(argv)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.ones(2, 16, dtype=torch.long)
    shapes = {
        "llama-7b shape, meta": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                     num_key_value_heads=32, vocab_size=32000, device="meta"),
        "small width, weights": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                     num_key_value_heads=4, vocab_size=256, device="cpu"),
    }
    # warm-up: first export in a process pays one-time costs
    _timed_rewrite(LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, vocab_size=64)).eval(),
                   {"input_ids": ids % 64, "attention_mask": mask, "use_cache": False})
    for label, cfg in shapes.items():
        device = cfg.pop("device")
        print(f"\n{label}")
        print(f"{'layers':>6} {'export s':>9} {'passes s':>9} {'proofs s':>9} {'programs':>8} {'total s':>8} "
              f"{'s/layer':>8} {'passes %':>9} {'sites':>9}")
        for n in a.layers:
            with torch.device(device):
                model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=n, max_position_embeddings=8192, **cfg)).eval()
            kw = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "use_cache": False}
            t_exp, t_pass, t_proof, programs, rw, total = _timed_rewrite(model, kw)
            t = t_exp + t_pass
            print(f"{n:>6} {t_exp:9.2f} {t_pass:9.2f} {t_proof:9.2f} {programs:>8} {t:8.2f} {t / n:8.3f} "
                  f"{100 * t_pass / t:8.1f}% {rw:>4}/{total:<4}")
            del model


if __name__ == "__main__":
    main()
