"""``rewrite-model``: rewrite a checkpoint's attention into paged attention, inspect it, run it, export it.

    rewrite-model CHECKPOINT -o OUT [--target cpu|cuda|xla|auto] [--block-size N] [--dtype D] [--force]
                  [--run] [--prompt TEXT] [--html FILE] [--onnx]
    rewrite-model inspect OUT [--site NAME] [--no-diff] [--html FILE]
    rewrite-model run OUT [--prompt TEXT ...] [--ids "1 2 3" ...] [--max-new-tokens N]
    rewrite-model export-onnx OUT [-o FILE]
    rewrite-model serve OUT|CHECKPOINT|demo [--host 127.0.0.1] [--port 8000] [--max-queue N] ...

CHECKPOINT is a Hugging Face model folder, a ``.pt2`` saved by ``torch.export``, or ``demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

log = logging.getLogger("pagedattn")

COMMANDS = ("inspect", "run", "export-onnx", "serve")
PROGRAM, WEIGHTS, REPORT_JSON, REPORT_TXT, GRAPHS, ONNX = (
    "model.pt2", "model.safetensors", "report.json", "report.txt", "graphs.json", "model.onnx")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEMO_PROMPT = "Beautiful is"


class CliError(Exception):
    """One line for the user: what is wrong and what to do. ``code`` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


# ----------------------------------------------------------------------------- arguments


def _rewrite_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rewrite-model", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Rewrite the attention of a checkpoint into a paged KV-cache write + paged attention.",
        epilog="other commands: rewrite-model {inspect,run,export-onnx,serve} OUT ... (see rewrite-model COMMAND -h)")
    p.add_argument("checkpoint", help="Hugging Face model folder, .pt2 program saved by torch.export, or 'demo'")
    p.add_argument("-o", "--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--target", default="cpu", choices=("cpu", "cuda", "xla", "auto"),
                   help="device whose paged-attention backend the program targets (default cpu)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default 16)")
    p.add_argument("--token-type-runs", type=int, default=4, metavar="N",
                   help="image blocks per request a mask read from token types is proven for (Gemma-3; default 4; "
                        "the proof takes longer the more)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="cast the model before rewriting (default: as saved)")
    p.add_argument("--attn-implementation", default=None, choices=("eager", "sdpa"),
                   help="Hugging Face attention implementation to load (default: transformers' choice)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--html", metavar="FILE", help="also write the inspection page")
    p.add_argument("--onnx", action="store_true", help="also export OUT/model.onnx and check it in onnxruntime")
    p.add_argument("--run", action="store_true", help="generate from the saved program afterwards")
    _generation_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and show tracebacks")
    return p


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeat for a batch); for an "
                   "encoder-decoder, the encoder's input text")
    p.add_argument("--ids", action="append", default=[], help="prompt as token ids, e.g. '1 2 3' (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt (default 64; "
                   "the demo: until EOS)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: enough for the batch)")
    p.add_argument("--features", action="append", default=[], metavar="FILE",
                   help="speech encoder-decoders (Whisper): a [mels, frames] log-mel features file, .npy (no "
                        "pickles) or .pt (tensors only), one request per file (repeatable); no audio decoding")


def _command_parser(cmd: str) -> argparse.ArgumentParser:
    if cmd == "serve":
        return _serve_parser()
    p = argparse.ArgumentParser(prog=f"rewrite-model {cmd}")
    p.add_argument("out", help="a folder written by rewrite-model")
    p.add_argument("-v", "--verbose", action="store_true")
    if cmd == "inspect":
        p.description = "Print the site table, the graph around each site before and after, and the code diff."
        p.add_argument("--site", action="append", default=[], help="only this site (repeatable)")
        p.add_argument("--no-diff", action="store_true", help="leave out the unified diff of the graph code")
        p.add_argument("--html", metavar="FILE", help="write a self-contained HTML page instead of text")
    elif cmd == "run":
        p.description = "Generate through the paged engine from a rewritten program."
        _generation_args(p)
    else:
        p.description = "Export the paged program to ONNX and check it in onnxruntime on CPU."
        p.add_argument("-o", "--output", default=None, help=f"ONNX file (default OUT/{ONNX})")
        p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    return p


# ----------------------------------------------------------------------------- entry point


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        cmd, args = argv[0], _command_parser(argv[0]).parse_args(argv[1:])
    else:
        cmd, args = "rewrite", _rewrite_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        with _quiet(not args.verbose):
            {"rewrite": cmd_rewrite, "inspect": cmd_inspect, "run": cmd_run, "export-onnx": cmd_export_onnx,
             "serve": cmd_serve}[cmd](args)
    except CliError as e:
        print(f"rewrite-model: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("rewrite-model: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything unforeseen still gets one line; --verbose shows where
        if args.verbose:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"rewrite-model: error: {type(e).__name__}: {first} (run with --verbose for the traceback)", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _quiet(enabled: bool):
    """Silence torch's and transformers' own warnings unless --verbose."""
    if not enabled:
        yield
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("torch", "torch._export", "torch.export", "torch.onnx", "transformers", "onnxscript"):
            logging.getLogger(name).setLevel(logging.ERROR)
        yield


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False, disable=None, file=sys.stderr)


# ----------------------------------------------------------------------------- rewrite


def cmd_rewrite(args) -> None:
    import torch

    from pagedattn import checkpoint as ckpt_mod
    from pagedattn.adapter import accepted_inputs, example_inputs
    from pagedattn.api import rewrite_program
    from pagedattn.backends import get_backend
    from pagedattn.program import ModelInfo
    from pagedattn.tracing import export_model

    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.force:
        raise CliError(f"{args.out} exists; pass --force to replace it or choose another -o")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CliError(f"cannot write {args.out}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"cannot write {args.out}: no permission to create files in {parent}")
    if args.block_size < 1:
        raise CliError(f"--block-size must be >= 1, got {args.block_size}")
    if args.token_type_runs < 1:
        raise CliError(f"--token-type-runs must be >= 1, got {args.token_type_runs}")
    target = _check_target(args.target)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    steps = ["load", "export", "passes", "save program", "save weights and report"]
    t0 = time.perf_counter()
    timings = {}
    with _progress(len(steps), "rewrite-model") as bar:
        bar.set_description("load checkpoint")
        try:
            attn = args.attn_implementation
            if attn is None and _is_demo(args.checkpoint):
                attn = "eager"  # the demo shows the hand-written matmul-softmax-matmul being found
            ck = ckpt_mod.load_checkpoint(args.checkpoint, dtype, attn)
        except ckpt_mod.CheckpointError as e:
            raise CliError(str(e)) from e
        timings["load_s"] = _lap(bar, t0, timings)
        if ck.kind == "hf" and ck.seq2seq:
            _rewrite_seq2seq(args, ck, out, target, bar, t0, timings)
            return
        bar.set_description("torch.export")
        if ck.kind == "hf":
            model = ck.model.to(target if target != "xla" else "cpu")
            kwargs = example_inputs(accepted_inputs(model), ModelInfo.of(model).vocab_size)
            kwargs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            try:
                ep = export_model(model, (), kwargs)
            except RuntimeError as e:
                raise CliError(f"{e}; the model cannot be rewritten", 1) from e
            flat = torch.utils._pytree.tree_flatten(((), kwargs))[0]
        else:
            ep = ck.program
            if ep.example_inputs is None:
                raise CliError(f"{args.checkpoint} carries no example inputs; re-export it with torch >= 2.6")
            if dtype is not None:
                raise CliError("--dtype applies to Hugging Face checkpoints; export the program in the dtype you want")
            flat = torch.utils._pytree.tree_flatten(ep.example_inputs)[0]
        timings["export_s"] = _lap(bar, t0, timings)
        bar.set_description("passes")
        try:
            rm = rewrite_program(ep, flat, get_backend(target), args.block_size,
                                 info=ModelInfo.of(ck.model) if ck.kind == "hf" else None,
                                 token_type_runs=args.token_type_runs)
        except ValueError as e:
            raise CliError(f"{e}", 1) from e
        timings["passes_s"] = _lap(bar, t0, timings)
        n_rw = sum(r["status"] == "rewritten" for r in rm.report)
        if not rm.report or n_rw == 0:
            why = "; ".join(f"{r['name']}: {r['reason']}" for r in rm.report) or "the graph has no softmax or SDPA"
            raise CliError(f"no attention found to rewrite in {args.checkpoint} ({why}); nothing was written")
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out) or ".")
        try:
            bar.set_description("save program")
            rm.save(os.path.join(tmp, PROGRAM))
            timings["save_s"] = _lap(bar, t0, timings)
            bar.set_description("save weights and report")
            _save_weights(ck, os.path.join(tmp, WEIGHTS))
            if ck.kind == "hf":
                ck.config.save_pretrained(tmp)
                if ck.tokenizer is not None:
                    ck.tokenizer.save_pretrained(tmp)
            info = _report_info(args, ck, rm, target, timings)
            _write_reports(tmp, info, rm.report, rm.graph_views)
            bar.update(1)
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    from pagedattn.report import site_table

    print(f"{args.checkpoint} ({ck.architecture}) -> {args.out}: {n_rw} of {len(rm.report)} attention sites "
          f"rewritten for target {target} in {time.perf_counter() - t0:.1f}s")
    print(site_table(rm.report))
    print(f"wrote {', '.join(sorted(os.listdir(out)))}")
    if args.html:
        _write_html(out, args.html)
    if args.onnx:
        _export_onnx(out, os.path.join(out, ONNX), check=True)
    if args.run:
        _run(out, args)


def _rewrite_seq2seq(args, ck, out: str, target: str, bar, t0: float, timings: dict) -> None:
    """An encoder-decoder checkpoint: its decoder step rewritten (self-attention paged, cross-attention over
    blocks filled once per request) and checked, its encoder's attention rewritten for the report; OUT keeps
    the checkpoint itself (config, safetensors weights, generation config, tokenizer) and the report, no
    ``model.pt2`` (a saved decoder step would lose its cross-attention writer): ``run`` and ``serve`` rebuild
    the engine from OUT, loading the weights without running code from them."""
    from pagedattn.backends import get_backend
    from pagedattn.seq2seq import prepare_seq2seq

    if args.onnx:
        raise CliError("--onnx: ONNX export of an encoder-decoder is not supported")
    bar.set_description("rewrite decoder step")
    model = ck.model.to(target)
    try:
        serving = prepare_seq2seq(model, get_backend(target), args.block_size)
    except ValueError as e:
        raise CliError(f"{args.checkpoint} cannot be served: {_one_line(e)}", 1) from e
    timings["export_s"] = _lap(bar, t0, timings)
    bar.set_description("encoder")
    if target == "xla":  # served and checked on XLA; read (torch.export) and saved from the CPU
        model.to("cpu")
    report = _encoder_sites(serving, "cpu" if target == "xla" else target) + [dict(r) for r in serving.step.report]
    for r in report[len(report) - len(serving.step.report):]:
        r["attention_type"] = {"self": "decoder self", "cross": "cross"}.get(r.get("attention_type"), "")
    timings["passes_s"] = _lap(bar, t0, timings)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out) or ".")
    try:
        bar.set_description("save checkpoint and report")
        _save_weights(ck, os.path.join(tmp, WEIGHTS))
        ck.config.save_pretrained(tmp)
        if getattr(ck.model, "generation_config", None) is not None:
            ck.model.generation_config.save_pretrained(tmp)
        if ck.tokenizer is not None:
            ck.tokenizer.save_pretrained(tmp)
        timings["save_s"] = _lap(bar, t0, timings)
        info = {**_report_info(args, ck, serving.step, target, timings), "kind": "seq2seq", "sites": len(report),
                "rewritten": sum(r["status"] == "rewritten" for r in report),
                "encoder_input": serving.spec.encoder_input}
        info["skipped"] = info["sites"] - info["rewritten"]
        _write_reports(tmp, info, report, None)
        bar.update(1)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    from pagedattn.report import site_table

    print(f"{args.checkpoint} ({ck.architecture}, encoder-decoder) -> {args.out}: {_site_kinds(report)} in "
          f"{time.perf_counter() - t0:.1f}s (target {target})")
    print(site_table(report))
    print(f"wrote {', '.join(sorted(os.listdir(out)))}")
    if args.run:
        _run(out, args)


def _encoder_sites(serving, target: str) -> list[dict]:
    """The encoder's attention sites as the rewriter reads them (report rows, ``attention_type`` "encoder
    self"); the engine runs the model's own encoder once per request, non-causal over its tokens."""
    import torch

    import pagedattn
    from pagedattn.seq2seq import example_sources

    srcs = example_sources(serving, torch.device(target))
    name = serving.spec.encoder_input
    example = {name: torch.stack([s[name] for s in srcs[:1]] * 2).to(target)}
    if name == "input_ids":
        example = {name: torch.stack([srcs[0][name]] * 2).to(target),
                   "attention_mask": torch.ones(2, srcs[0][name].shape[-1], dtype=torch.long, device=target)}
    try:
        rm = pagedattn.rewrite(serving.spec.encoder, (), example, target=target)
    except Exception as e:  # the report goes without them; serving does not need them
        log.warning("the encoder's attention could not be read for the report: %s", _one_line(e))
        return []
    return [{**r, "name": f"encoder.{r['name']}", "attention_type": "encoder self"} for r in rm.report]


def _site_kinds(report: list[dict]) -> str:
    """``2 encoder self, 2 decoder self, 2 cross (6 of 6 rewritten)``."""
    kinds = [r.get("attention_type") or "other" for r in report]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    return f"{counts} ({sum(r['status'] == 'rewritten' for r in report)} of {len(report)} rewritten)"


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _lap(bar, t0: float, timings: dict) -> float:
    """Seconds since the previous stage ended (stages are timed back to back from ``t0``)."""
    bar.update(1)
    return round(time.perf_counter() - t0 - sum(timings.values()), 3)


def _check_target(target: str) -> str:
    import torch

    from pagedattn.backends import get_backend

    if target == "cuda" and not torch.cuda.is_available():
        raise CliError("target cuda needs an NVIDIA GPU and this machine has none; use --target cpu")
    if target == "xla":
        try:
            import torch_xla  # noqa: F401
        except ImportError as e:
            raise CliError("target xla needs torch_xla (pip install 'pagedattn[xla]'); use --target cpu") from e
    try:
        return get_backend(target).device_type
    except ValueError as e:
        raise CliError(f"unsupported target {target}: {e}") from e


def _save_weights(ck, path: str) -> None:
    from safetensors.torch import save_file, save_model

    if ck.kind == "hf":
        save_model(ck.model, path)  # drops tied duplicates
    else:
        state = {k: v.detach().contiguous() for k, v in ck.program.state_dict.items()}
        save_file(_untie(state), path)


def _untie(state: dict) -> dict:
    seen, out = {}, {}
    for k, v in state.items():
        key = (v.data_ptr(), v.shape, v.dtype)
        out[k] = v.clone() if key in seen else v
        seen[key] = k
    return out


def _report_info(args, ck, rm, target: str, timings: dict) -> dict:
    import torch

    import pagedattn

    versions = {"pagedattn": pagedattn.__version__, "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        versions["transformers"] = transformers.__version__
    n_rw = sum(r["status"] == "rewritten" for r in rm.report)
    demo = _is_demo(args.checkpoint)
    return {
        "checkpoint": args.checkpoint, "kind": ck.kind, "architecture": ck.architecture, "target": target,
        "block_size": args.block_size, "dtype": args.dtype, "sites": len(rm.report), "rewritten": n_rw,
        "skipped": len(rm.report) - n_rw, "cache_specs": [s.to_json() for s in rm.cache_specs], "tokenizer": ck.tokenizer is not None,
        "default_prompt": DEMO_PROMPT if demo else None, "timings": timings, "versions": versions,
    }


def _is_demo(checkpoint: str) -> bool:
    from pagedattn.checkpoint import DEMOS

    return checkpoint in DEMOS and not os.path.exists(checkpoint)


def _write_reports(folder: str, info: dict, report: list[dict], views: Optional[dict]) -> None:
    from pagedattn.inspection import render_text

    with open(os.path.join(folder, REPORT_JSON), "w") as f:
        json.dump({**info, "report": report}, f, indent=2, default=str)
    with open(os.path.join(folder, REPORT_TXT), "w") as f:
        f.write(_summary_text(info) + "\n\n" + render_text(report, views) + "\n")
    if views is not None:
        with open(os.path.join(folder, GRAPHS), "w") as f:
            json.dump(views, f)


def _summary_text(info: dict) -> str:
    keys = ("checkpoint", "architecture", "target", "block_size", "dtype", "sites", "rewritten", "skipped")
    return "\n".join(f"{k}: {info.get(k)}" for k in keys)


def _replace_dir(tmp: str, out: str) -> None:
    """Move the finished folder into place; an old OUT is removed only once the new one is complete."""
    old = None
    if os.path.exists(out):
        old = out + f".old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


# ----------------------------------------------------------------------------- inspect


def _read_out(out: str) -> tuple[dict, Optional[dict]]:
    path = os.path.join(out, REPORT_JSON)
    if not os.path.isdir(out):
        raise CliError(f"{out} is not a folder; give the -o folder of a rewrite-model run")
    if not os.path.isfile(path):
        raise CliError(f"{out} has no {REPORT_JSON}: not written by rewrite-model (run rewrite-model CHECKPOINT -o {out})")
    try:
        with open(path) as f:
            info = json.load(f)
        views = None
        if os.path.isfile(os.path.join(out, GRAPHS)):
            with open(os.path.join(out, GRAPHS)) as f:
                views = json.load(f)
    except json.JSONDecodeError as e:
        raise CliError(f"{out}: a report file is corrupt ({e}); rewrite the checkpoint again") from e
    return info, views


def cmd_inspect(args) -> None:
    from pagedattn.inspection import render_text

    info, views = _read_out(args.out)
    unknown = [s for s in args.site if s not in {r["name"] for r in info["report"]}]
    if unknown:
        raise CliError(f"no site {unknown[0]!r}; sites: {', '.join(r['name'] for r in info['report'])}")
    if args.html:
        _write_html(args.out, args.html)
        return
    print(_summary_text(info))
    if info.get("kind") == "seq2seq":
        print(f"sites: {_site_kinds(info['report'])}")
        for r in info["report"]:
            print(f"  {r.get('attention_type') or 'other':13s} {r['name']}: {r['status']}"
                  + (f" ({r['reason']})" if r.get("reason") else ""))
    print()
    print(render_text(info["report"], views, sites=args.site or None, diff=not args.no_diff))


def _write_html(out: str, html_path: str) -> None:
    from pagedattn.inspection import graphviz_missing, render_html

    info, views = _read_out(out)
    summary = {k: info.get(k) for k in ("checkpoint", "architecture", "target", "block_size", "dtype", "sites",
                                         "rewritten", "skipped")}
    page = render_html(info["report"], views, title=f"pagedattn: {info.get('checkpoint')}", summary=summary)
    with open(html_path, "w") as f:
        f.write(page)
    why = graphviz_missing()
    print(f"wrote {html_path}" + (f" (no site drawings: {why})" if why else ""))


# ----------------------------------------------------------------------------- run


def cmd_run(args) -> None:
    _run(args.out, args)


def _load_program(out: str):
    import pagedattn

    path = os.path.join(out, PROGRAM)
    if not os.path.isfile(path):
        raise CliError(f"{out} has no {PROGRAM}: give the -o folder of a rewrite-model run")
    from pagedattn.safe_archive import UnsafeArchive

    try:
        return pagedattn.load(path)
    except UnsafeArchive as e:
        raise CliError(f"refusing to load {path}: {e}") from e
    except Exception as e:
        raise CliError(f"could not load {path}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}; "
                       "rewrite the checkpoint again", 1) from e


def _tokenizer(out: str, info: dict):
    if not info.get("tokenizer"):
        return None
    from transformers import AutoTokenizer

    from pagedattn.checkpoint import quiet_transformers

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(out, local_files_only=True)
    except Exception as e:
        raise CliError(f"{out}: the tokenizer saved with the program does not load ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); give prompts with --ids") from e


def _prompts(args, info: dict, tok) -> list[list[int]]:
    texts = list(args.prompt) or ([] if args.ids else [info["default_prompt"]] if info.get("default_prompt") else [])
    if texts and tok is None:
        raise CliError("this checkpoint carries no tokenizer: give prompts as token ids with --ids '1 2 3'")
    given = [(f"--prompt {t!r}", tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    for s in args.ids:
        try:
            given.append((f"--ids {s!r}", [int(x) for x in s.replace(",", " ").split()]))
        except ValueError as e:
            raise CliError(f"--ids {s!r}: token ids are integers separated by spaces or commas") from e
    for what, ids in given:
        if not ids:
            raise CliError(f"{what}: the prompt is empty (no tokens); give at least one")
    prompts = [ids for _, ids in given]
    if not prompts:
        raise CliError("nothing to generate from: give --prompt TEXT or --ids '1 2 3'")
    return prompts


def _run(out: str, args) -> None:
    import pagedattn

    info, _ = _read_out(out)
    if args.num_blocks is not None and args.num_blocks < 1:
        raise CliError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tok = _tokenizer(out, info)
    if info.get("kind") == "seq2seq":
        _run_seq2seq(out, args, info, tok)
        return
    if getattr(args, "features", None):
        raise CliError("--features is for speech encoder-decoders (e.g. Whisper); this model takes text")
    prompts = _prompts(args, info, tok)  # bad prompts fail before the program loads
    rm = _load_program(out)
    demo = bool(info.get("default_prompt"))
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (1024 if demo else 64)
    need = sum(-(-(len(p) + max_new) // rm.block_size) for p in prompts)
    num_blocks = args.num_blocks if args.num_blocks is not None else need + 1
    target = info["target"]
    outs, dt = _generate(lambda: pagedattn.PagedEngine(rm, target=target, block_size=rm.block_size,
                                                       num_blocks=num_blocks, max_num_tokens=512),
                         prompts, max_new, args, "prompt")
    n = sum(len(o) for o in outs)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if tok is not None:
            print(f"[{i}] {tok.decode(p)}{tok.decode(o, skip_special_tokens=True)}")
        else:
            print(f"[{i}] prompt {p} -> {o}")
    print(f"{len(prompts)} prompt(s), {n} tokens generated in {dt:.2f}s ({n / dt:.1f} tok/s) through the paged "
          f"engine ({target}, {num_blocks} blocks of {rm.block_size})")


def _seq2seq_inputs(args, info: dict, tok) -> list:
    """Each request's encoder input: texts tokenized as the model's ``generate`` takes them (special tokens
    included), ``--ids``, or (speech models) ``--features`` files."""
    if info.get("encoder_input") == "input_features":
        if args.prompt or args.ids:
            raise CliError("this model's encoder takes audio features: give --features FILE (.npy or .pt, "
                           "[mels, frames])")
        if not args.features:
            raise CliError("nothing to transcribe: give --features FILE (.npy or .pt, [mels, frames])")
        return [{"input_features": _read_features(f)} for f in args.features]
    if args.features:
        raise CliError("--features is for speech encoder-decoders; this model's encoder takes text")
    if args.prompt and tok is None:
        raise CliError("this checkpoint carries no tokenizer: give the encoder input as token ids with --ids '1 2 3'")
    inputs = [tok(t)["input_ids"] for t in args.prompt]
    for s in args.ids:
        try:
            inputs.append([int(x) for x in s.replace(",", " ").split()])
        except ValueError as e:
            raise CliError(f"--ids {s!r}: token ids are integers separated by spaces or commas") from e
    if not inputs:
        raise CliError("nothing to generate from: give --prompt TEXT (the encoder's input) or --ids '1 2 3'")
    return inputs


def _read_features(path: str):
    """A ``[mels, frames]`` float array from ``.npy`` (no pickles) or ``.pt`` (``weights_only``: tensors only)."""
    import numpy as np
    import torch

    try:
        if path.endswith(".npy"):
            x = torch.from_numpy(np.load(path, allow_pickle=False))
        elif path.endswith(".pt"):
            x = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise CliError(f"--features {path}: give a .npy or .pt file holding a [mels, frames] array")
    except (OSError, ValueError, RuntimeError) as e:
        raise CliError(f"--features {path}: cannot read it ({_one_line(e)})") from e
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise CliError(f"--features {path}: expected one float [mels, frames] array, got "
                       f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.float()


def _run_seq2seq(out: str, args, info: dict, tok) -> None:
    """``run`` for an encoder-decoder OUT: the engine built from the checkpoint OUT keeps (safetensors)."""
    import pagedattn
    from pagedattn import checkpoint as ckpt_mod

    inputs = _seq2seq_inputs(args, info, tok)  # bad input fails before the model loads
    try:
        ck = ckpt_mod.load_checkpoint(out, None, None)
    except ckpt_mod.CheckpointError as e:
        raise CliError(str(e)) from e
    max_new = args.max_new_tokens if args.max_new_tokens is not None else 64
    target = _check_target(info["target"])  # the device's runtime imported (torch_xla registers "xla")
    outs, dt = _generate(lambda: pagedattn.PagedEngine(ck.model.to(target), target=target,
                                                       block_size=info["block_size"], num_blocks=args.num_blocks or 2048,
                                                       max_num_tokens=512, progress=False),
                         inputs, max_new, args, "input")
    n = sum(len(o) for o in outs)
    for i, o in enumerate(outs):
        print(f"[{i}] {tok.decode(o, skip_special_tokens=True)}" if tok is not None else f"[{i}] {o}")
    print(f"{len(outs)} input(s), {n} tokens generated in {dt:.2f}s ({n / dt:.1f} tok/s) through the paged "
          f"engine ({target}, encoder-decoder)")


def _generate(make_engine, prompts: list, max_new: int, args, what: str) -> tuple[list, float]:
    """Build the engine and generate with the command's sampling options: ``(outputs, seconds)``; a model
    the engine refuses or a bad prompt is one CliError line (``what`` names a prompt in it)."""
    import pagedattn

    try:
        engine = make_engine()
    except ValueError as e:
        raise CliError(str(e)) from e
    t0 = time.perf_counter()
    try:
        outs = engine.generate(prompts, max_new_tokens=max_new, temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, seed=args.seed)
    except pagedattn.RequestErrors as e:
        raise CliError("; ".join(f"{what} {i}: {why}" for i, why in e.errors.items())) from e
    return outs, time.perf_counter() - t0


# ----------------------------------------------------------------------------- serve


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rewrite-model serve",
        description="Serve a model through the paged engine with an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    p.add_argument("model", metavar="OUT|CHECKPOINT|demo",
                   help="a folder written by rewrite-model, a Hugging Face model folder, or 'demo'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                   "folder's name, or 'demo')")
    p.add_argument("--target", default="cpu", choices=("cpu", "cuda", "xla", "auto"),
                   help="device to serve a checkpoint on (default cpu; a rewritten OUT keeps its own)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size of a checkpoint (default 16)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV-cache blocks (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests generated at a time (default 256)")
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait beyond --max-num-seqs; "
                   "more are answered 503 (default 256)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt plus completion tokens of a request "
                   "(default: what the cache and the model's attention allow)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template to use instead of the tokenizer's")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="seconds in-flight requests get to "
                   "finish on Ctrl-C/SIGTERM before they are aborted (default 5)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress and requests, show tracebacks")
    return p


def _check_serve_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_tokens", "threads", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise CliError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise CliError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")


def _serve_model(args):
    """(model for the engine, tokenizer or None, name, target, block size) for OUT, a checkpoint or the demo."""
    from pagedattn import checkpoint as ckpt_mod

    spec = args.model
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, REPORT_JSON)):  # a rewrite-model OUT
        info, _ = _read_out(spec)
        tok = _tokenizer(spec, info)
        name = os.path.basename(os.path.abspath(spec))
        if info.get("kind") == "seq2seq":  # the engine rewrites the checkpoint OUT keeps, as run does
            _check_serves_text(spec, info.get("encoder_input", "input_ids"))
            try:
                ck = ckpt_mod.load_checkpoint(spec, None, None)
            except ckpt_mod.CheckpointError as e:
                raise CliError(str(e)) from e
            target = _check_target(info["target"])
            return ck.model.to(target), tok, name, target, info["block_size"]
        rm = _load_program(spec)
        return rm, tok, name, info["target"], rm.block_size
    try:
        ck = ckpt_mod.load_checkpoint(spec, None, "eager" if _is_demo(spec) else None)
    except ckpt_mod.CheckpointError as e:
        raise CliError(str(e)) from e
    if ck.kind != "hf":
        raise CliError(f"{spec} is a torch.export program: rewrite it first (rewrite-model {spec} -o OUT) and "
                       "serve OUT")
    if ck.seq2seq:
        _check_serves_text(spec, getattr(ck.model, "main_input_name", "input_ids"))
    name = spec if _is_demo(spec) else os.path.basename(os.path.abspath(spec))
    return ck.model, ck.tokenizer, name, _check_target(args.target), args.block_size


def _check_serves_text(spec: str, encoder_input: str) -> None:
    """An encoder-decoder is served over HTTP when its encoder takes text (the prompt is the encoder's input)."""
    if encoder_input != "input_ids":
        raise CliError(f"{spec} is a speech encoder-decoder (its encoder takes {encoder_input!r}): the OpenAI "
                       f"completions API carries text, so it is not served over HTTP; transcribe with rewrite-model "
                       "run OUT --features FILE")


def _serve_tokenizer(args):
    """(tokenizer or None, served name) without loading the model: the server's process needs no more (the
    engine process loads the model)."""
    spec = args.model
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, REPORT_JSON)):  # a rewrite-model OUT
        info, _ = _read_out(spec)
        if info.get("kind") == "seq2seq":
            _check_serves_text(spec, info.get("encoder_input", "input_ids"))
        return _tokenizer(spec, info), os.path.basename(os.path.abspath(spec))
    from pagedattn import checkpoint as ckpt_mod

    try:
        kind, path = ckpt_mod.resolve(spec)
    except ckpt_mod.CheckpointError as e:
        raise CliError(str(e)) from e
    if kind != "hf":
        raise CliError(f"{spec} is a torch.export program: rewrite it first (rewrite-model {spec} -o OUT) and "
                       "serve OUT")
    return ckpt_mod.load_tokenizer(path), spec if _is_demo(spec) else os.path.basename(os.path.abspath(spec))


def _serve_engine(args):
    """The engine ``rewrite-model serve`` serves; runs in the engine process (a ``CliError`` says what is wrong)."""
    import torch

    import pagedattn

    if args.threads:
        torch.set_num_threads(args.threads)
    model, _tok, _name, target, block_size = _serve_model(args)
    try:
        return pagedattn.PagedEngine(model, target=target, block_size=block_size, num_blocks=args.num_blocks,
                                     max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens)
    except ValueError as e:
        raise CliError(str(e)) from e


def cmd_serve(args) -> None:
    _check_serve_args(args)
    try:
        from pagedattn import serve
    except ImportError as e:
        raise CliError(f"rewrite-model serve needs fastapi, uvicorn and prometheus-client ({e}); "
                       "pip install 'pagedattn[serve]'") from e
    import functools
    import signal

    import torch

    template = None
    if args.chat_template:
        try:
            with open(args.chat_template) as f:
                template = f.read()
        except OSError as e:
            raise CliError(f"cannot read --chat-template {args.chat_template}: {e.strerror}") from e
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # before loading: a port in use fails at once
        sock = serve.bind(args.host, args.port)
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; pick another --port") from e
    try:
        tok, name = _serve_tokenizer(args)
        config = serve.ServeConfig(model_name=args.served_model_name or name, max_queue=args.max_queue,
                                   max_model_len=args.max_model_len, chat_template=template)
        # the engine steps in a process of its own (it loads, rewrites and compiles the model there)
        engine = serve.EngineProcess(functools.partial(_serve_engine, args))
        try:
            app = serve.create_app(engine, tok, config)
        except serve.EngineStartError as e:
            raise CliError(str(e).removeprefix("the engine could not be built: CliError: ")) from e
        host, port = sock.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
        print(f"serving {config.model_name} on {url} (OpenAI API: /v1/completions, /v1/chat/completions; "
              f"/health, /metrics); Ctrl-C stops", flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found:
        # SIGTERM's becomes KeyboardInterrupt like SIGINT's, and both are the normal way out here
        term = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            with contextlib.suppress(KeyboardInterrupt):
                serve.run(app, sock, shutdown_timeout=args.shutdown_timeout,
                          log_level="info" if args.verbose else "warning", access_log=args.verbose)
        finally:
            signal.signal(signal.SIGTERM, term)
    finally:
        sock.close()
    loop = app.state.engine_loop
    final = loop.final
    free = f"{loop.info.num_blocks - final.blocks_used}" if final is not None else "unknown (the engine died)"
    print(f"stopped: {free} of {loop.info.num_blocks} KV blocks free", flush=True)


# ----------------------------------------------------------------------------- ONNX


def cmd_export_onnx(args) -> None:
    info, _ = _read_out(args.out)
    if info.get("kind") == "seq2seq":
        raise CliError(f"{args.out} is an encoder-decoder: ONNX export of one is not supported")
    _export_onnx(args.out, args.output or os.path.join(args.out, ONNX), check=not args.no_check)


def _export_onnx(out: str, path: str, check: bool) -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise CliError("ONNX export needs onnx and onnxscript (pip install 'pagedattn[onnx]')") from e
    from pagedattn.onnx_export import export_onnx, verify_onnx

    rm = _load_program(out)
    try:
        export_onnx(rm, path)
    except BaseException:
        for f in (path, path + ".data"):
            if os.path.exists(f):
                os.remove(f)
        raise
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB), onnx.checker passed")
    if check:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise CliError("checking the ONNX model needs onnxruntime (pip install onnxruntime) or pass --no-check") from e
        errs = verify_onnx(rm, path)
        print("onnxruntime (CPU) vs PyTorch, max |difference|: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        worst = max(errs.values())
        if not worst < 1e-3:
            raise CliError(f"onnxruntime disagrees with PyTorch by {worst:.3g}", 1)


if __name__ == "__main__":
    sys.exit(main())
