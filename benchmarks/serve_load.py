"""`swiftspec serve` under load, and its own overhead: N streamed requests one after another and N at
once (time to first token and tokens/s per request, p50/p95, as a client sees them), and the server's
tokens/s against scripted mode's on the same prompts (an in-process Engine of the same settings,
interleaved prompt by prompt, greedy, so both produce the same tokens).

    .venv/bin/python benchmarks/serve_load.py [--n 8] [--tokens 128] [--set fresh] [-- serve flags...]

Run it on a quiet machine (check `uptime`); the server and the in-process engine idle while the other
answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

from swiftspec.bench.prompts import select_prompts
from swiftspec.cli.options import chat_defaults
from swiftspec.engine.config import EngineConfig
from swiftspec.engine.host.client import Engine

KEY = "bench"


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "swiftspec", "serve", "--port", "0", "--api-key", KEY, "--temperature", "0",
           "--max-queue", "64", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if " on http://" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, re.search(r"http://\S+/v1", line).group(0)
    raise SystemExit("serve did not start")


def streamed(url: str, prompt: str, tokens: int) -> dict:
    """One streamed request: time to first token, tokens/s after it (the client's clock), the text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
    n = usage.get("completion_tokens", 0)
    return {"ttft_s": (first or t0) - t0, "tok_s": (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            "text": "".join(text)}


def in_process(engine: Engine, prompt: str, params) -> dict:
    """The same answer through scripted mode's path: Engine.generate in this process."""
    t0 = time.perf_counter()
    first = last = None
    n, text = 0, []
    for event in engine.generate([{"role": "user", "content": prompt}], params):
        n += len(event.token_ids)
        if event.text:
            last = time.perf_counter()
            first = first or last
            text.append(event.text)
    return {"ttft_s": (first or t0) - t0, "tok_s": (n - 1) / (last - first) if n > 1 and last > first else 0.0,
            "text": "".join(text)}


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"p50 {statistics.median(ordered):.3f} p95 {p95:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--set", default="fresh")
    ap.add_argument("serve_flags", nargs="*", help="after --: flags for serve (and the in-process engine's model)")
    args = ap.parse_args()
    prompts = [p.text for p in select_prompts(None, args.set, args.n)][: args.n]
    proc, url = start_server(args.serve_flags)
    target = next((args.serve_flags[i + 1] for i, f in enumerate(args.serve_flags) if f in ("--model", "-m")), None)
    params = dataclasses.replace(chat_defaults(target), temperature=0.0, max_new_tokens=args.tokens)
    try:
        with Engine.start(EngineConfig(target=target)) as engine:
            streamed(url, prompts[0], 8), in_process(engine, prompts[0], params)  # warm both
            pairs = []
            for i, prompt in enumerate(prompts):  # interleaved, each first half the time
                runs = [("server", lambda p=prompt: streamed(url, p, args.tokens)),
                        ("scripted", lambda p=prompt: in_process(engine, p, params))]
                got = dict((name, run()) for name, run in (runs if i % 2 == 0 else runs[::-1]))
                pairs.append(got)
            server_rate = statistics.median(p["server"]["tok_s"] for p in pairs)
            scripted_rate = statistics.median(p["scripted"]["tok_s"] for p in pairs)
            same = sum(p["server"]["text"] == p["scripted"]["text"] for p in pairs)
            print(f"sequential, {len(pairs)} prompts x {args.tokens} tokens: server {server_rate:.1f} tok/s, "
                  f"scripted {scripted_rate:.1f} tok/s (medians): server/scripted {server_rate / scripted_rate:.3f}; "
                  f"same text {same}/{len(pairs)}")
            print(f"  server TTFT s: {quantiles([p['server']['ttft_s'] for p in pairs])}; "
                  f"scripted TTFT s: {quantiles([p['scripted']['ttft_s'] for p in pairs])}")
        results: list[dict] = [{}] * len(prompts)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, streamed(url, prompts[i], args.tokens)))
                   for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - t0
        print(f"concurrent, {len(prompts)} at once: all done in {wall:.2f} s; TTFT s {quantiles([r['ttft_s'] for r in results])}; "
              f"tok/s per request {quantiles([r['tok_s'] for r in results])}; "
              f"same text as sequential {sum(r['text'] == p['server']['text'] for r, p in zip(results, pairs, strict=True))}/{len(prompts)}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
