"""Coverage across the Hugging Face model zoo: every causal-LM architecture of transformers, rewritten.

Each architecture of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny from its own config
(tests/rewriter/hf_zoo.py), in eager and sdpa attention, and run through ``rewrite()`` (drop-in
logits vs eager, with and without left padding), the ``torch.compile`` backend and the paged
engine (greedy tokens vs Hugging Face ``generate``). Every architecture runs in its own
subprocess with a time and memory limit; rows go to a JSON-lines file as they finish (rerunning
skips architectures already there unless ``--fresh``), and ``docs/coverage.md`` is written from it.

    nice -n 10 python benchmarks/zoo.py                    # the whole mapping
    python benchmarks/zoo.py --only llama,gpt2 --fresh     # some architectures
    python benchmarks/zoo.py --table-only                  # rewrite docs/coverage.md from the results
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

RESULTS = os.path.join(ROOT, "benchmarks", "zoo_results.jsonl")
TABLE = os.path.join(ROOT, "docs", "coverage.md")
MEMORY_LIMIT = 8 << 30


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ----------------------------------------------------------------------- one architecture


def run_one(arch: str) -> None:
    """Child process: check one architecture, print its row as JSON on the last line."""
    import resource
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    torch.set_num_threads(1)
    from tests.rewriter.hf_zoo import check

    row = check(arch)
    print("ZOO-ROW " + json.dumps(row), flush=True)


def run_isolated(arch: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arch], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"arch": arch, "built": None, "error": f"timed out after {timeout:.0f}s", "time_s": timeout}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("ZOO-ROW "):
            return json.loads(line[len("ZOO-ROW "):])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    why = f"crashed (exit {p.returncode})" if p.returncode < 0 or p.returncode == 137 else f"exit {p.returncode}"
    return {"arch": arch, "built": None, "error": f"{why}: {tail[:300]}", "time_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- verdicts


def _full(res) -> bool:
    return bool(res) and "error" not in res and res["sites"] > 0 and res["rewritten"] == res["sites"]


def _exported(row) -> bool:
    return any(isinstance(row.get(i), dict) and "sites" in row[i] for i in ("eager", "sdpa"))


def verdict(row: dict) -> tuple[str, str]:
    """(category, reason): ok | no-attention | partial | failed | not-exported | not-built | not-run."""
    if row.get("not_run"):
        return "not-run", "not reached by the sweep that wrote this table"
    if not row.get("built"):
        return "not-built", row.get("error", "")
    if "error" in row:
        return "not-built", row["error"]
    if not _exported(row):
        e = (row.get("eager") or {}).get("error", "")
        return "not-exported", e
    impls = [row[i] for i in ("eager", "sdpa") if isinstance(row.get(i), dict) and "sites" in row[i]]
    eng = row.get("engine") or {}
    if all(r["sites"] == 0 for r in impls):
        eager = row.get("eager") or {}
        if (eng.get("equal") or eng.get("equal_to_forward")) and eager.get("state") and "error" not in eager:
            return "ok-state", "no softmax attention: served with its recurrent state alone"
        why = "".join(f"; {name}: {r['error']}" for name, r in (("eager", eager), ("engine", eng)) if "error" in r)
        return "no-attention", "no softmax attention in the graph" + why
    reasons = []
    for name in ("eager", "sdpa", "compile"):
        r = row.get(name) or {}
        if "sites" in r and r["rewritten"] < r["sites"]:
            reasons += [f"{name}: {x}" for x in r["skipped"]]
        elif "error" in r and not r["error"].startswith("no sdpa"):
            reasons.append(f"{name}: {r['error']}")
        elif r.get("max_err", 0) > 1e-3:
            reasons.append(f"{name}: drop-in logits differ ({r['max_err']:.1e})")
    if "error" in eng:
        reasons.append(f"engine: {eng['error']}")
    elif not eng.get("equal") and not eng.get("equal_to_forward"):
        reasons.append(f"engine: generation differs ({eng.get('first_diff', '')})")
    if not reasons:
        return "ok", ""
    partial = any(_full(r) or (r.get("rewritten", 0) > 0) for r in impls)
    return ("partial" if partial else "failed"), "; ".join(dict.fromkeys(reasons))


# -------------------------------------------------------------------------------- table


def _cell(res) -> str:
    if not isinstance(res, dict):
        return "-"
    if "sites" not in res:
        return "err" if not res.get("error", "").startswith("no ") else "n/a"
    return f"{res['rewritten']}/{res['sites']}"


def _err(row) -> str:
    errs = [row[i]["max_err"] for i in ("eager", "sdpa", "compile") if isinstance(row.get(i), dict) and "max_err" in row[i]]
    return f"{max(errs):.1e}" if errs else "-"


def write_table(rows: list[dict], path: str = TABLE) -> str:
    import torch
    import transformers

    rows = sorted(rows, key=lambda r: r["arch"])
    cats = Counter(verdict(r)[0] for r in rows)
    ran = [r for r in rows if not r.get("not_run")]
    built = sum(1 for r in ran if verdict(r)[0] != "not-built")
    exported = built - cats["not-exported"]
    with_attention = exported - cats["no-attention"] - cats["ok-state"]
    ok_all = cats["ok"] + cats["ok-state"]
    hybrids = sum(1 for r in rows if verdict(r)[0] == "ok" and (r.get("eager") or {}).get("state"))
    reasons = Counter()
    for r in rows:
        c, why = verdict(r)
        if c not in ("ok", "ok-state", "not-run"):
            for key in {reason_key(part) for part in why.split("; ")}:  # each architecture once per reason
                reasons[key] += 1
    lines = [
        "# Coverage across the Hugging Face model zoo",
        "",
        f"Every architecture in transformers {transformers.__version__}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny "
        "from its own config (2 layers, small widths, the architecture's own features kept; "
        "`tests/rewriter/hf_zoo.py`), random weights, CPU, torch " + torch.__version__ + ".",
        "Generated by `python benchmarks/zoo.py` (raw rows: `benchmarks/zoo_results.jsonl`).",
        "",
        "Columns: **eager** — attention sites rewritten / found by `rewrite()` on the eager implementation, traced the "
        "way `PagedEngine` calls the model (`[1, T]` steps, position ids); **sdpa** — the same on the sdpa "
        "implementation traced with an `attention_mask` (n/a: transformers has no sdpa for it); **compile** — "
        "`torch.compile(backend=\"pagedattn\")` on the eager model (all graphs Dynamo hands over); softmaxes that are "
        "no attention (MoE routers) are not counted as sites; **max err** — largest |logit difference| of a "
        "rewritten model in drop-in mode vs the eager original (sdpa and compile: with and without a left-padded "
        "batch); **generate** — greedy tokens of `PagedEngine` on the eager rewrite (paged KV cache, 4-token "
        "blocks, sequences packed in one step) equal Hugging Face `generate` for 3 prompts x 8 tokens; "
        "**status** — ok: every site rewritten everywhere, logits equal (< 1e-3), generation equal; hybrids "
        "(attention beside linear-attention, Mamba or convolution layers) generate with a per-sequence state slot "
        "next to the paged KV cache (`pagedattn.runtime.state`); ok-state: no softmax attention at all (a "
        "state-space model), and the engine serves it with its recurrent state alone, generation equal. "
        "*equal to forward*: the engine's tokens differ from HF `generate` but equal greedy decoding by full "
        "forwards of the model itself (no cache): HF's generation cache disagrees with the model's own forward "
        "there (e.g. a sliding-window cache on a model whose forward attends to every key).",
        "",
        "## Totals",
        "",
        f"- architectures in the mapping: {len(rows)}; checked in this table: {len(ran)}"
        + (f" (not reached yet: {cats['not-run']}; rerun the script to fill them in)" if cats["not-run"] else ""),
        f"- built tiny: {built}; exported by `torch.export`: {exported}",
        f"- with softmax attention: {with_attention} (no softmax attention at all: "
        f"{cats['no-attention'] + cats['ok-state']})",
        f"- **ok (every attention site rewritten, equal logits and generation): {ok_all}** = "
        f"{100 * ok_all / max(exported, 1):.0f}% of those that build and export: {cats['ok']} with attention "
        f"({hybrids} of them hybrids served with their recurrent state) and {cats['ok-state']} state-space models "
        f"with none (ok-state); without those, {cats['ok']} = {100 * cats['ok'] / max(exported, 1):.0f}% of "
        f"those that build and export, {100 * cats['ok'] / max(with_attention, 1):.0f}% of those with softmax attention",
        f"- partial: {cats['partial']}; failed: {cats['failed']}; not exported: {cats['not-exported']}; "
        f"not built: {len(ran) - built}",
        "",
        "## Top reasons an architecture is not ok",
        "",
        "| reason | architectures |",
        "|---|---|",
    ]
    lines += [f"| {k} | {n} |" for k, n in reasons.most_common(15)]
    lines += ["", "## Per architecture", "",
              "| architecture | class | eager | sdpa | compile | max err | generate | time (s) | status | reasons |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, why = verdict(r)
        eng = r.get("engine") or {}
        gen = "-" if not eng else ("equal" if eng.get("equal") else "equal to forward*" if eng.get("equal_to_forward")
                                   else ("differs" if "equal" in eng else "err"))
        lines.append(f"| {r['arch']} | {r.get('class', '-')} | {_cell(r.get('eager'))} | {_cell(r.get('sdpa'))} | "
                     f"{_cell(r.get('compile'))} | {_err(r)} | {gen} | {r.get('time_s', 0):.0f} | {c} | "
                     f"{md_cell(why)} |")
    return write_markdown(path, lines)


def write_markdown(path: str, lines: list[str]) -> str:
    """Write a markdown table's lines to ``path`` (its folder made if needed); the text written."""
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return text


def md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")[:400]


def reason_key(part: str) -> str:
    """A reason without the stage and the specifics, for counting."""
    p = part.split(": ", 1)[-1] if part.split(": ", 1)[0] in ("eager", "sdpa", "compile", "engine") else part
    for cut in (" (", " at ", ": shape", "'"):
        if cut in p[12:]:
            p = p[: 12 + p[12:].index(cut)]
    return md_cell(p[:120])


# --------------------------------------------------------------------------------- main


def load_rows(path: str = RESULTS) -> dict[str, dict]:
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[r["arch"]] = r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated architectures")
    ap.add_argument("--fresh", action="store_true", help="rerun architectures already in the results file")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per architecture")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--table", default=TABLE)
    a = ap.parse_args()
    if a.child:
        run_one(a.child)
        return
    done = load_rows(a.results)
    if not a.table_only:
        archs = a.only.split(",") if a.only else architectures()
        for i, arch in enumerate(archs):
            if arch in done and not a.fresh:
                continue
            row = run_isolated(arch, a.timeout)
            done[arch] = row
            with open(a.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            c, why = verdict(row)
            print(f"[{i + 1}/{len(archs)}] {arch}: {c} {why[:200]} ({row.get('time_s', 0):.0f}s)", flush=True)
    with open(a.results, "w") as f:  # one row per architecture, the newest
        f.writelines(json.dumps(done[k]) + "\n" for k in sorted(done))
    write_table([done.get(k, {"arch": k, "not_run": True}) for k in architectures()], a.table)
    print(f"wrote {a.table}")


if __name__ == "__main__":
    main()
