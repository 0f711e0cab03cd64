"""Load on ``rewrite-model serve``: N concurrent streaming clients, N ramping from 1 to 256, on the demo model and
on a 30M-parameter Llama (random weights built from a config, the demo's byte-level tokenizer; no model hub).

Per level: requests/s, output tokens/s, time to first token and inter-token latency (p50/p99, as the clients
see them), HTTP errors by status, lost requests (admitted but never finished) and KV blocks still in use
once the level is over (from the server's /metrics). The server runs in its own process (the CLI, on a free
localhost port), its engine in a process of its own; clients retry a 503 (the documented full-queue answer)
after its Retry-After. Then the same requests run in this process through ``PagedEngine.generate`` (waves of
N prompts, the clients' concurrency) on an engine built the same way: the server's output tokens/s over
generate's is its overhead figure. CPU per output token of the engine process, of the in-process run and of
the server's HTTP process (``/proc``) tells the engine's own cost from the cores a loaded machine lends.

    pip install -e '.[serve]' aiohttp   # aiohttp: the load generator (a warm httpx pool costs more than the server)
    python benchmarks/serve_load.py [--models demo,llama30m] [--levels 1,4,16,64,256] [--max-tokens 32]

Bounded: each level sends max(N, --min-requests) requests and has --level-timeout seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import aiohttp  # the load generator: a light client, so that the clients' own cost on a small machine stays low
except ImportError:
    sys.exit("benchmarks/serve_load.py needs aiohttp for its clients: pip install aiohttp")
import httpx
import torch

ZEN = ["Beautiful is", "Explicit is", "Simple is better", "Complex is", "Flat is", "Sparse is", "Readability",
       "Special cases", "Although practicality", "Errors should", "In the face of", "There should be",
       "Now is better", "If the implementation", "Namespaces are"]
SERVER_ARGS = dict(num_blocks=1024, max_num_seqs=128, max_num_tokens=512, max_queue=64)


def prompts_for(n: int) -> list[str]:
    return [ZEN[i % len(ZEN)] + " " * (i // len(ZEN) % 3) for i in range(n)]  # varied, a few repeats


def build_llama30m(folder: str) -> str:
    """A 30M-parameter Llama with random weights and the demo's byte-level tokenizer (ids < 128: ASCII text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedattn.checkpoint import DEMO_DIR

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1536, num_hidden_layers=9,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO_DIR, "zen", f), folder)
    n = sum(p.numel() for p in model.parameters())
    print(f"llama30m: {n / 1e6:.1f}M parameters (random), saved to {folder}", flush=True)
    return folder


# ----------------------------------------------------------------------------- the server


def start_server(spec: str, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pagedattn.cli", "serve", spec, "--port", "0", "--threads", str(threads),
           "--shutdown-timeout", "5"] + [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_ARGS.items()]
    err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty stderr must not block the server
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    proc.err_file = err
    line = proc.stdout.readline()
    m = re.search(r"http://\S+/v1", line)
    if not m:
        proc.kill()
        err.seek(0)
        raise RuntimeError(f"the server did not start: {line}{err.read()}")
    return proc, m.group(0)


def stop_server(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    proc.err_file.seek(0)
    err = proc.err_file.read()
    if proc.returncode != 0 or "Traceback" in err or "ERROR" in err:
        print(f"server exit {proc.returncode}; stderr:\n{err}", flush=True)
    return out.strip().splitlines()[-1] if out.strip() else ""


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (Linux ``/proc``): the server's cost independent of how
    much of the machine it got."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(engine: int, http: int, threads: int, cores: list[int]) -> None:
    """The engine process (and its threads) on the first ``threads`` of ``cores``, the HTTP process and this one
    (the clients) on the others: each side keeps its own caches, as on a machine with a core per process."""
    if len(cores) <= threads:
        raise SystemExit(f"--pin needs more than {threads} cores; this machine has {len(cores)}")
    mine, rest = set(cores[:threads]), set(cores[threads:])
    for tid in os.listdir(f"/proc/{engine}/task"):
        os.sched_setaffinity(int(tid), mine)
    for pid in (http, os.getpid()):
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), rest)


def engine_pid(url: str) -> int:
    """The server's engine process (``GET /health``)."""
    return httpx.get(url.removesuffix("/v1") + "/health").json()["engine_pid"]


def server_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ----------------------------------------------------------------------------- clients


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, stats: dict) -> None:
    body = {"model": stats["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    for _attempt in range(600):
        t0 = time.perf_counter()
        first = last = None
        gaps, tokens = [], None
        try:
            async with session.post(url + "/completions", json=body) as r:
                if r.status != 200:
                    await r.read()
                    stats["errors"][r.status] = stats["errors"].get(r.status, 0) + 1
                    if r.status == 503:  # the documented answer of a full queue: retry as told
                        await asyncio.sleep(float(r.headers.get("Retry-After", 1)))
                        continue
                    stats["lost"] += 1
                    return
                async for raw in r.content:  # one SSE line at a time
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        stats["errors"]["stream"] = stats["errors"].get("stream", 0) + 1
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0]["text"]:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            stats["errors"][type(e).__name__] = stats["errors"].get(type(e).__name__, 0) + 1
            stats["lost"] += 1
            return
        if tokens is None:
            stats["lost"] += 1
            return
        stats["ttft"].append(first - t0 if first is not None else time.perf_counter() - t0)
        stats["itl"].extend(gaps)
        stats["tokens"] += tokens
        stats["done"] += 1
        return
    stats["lost"] += 1


async def run_level(url: str, model: str, n: int, prompts: list[str], max_tokens: int, timeout: float) -> dict:
    stats = {"model": model, "ttft": [], "itl": [], "tokens": 0, "done": 0, "lost": 0, "errors": {}}
    queue = list(prompts)

    async def client_task(session):
        while queue:
            await one_request(session, url, queue.pop(), max_tokens, stats)

    connector = aiohttp.TCPConnector(limit=n + 8, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        # connect first (clients keep their connections alive): the timed part is requests, not TCP handshakes
        health = url.removesuffix("/v1") + "/health"

        async def ping():
            async with session.get(health) as r:
                await r.read()

        await asyncio.gather(*(ping() for _ in range(n)))
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(client_task(session) for _ in range(n))), timeout)
        stats["wall"] = time.perf_counter() - t0
    return stats


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


# ----------------------------------------------------------------------------- in-process reference


def inprocess_tokens_per_s(spec: str, waves: list[list[list[str]]],
                           max_tokens: int) -> list[tuple[float, float, int]]:
    """``PagedEngine.generate`` over the same prompts in waves of the clients' concurrency, on an engine built as
    the CLI builds it: (output tokens/s, CPU seconds per output token, engine steps) per level."""
    import pagedattn
    from pagedattn.checkpoint import load_checkpoint

    ck = load_checkpoint(spec, None, "eager" if spec == "demo" else None)
    engine = pagedattn.PagedEngine(ck.model, target="cpu", num_blocks=SERVER_ARGS["num_blocks"],
                                   max_num_seqs=SERVER_ARGS["max_num_seqs"],
                                   max_num_tokens=SERVER_ARGS["max_num_tokens"])
    tok = ck.tokenizer
    engine.generate([tok(ZEN[0])["input_ids"]], max_new_tokens=4)  # warm-up, as the server's first request
    results = []
    for wave_set in waves:
        t0, c0, steps0 = time.perf_counter(), time.process_time(), engine.stats["steps"]
        n = 0
        for wave in wave_set:
            outs = engine.generate([tok(p)["input_ids"] for p in wave], max_new_tokens=max_tokens)
            n += sum(len(o) for o in outs)
        results.append((n / (time.perf_counter() - t0), (time.process_time() - c0) / n, engine.stats["steps"] - steps0))
    return results


def waves_for(prompts: list[str], n: int) -> list[list[str]]:
    return [prompts[i:i + n] for i in range(0, len(prompts), n)]


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,llama30m")
    ap.add_argument("--levels", default="1,4,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level at least (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, server and in-process (default 1)")
    ap.add_argument("--level-timeout", type=float, default=120.0)
    ap.add_argument("--pin", action="store_true",
                    help="the engine process on cores of its own (as many as --threads), the HTTP process and the "
                         "clients on the rest, and the in-process run on the engine's cores")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    tmp = tempfile.mkdtemp(prefix="serve_load-")
    print(f"load average at start: {os.getloadavg()[0]:.2f}; server settings {SERVER_ARGS}; "
          f"{args.max_tokens} tokens per request, greedy; torch threads {args.threads}", flush=True)
    rows = []
    cores = sorted(os.sched_getaffinity(0))
    try:
        for model in args.models.split(","):
            spec = "demo" if model == "demo" else build_llama30m(os.path.join(tmp, model))
            proc, url = start_server(spec, args.threads)
            name = "demo" if model == "demo" else model
            try:
                # warm-up request (first steps allocate); then the ramp
                asyncio.run(run_level(url, name, 1, [ZEN[0]], 4, args.level_timeout))
                level_prompts = {}
                pids = (proc.pid, engine_pid(url))  # the HTTP process and the engine process
                if args.pin:
                    pin(pids[1], proc.pid, args.threads, cores)
                for n in levels:
                    prompts = prompts_for(max(n, args.min_requests))
                    level_prompts[n] = prompts
                    cpu0 = [process_cpu_s(p) for p in pids]
                    steps0 = server_metrics(url).get("pagedattn_engine_steps_total", 0)
                    client0 = time.process_time()  # the clients run in this process
                    s = asyncio.run(run_level(url, name, n, prompts, args.max_tokens, args.level_timeout))
                    client_cpu = time.process_time() - client0
                    cpu1 = [process_cpu_s(p) for p in pids]
                    m = server_metrics(url)
                    row = {"model": model, "clients": n, "requests": len(prompts), "done": s["done"],
                           "lost": s["lost"], "errors": s["errors"], "wall_s": s["wall"],
                           "req_s": s["done"] / s["wall"], "tok_s": s["tokens"] / s["wall"],
                           "ttft_p50": pct(s["ttft"], 50), "ttft_p99": pct(s["ttft"], 99),
                           "itl_p50": pct(s["itl"], 50), "itl_p99": pct(s["itl"], 99),
                           "blocks_in_use": m.get("pagedattn_kv_blocks_used"),
                           "in_flight": m.get("pagedattn_requests_running", 0) + m.get("pagedattn_requests_waiting", 0),
                           "http_cpu_per_tok": (cpu1[0] - cpu0[0]) / max(1, s["tokens"]),
                           "engine_cpu_per_tok": (cpu1[1] - cpu0[1]) / max(1, s["tokens"]),
                           "steps": m.get("pagedattn_engine_steps_total", 0) - steps0,
                           "client_cpu_per_tok": client_cpu / max(1, s["tokens"]),
                           # engine, HTTP and client processes together, as a share of every core over the level
                           "machine_busy": (cpu1[0] - cpu0[0] + cpu1[1] - cpu0[1] + client_cpu)
                           / (s["wall"] * os.cpu_count()),
                           "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                print(f"{model}: server {stop_server(proc)}", flush=True)
            if args.pin:  # generate on the cores the engine process had
                os.sched_setaffinity(0, set(cores[:args.threads]))
            try:
                ref = inprocess_tokens_per_s(spec, [waves_for(level_prompts[n], n) for n in levels], args.max_tokens)
            finally:
                os.sched_setaffinity(0, set(cores))
            for row, (r, cpu, steps) in zip([r for r in rows if r["model"] == model], ref):
                row["inproc_tok_s"], row["inproc_cpu_per_tok"], row["inproc_steps"] = r, cpu, steps
                row["overhead_ratio"] = row["tok_s"] / r
                print(f"{model} N={row['clients']}: in-process generate {r:.0f} tok/s, server "
                      f"{row['tok_s']:.0f} tok/s ({100 * row['overhead_ratio']:.0f} %)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    nan = float("nan")
    print("\n| model | clients | requests | req/s | out tok/s | in-process tok/s | server/in-process | TTFT p50 / p99 "
          "(s) | ITL p50 / p99 (ms) | CPU ms/token: engine process / in-process / HTTP process / clients | "
          f"CPU busy (server and clients, of {os.cpu_count()} cores) | engine CPU vs "
          "in-process | engine steps: server / in-process | errors | lost | blocks in use after | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "none"
        print(f"| {r['model']} | {r['clients']} | {r['requests']} | {r['req_s']:.1f} | {r['tok_s']:.0f} | "
              f"{r.get('inproc_tok_s', float('nan')):.0f} | {100 * r.get('overhead_ratio', float('nan')):.0f} % | "
              f"{r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.1f} / {1e3 * r['itl_p99']:.1f} | "
              f"{1e3 * r['engine_cpu_per_tok']:.2f} / {1e3 * r.get('inproc_cpu_per_tok', nan):.2f} / "
              f"{1e3 * r['http_cpu_per_tok']:.2f} / {1e3 * r['client_cpu_per_tok']:.2f} | "
              f"{100 * r['machine_busy']:.0f} % | "
              f"{100 * r.get('inproc_cpu_per_tok', nan) / max(r['engine_cpu_per_tok'], 1e-9):.0f} % | "
              f"{r['steps']:.0f} / {r.get('inproc_steps', nan):.0f} | "
              f"{errors} | {r['lost']} | {r['blocks_in_use']:.0f} | {r['load']:.1f} |")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
