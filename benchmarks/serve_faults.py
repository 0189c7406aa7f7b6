"""Injected faults against a running `swiftspec serve`: worker kills mid-answer, clients that hang up
mid-stream or while queued, slow readers, at random points, with other requests in flight. Every request
must end in a full answer (a finish reason and ``[DONE]``) or a clear error (an OpenAI error body, or an
error event mid-stream); after each fault the engine must be idle and healthy again, and at the end a
greedy answer must equal the one given before any fault.

    .venv/bin/python benchmarks/serve_faults.py [--faults 20] [--seed 0] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

KEY = "faults"
HEADERS = {"Authorization": f"Bearer {KEY}"}
KINDS = ("kill", "hang-up", "hang-up-queued", "slow-reader")


class Server:
    def __init__(self, flags: list[str]):
        cmd = [sys.executable, "-m", "swiftspec", "serve", "--port", "0", "--api-key", KEY, "--temperature", "0",
               *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            if " on http://" in line:
                self.url = re.search(r"http://\S+/v1", line).group(0)
                break
        else:
            raise SystemExit("serve did not start:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.base = self.url.removesuffix("/v1")

    def health(self) -> dict:
        try:
            return httpx.get(self.base + "/health", timeout=5).json()
        except httpx.HTTPError:
            return {"status": "unreachable"}

    def settled(self, within_s: float = 120.0) -> bool:
        """Healthy, idle and with nothing queued, within ``within_s``."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            h = self.health()
            if h.get("status") == "ok" and not h.get("busy") and not h.get("waiting"):
                return True
            time.sleep(0.1)
        return False

    def pids(self) -> list[int]:
        info = httpx.get(self.base + "/swiftspec/v1/info", headers=HEADERS, timeout=10).json()
        return [rank["pid"] for rank in info["engine"]["ranks"]]


def body(prompt: str, tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": stream,
            "swiftspec": {"ignore_eos": True}}


def streamed(server: Server, prompt: str, tokens: int, stop_after: int | None = None, delay_s: float = 0.0) -> str:
    """'full', 'error' or 'hung-up' (we left after ``stop_after`` chunks); anything else is a loss."""
    try:
        with httpx.stream("POST", server.url + "/chat/completions", json=body(prompt, tokens, True),
                          headers=HEADERS, timeout=300) as response:
            if response.status_code != 200:
                response.read()
                return "error" if "error" in response.json() else f"lost: {response.status_code} without an error body"
            finished = False
            for i, line in enumerate(response.iter_lines()):
                if stop_after is not None and i >= stop_after:
                    return "hung-up"
                time.sleep(delay_s)
                if line == "data: [DONE]":
                    return "full" if finished else "lost: [DONE] without a finish reason"
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "error"
                    finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
            return "lost: the stream ended without [DONE]"
    except httpx.HTTPError as e:
        return f"lost: {type(e).__name__}"


def whole(server: Server, prompt: str, tokens: int, timeout_s: float = 300) -> str:
    try:
        response = httpx.post(server.url + "/chat/completions", json=body(prompt, tokens, False), headers=HEADERS,
                              timeout=timeout_s)
    except httpx.ReadTimeout:
        return "hung-up"
    except httpx.HTTPError as e:
        return f"lost: {type(e).__name__}"
    if response.status_code == 200:
        return "full" if response.json()["choices"][0]["finish_reason"] else "lost: no finish reason"
    return "error" if "error" in response.json() else f"lost: {response.status_code} without an error body"


def reference(server: Server) -> str:
    response = httpx.post(server.url + "/chat/completions", headers=HEADERS, timeout=300, json={
        "messages": [{"role": "user", "content": "Name the planets of the solar system."}], "max_tokens": 64})
    return response.json()["choices"][0]["message"]["content"]


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def inject(server: Server, kind: str, rng: random.Random) -> list[str]:
    """One fault, with a bystander request queued behind it; the outcomes of every request involved."""
    prompt = f"Tell me about the number {rng.randrange(1000)}."
    bystander = None
    if kind == "kill":
        victim = in_thread(whole, server, prompt, 200)
        bystander = in_thread(streamed, server, "What is a prime number?", 32)
        time.sleep(rng.uniform(0.2, 2.0))
        os.kill(rng.choice(server.pids()), signal.SIGKILL)
    elif kind == "hang-up":
        victim = in_thread(streamed, server, prompt, 200, rng.randrange(1, 60))
        bystander = in_thread(whole, server, "What is a prime number?", 32)
    elif kind == "hang-up-queued":
        busy = in_thread(streamed, server, prompt, 150)
        time.sleep(0.3)
        victim = in_thread(whole, server, "This one gives up while it waits.", 32, rng.uniform(0.1, 1.0))
        victim[0].join()
        bystander = busy
    else:
        victim = in_thread(streamed, server, prompt, 64, None, rng.uniform(0.02, 0.1))
        bystander = in_thread(whole, server, "What is a prime number?", 32)
    outcomes = []
    for thread, out in (victim, bystander):
        thread.join(600)
        outcomes.append(out[0] if out else "lost: no outcome")
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_flags", nargs="*")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    server = Server(args.serve_flags)
    try:
        before = reference(server)
        tally: collections.Counter = collections.Counter()
        unsettled = 0
        for i in range(args.faults):
            kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
            outcomes = inject(server, kind, rng)
            settled = server.settled()
            unsettled += not settled
            tally.update(f"{kind}: {o}" for o in outcomes)
            print(f"fault {i + 1:2d} {kind:15s} -> {', '.join(outcomes)}; idle and healthy: {settled}", flush=True)
        after = reference(server)
        lost = sum(n for k, n in tally.items() if ": lost" in k)
        print("\n".join(f"  {k}: {n}" for k, n in sorted(tally.items())))
        print(f"{args.faults} faults: {lost} requests lost silently, {unsettled} times not idle and healthy after; "
              f"the answer after the faults {'equals' if after == before else 'DIFFERS from'} the one before")
        print(f"engine restarts logged: {sum('starting the engine again' in line for line in server.log)}")
    finally:
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(60)


if __name__ == "__main__":
    main()
