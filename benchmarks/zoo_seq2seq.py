"""Coverage of transformers' encoder-decoders: every architecture of the seq2seq and speech-seq2seq mappings
served by ``PagedEngine`` (issue 18).

Each architecture of ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES``
(once if in both) is built tiny from its own config (``tiny_config`` of tests/rewriter/hf_zoo.py, random
weights, eager attention), its decoder step rewritten and checked (``pagedattn.seq2seq.prepare_seq2seq``) and
served: greedy tokens of ``PagedEngine`` for 3 requests of different encoder lengths (text) or 2 feature windows
(speech), 8 new tokens, against Hugging Face ``generate`` one request at a time. One subprocess per architecture
(``benchmarks/zoo.py``'s way: time and memory limit, rows appended as they finish, reruns skip rows already there
unless ``--fresh``); rows go to ``benchmarks/zoo_seq2seq_results.jsonl`` and the table to
``docs/coverage_seq2seq.md``.

    nice -n 10 python benchmarks/zoo_seq2seq.py                 # both mappings
    python benchmarks/zoo_seq2seq.py --only bart,t5 --fresh     # some architectures
    python benchmarks/zoo_seq2seq.py --table-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zoo import MEMORY_LIMIT, load_rows, md_cell, reason_key, write_markdown  # noqa: E402  (zoo.py's runner helpers)

RESULTS = os.path.join(ROOT, "benchmarks", "zoo_seq2seq_results.jsonl")
TABLE = os.path.join(ROOT, "docs", "coverage_seq2seq.md")
NEW = 8


def architectures() -> list[tuple[str, str]]:
    """(architecture, mapping) for both mappings, each architecture once (text mapping first)."""
    from transformers.models.auto import modeling_auto as auto

    out = {a: "seq2seq" for a in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}
    for a in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        out.setdefault(a, "speech-seq2seq")
    return list(out.items())


# ----------------------------------------------------------------------- one architecture


def _build(arch: str, mapping: str):
    import torch
    import transformers

    from tests.rewriter.hf_zoo import tiny_config

    cfg = tiny_config(arch)
    auto = transformers.AutoModelForSpeechSeq2Seq if mapping == "speech-seq2seq" else transformers.AutoModelForSeq2SeqLM
    torch.manual_seed(0)
    model = auto.from_config(cfg, attn_implementation="eager").eval().float()
    gen = model.generation_config
    if getattr(cfg, "is_encoder_decoder", False) and gen.decoder_start_token_id is None and gen.bos_token_id is None \
            and getattr(cfg, "decoder_start_token_id", None) is None:
        # T5-like configs leave the start token to their checkpoints, which use the pad token (as HF's T5 does)
        pad = getattr(cfg, "pad_token_id", None)
        gen.decoder_start_token_id = pad if pad is not None else 0
    return model


def _requests(model, serving) -> list:
    """3 token sources of different lengths, or 2 feature windows for a speech encoder."""
    import torch

    from pagedattn.seq2seq import example_sources

    if serving.spec.encoder_input != "input_ids":
        return [{"input_features": s["input_features"]} for s in example_sources(serving, "cpu")]
    vocab = min(int(serving.spec.vocab_size or 64), 512)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 13, 9)]


def _hf(model, reqs) -> list[list[int]]:
    """Hugging Face greedy ``generate``, one request at a time: the tokens after the decoder prompt."""
    import torch

    from pagedattn.seq2seq import hf_seq2seq

    start = len(hf_seq2seq(model).decoder_prompt)
    out = []
    for x in reqs:
        kw = {"input_features": x["input_features"][None]} if isinstance(x, dict) else {"input_ids": torch.tensor([x])}
        with torch.no_grad():
            g = model.generate(**kw, max_new_tokens=NEW, do_sample=False, num_beams=1)
        toks = g[0].tolist()
        out.append(toks[start:] if "input_ids" in kw or len(toks) > NEW else toks)
    return out


def check(arch: str, mapping: str) -> dict:
    """One row: built, decoder-step sites (self / cross / other), engine tokens vs HF generate."""
    import traceback

    import pagedattn
    from pagedattn.adapter import prepare_model

    row: dict = {"arch": arch, "mapping": mapping, "built": False}
    t0 = time.perf_counter()
    try:
        model = _build(arch, mapping)
        row.update(built=True, **{"class": type(model).__name__})
    except Exception as e:
        row["error"] = f"build: {type(e).__name__}: {_line(e)}"
        return row
    try:
        sv = prepare_model(model, block_size=4, compile=False, progress=False)
        if sv.seq2seq is None:
            raise ValueError("not an encoder-decoder (config.is_encoder_decoder is false): a decoder-only model "
                             "in this mapping, see docs/coverage.md")
        rep = sv.seq2seq.step.report
        kinds = Counter(r.get("attention_type") or "other" for r in rep)
        row["rewrite"] = {"sites": len(rep), "rewritten": sum(r["status"] == "rewritten" for r in rep),
                          "self": kinds["self"], "cross": kinds["cross"]}
    except Exception as e:
        row["rewrite"] = {"error": f"{type(e).__name__}: {_line(e)}"}
        row["trace"] = traceback.format_exc()[-600:]
        row["time_s"] = time.perf_counter() - t0
        return row
    try:
        reqs = _requests(model, sv.seq2seq)
        got = pagedattn.PagedEngine(sv, num_blocks=2048, max_num_tokens=64).generate(reqs, max_new_tokens=NEW)
        ref = _hf(model, reqs)
        row["engine"] = {"equal": got == ref}
        if got != ref:
            row["engine"]["first_diff"] = next(f"request {i}: {a} vs HF {b}" for i, (a, b) in enumerate(zip(got, ref))
                                               if a != b)
    except Exception as e:
        row["engine"] = {"error": f"{type(e).__name__}: {_line(e)}"}
    row["time_s"] = time.perf_counter() - t0
    return row


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


def run_one(arch: str, mapping: str) -> None:
    """Child process: check one architecture, print its row as JSON on the last line."""
    import logging
    import resource
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    print("ZOO-ROW " + json.dumps(check(arch, mapping)), flush=True)


def run_isolated(arch: str, mapping: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arch, "--mapping", mapping],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "mapping": mapping, "built": None, "error": f"timed out after {timeout:.0f}s",
                "time_s": timeout}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("ZOO-ROW "):
            return json.loads(line[len("ZOO-ROW "):])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"arch": arch, "mapping": mapping, "built": None, "error": f"exit {p.returncode}: {tail[:300]}",
            "time_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- table


def verdict(row: dict) -> tuple[str, str]:
    """(category, reason): ok | not-rewritten | differs | not-built | not-run."""
    if row.get("not_run"):
        return "not-run", "not reached by the sweep that wrote this table"
    if not row.get("built"):
        return "not-built", row.get("error", "")
    rw = row.get("rewrite") or {}
    if "error" in rw:
        return "not-rewritten", rw["error"]
    eng = row.get("engine") or {}
    if "error" in eng:
        return "engine-error", eng["error"]
    return ("ok", "") if eng.get("equal") else ("differs", eng.get("first_diff", ""))


def write_table(rows: list[dict], path: str = TABLE) -> str:
    import transformers

    rows = sorted(rows, key=lambda r: (r.get("mapping", ""), r["arch"]))
    lines = ["# Coverage of transformers' encoder-decoders (issue 18)", "",
             f"Every architecture of transformers {transformers.__version__}'s `MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES` "
             "and `MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES` (each once), built tiny from its own config "
             "(`tiny_config` of `tests/rewriter/hf_zoo.py`), random weights, eager attention, CPU. Generated by "
             "`nice -n 10 python benchmarks/zoo_seq2seq.py` (raw rows: `benchmarks/zoo_seq2seq_results.jsonl`); the "
             "causal-LM zoo is `docs/coverage.md`.", "",
             "Columns: **decoder step** — attention sites of the decoder step rewritten / found "
             "(`prepare_seq2seq`: self-attention paged, cross-attention over blocks filled once per request, and "
             "checked against the model's own decoder); **self / cross** — how many of each; **generate** — greedy "
             f"tokens of `PagedEngine` (4-token blocks) equal Hugging Face `generate` for 3 text requests of 5, 13 "
             f"and 9 tokens (speech: 2 feature windows), {NEW} new tokens each.", ""]
    for mapping in ("seq2seq", "speech-seq2seq"):
        part = [r for r in rows if r.get("mapping") == mapping]
        cats = Counter(verdict(r)[0] for r in part)
        ran = [r for r in part if not r.get("not_run")]
        built = sum(verdict(r)[0] != "not-built" for r in ran)
        rewritten = built - cats["not-rewritten"]
        lines += [f"## {mapping}: totals", "",
                  f"- architectures in the mapping{' (not counted again from the text mapping)' if mapping != 'seq2seq' else ''}: "
                  f"{len(part)}; checked: {len(ran)}" + (f" (not reached: {cats['not-run']})" if cats["not-run"] else ""),
                  f"- built tiny: {built}; decoder step rewritten and checked: {rewritten}",
                  f"- **ok (tokens equal to HF generate): {cats['ok']}**; differ: {cats['differs']}; engine error: "
                  f"{cats['engine-error']}", ""]
    reasons = Counter(reason_key(verdict(r)[1]) for r in rows if verdict(r)[0] not in ("ok", "not-run"))
    lines += ["## Top reasons", "", "| reason | architectures |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in reasons.most_common(12)]
    lines += ["", "## Per architecture", "",
              "| architecture | mapping | class | decoder step | self / cross | generate | time (s) | status | reason |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, why = verdict(r)
        rw, eng = r.get("rewrite") or {}, r.get("engine") or {}
        sites = f"{rw['rewritten']}/{rw['sites']}" if "sites" in rw else "-"
        kinds = f"{rw['self']} / {rw['cross']}" if "sites" in rw else "-"
        gen = "-" if not eng else "equal" if eng.get("equal") else "err" if "error" in eng else "differs"
        lines.append(f"| {r['arch']} | {r.get('mapping', '')} | {r.get('class', '-')} | {sites} | {kinds} | {gen} | "
                     f"{r.get('time_s', 0):.0f} | {c} | {md_cell(why)} |")
    return write_markdown(path, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mapping", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated architectures")
    ap.add_argument("--fresh", action="store_true", help="rerun architectures already in the results file")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per architecture")
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    if a.child:
        run_one(a.child, a.mapping)
        return
    done = load_rows(RESULTS)
    archs = architectures()
    if not a.table_only:
        todo = [(x, m) for x, m in archs if not a.only or x in a.only.split(",")]
        for i, (arch, mapping) in enumerate(todo):
            if arch in done and not a.fresh:
                continue
            row = run_isolated(arch, mapping, a.timeout)
            done[arch] = row
            with open(RESULTS, "a") as f:
                f.write(json.dumps(row) + "\n")
            c, why = verdict(row)
            print(f"[{i + 1}/{len(todo)}] {arch}: {c} {why[:160]} ({row.get('time_s', 0):.0f}s)", flush=True)
    with open(RESULTS, "w") as f:
        f.writelines(json.dumps(done[k]) + "\n" for k in sorted(done))
    write_table([done.get(x, {"arch": x, "mapping": m, "not_run": True}) for x, m in archs])
    print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
