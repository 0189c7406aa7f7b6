"""The bench's llama.cpp mode: the same GGUF through llama-cpp-python, greedy, as a user would run it on
this machine (every core), timed token by token.

llama.cpp runs in a child process of its own (``python -m swiftspec.bench.llamacpp``) that answers one
JSON request per line: a build whose kernels this CPU lacks dies with SIGILL, and that must show as a
crashed peer in the report, not take the bench down or read as a failed run of ours. The prompt goes in
as token ids from our own tokenizer and chat template, so both engines answer exactly the same input. A
prompt's JSON Schema goes along, and llama.cpp holds its answer to it through its own grammar path
(``LlamaGrammar.from_json_schema``, what its ``response_format`` with a schema uses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from swiftspec.bench.runners import PeerCrashed, Sample
from swiftspec.engine.host.encode import encode_chat

MODE = "llama.cpp"
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
           ".venv/bin/pip install llama-cpp-python")


def available() -> str | None:
    """None when llama-cpp-python is installed, else how to install it."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return f"the llama.cpp mode needs llama-cpp-python (it compiles llama.cpp, a few minutes): {INSTALL}"
    return None


def default_threads() -> int:
    """What llama.cpp users get on this machine: every core the process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LlamaCppRunner:
    """One llama.cpp process for the whole run; each call answers one prompt (the bench's Runner)."""

    def __init__(self, gguf: Path, tokenizer, eos: list[int], threads: int, n_ctx: int):
        self.tokenizer, self.eos, self.threads = tokenizer, eos, threads
        cmd = [sys.executable, "-P", "-m", "swiftspec.bench.llamacpp", "--model", str(gguf), "--threads", str(threads),
               "--n-ctx", str(n_ctx)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self._read("ready")

    def _read(self, want: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise PeerCrashed(self._death())
        try:
            msg = json.loads(line)
        except ValueError:
            raise PeerCrashed(f"llama.cpp answered something that is not JSON: {line[:200]!r}") from None
        if msg.get("type") == "error":
            raise PeerCrashed(f"llama.cpp failed: {msg.get('message')}")
        if msg.get("type") != want:
            raise PeerCrashed(f"llama.cpp answered {msg.get('type')!r} where {want!r} was due")
        return msg

    def _death(self) -> str:
        rc = self.proc.returncode
        tail = (self.proc.stderr.read() or "").strip().splitlines()[-3:]
        how = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited with {rc}"
        hint = (f"; its build uses instructions this CPU lacks: rebuild it with {INSTALL}"
                if rc == -signal.SIGILL else "")
        return f"llama.cpp {how}{hint}" + (f" ({' / '.join(tail)})" if tail else "")

    def __call__(self, messages, params):
        ids = encode_chat(self.tokenizer, messages)
        try:
            schema = params.grammar.source if params.grammar is not None else None  # a JSON Schema's text
            self.proc.stdin.write(json.dumps({"type": "generate", "ids": ids, "max_new_tokens": params.max_new_tokens,
                                              "eos": self.eos, "schema": schema}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.proc.wait(timeout=30)
            raise PeerCrashed(self._death()) from None
        out = self._read("done")
        arrivals = [(float(t), 1) for t in out["times"]]
        return Sample(token_ids=out["ids"], seconds=arrivals[-1][0] if arrivals else 0.0, arrivals=arrivals,
                      prefill_tokens=len(ids), verifications=max(len(arrivals) - 1, 0))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _serve(model: str, threads: int, n_ctx: int) -> None:
    """The child: loads the GGUF and answers requests until stdin closes."""
    from llama_cpp import Llama, LlamaGrammar

    out = os.fdopen(os.dup(1), "w")  # the replies' own descriptor: llama.cpp's prints (C or Python) go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)

    def reply(**msg) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    reply(type="ready")
    for line in sys.stdin:
        req = json.loads(line)
        eos = set(req["eos"]) | {llm.token_eos()}
        ids, times = [], []
        t0 = time.perf_counter()  # the schema's compile counts, as the Engine's does
        grammar = LlamaGrammar.from_json_schema(req["schema"], verbose=False) if req["schema"] else None
        for tok in llm.generate(req["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True,
                                grammar=grammar):
            if tok in eos:
                break
            ids.append(int(tok))
            times.append(time.perf_counter() - t0)
            if len(ids) >= req["max_new_tokens"]:
                break
        reply(type="done", ids=ids, times=times)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="swiftspec bench's llama.cpp peer (one JSON request per line)")
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--n-ctx", type=int, default=4096)
    a = p.parse_args()
    try:
        _serve(a.model, a.threads, a.n_ctx)
    except Exception as e:  # a clear line for the parent instead of a traceback it cannot parse
        sys.__stdout__.write(json.dumps({"type": "error", "message": f"{type(e).__name__}: {e}"}) + "\n")
        sys.__stdout__.flush()
        raise SystemExit(1) from None
