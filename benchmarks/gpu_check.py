"""The GPU acceptance run (scripts/gpu_check.sh): one process, a time budget, one JSON report.

Steps, in order, each skipped when the budget left is below its estimate (the report says so):

1. tests   — the ``gpu``-marked tests (kernels bit-exact and row-invariant, CUDA graphs, the engine on one
             GPU in fp32 and bf16).
2. engine  — the engine end to end on one GPU with random-weight models built here from real configs
             (a Llama-3.2-1B-shaped target, a 2-layer draft of the same width and vocabulary): ``ar``,
             ``sync`` and ``async`` with a model draft and the suffix drafter, greedy, bf16; outputs
             must be identical; tokens/s per mode.
3. decode  — a Llama-3.1-8B-shaped target (random bf16 weights, our model code, CUDA graphs) behind a
             1k-token prefix: the step time and its share of HBM bandwidth ((weights + KV read) / time /
             peak), the verification cost of n = 1..64 nodes relative to one step, graphs on vs off, and
             all of it with the batch-invariant kernels and with cuBLAS (their cost).
4. attention — Triton tree attention (plain and batch-invariant) vs torch SDPA at 1k and 8k prefixes.
5. rounds  — the 1B-shaped target as the engine runs it (batch-invariant, graphed): the host<->device
             transfers each verification round makes (engine/spec/transfers.py's counter; greedy, penalised
             and sampled), the kernels a decode step launches per layer (six a layer's own in the
             batch-invariant mode, plus the forward's embedding, mask, final norm and lm_head spread over
             the layers), the graphed step's rate, and the engine's ``ar`` tokens/s (from the engine
             step) as a share of it.

``--dry-run`` runs everything that needs no CUDA on the CPU with the configs scaled down (the tests
step and Triton are skipped): the script's own test.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models.make_tokenizer: a real tokenizer of any vocabulary

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CONFIGS = {  # the config.json fields of the real models; weights are random
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
                         tie_word_embeddings=True),
}
PROMPTS = ["Why is the sky blue?", "Write a short poem about the sea.", "What is 17 times 23?"]


def scaled(cfg: dict, dry: bool, **over) -> dict:
    """The config as it is, or shrunk for a CPU dry run (same structure: GQA, RoPE scaling, tying)."""
    cfg = {**cfg, **over}
    if not dry:
        return cfg
    return {**cfg, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": min(2, cfg["num_hidden_layers"]),
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 2048}


class Report:
    """Results by step, written to the JSON file after every step (so a killed run still leaves them)."""

    def __init__(self, path: Path, budget_s: float):
        self.path, self.budget_s, self.t0 = path, budget_s, time.monotonic()
        self.data: dict = {"device": _device_name(), "torch": torch.__version__, "budget_s": budget_s, "steps": {}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def run(self, name: str, estimate_s: float, fn: Callable[[], dict]) -> None:
        if self.left() < estimate_s:
            self.data["steps"][name] = {"status": f"skipped: {self.left():.0f} s left, needs ~{estimate_s:.0f} s"}
        else:
            t0 = time.monotonic()
            try:
                result = {"status": "ok", **fn()}
            except Exception as e:  # one step's failure must not lose the others' figures
                result = {"status": f"error: {type(e).__name__}: {e}"}
            result["seconds"] = round(time.monotonic() - t0, 1)
            self.data["steps"][name] = result
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"gpu_check [{name}] {json.dumps(self.data['steps'][name])}", flush=True)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_test_files() -> list[str]:
    """The test modules that hold gpu-marked tests. Collecting only these keeps the run clear of what the
    rest of the suite imports and a GPU image may lack (the openai client, say)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def step_tests(report: Report) -> dict:
    """The gpu-marked tests, in a child pytest that must end within the budget left."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *gpu_test_files()]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30, report.left() - 200))
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if proc.returncode not in (0, 5):
        print(proc.stdout[-6000:], proc.stderr[-2000:], flush=True)
    return {"summary": tail[0], "failed": failed, "passed": proc.returncode == 0}


def save_random_model(cfg: dict, path: Path, tokenizer) -> Path:
    """A Hugging Face LlamaForCausalLM with random bf16 weights (transformers' own init) and the
    tokenizer, written as the loader reads them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def step_engine(dry: bool, workdir: Path, new_tokens: int) -> dict:
    from tiny_models import make_tokenizer

    from swiftspec.engine.config import EngineConfig, SamplingParams
    from swiftspec.engine.host.client import Engine

    target_cfg = scaled(CONFIGS["llama-3.2-1b"], dry)
    tokenizer = make_tokenizer(target_cfg["vocab_size"])
    target = save_random_model(target_cfg, workdir / "target", tokenizer)
    draft = save_random_model(scaled(CONFIGS["llama-3.2-1b"], dry, num_hidden_layers=2), workdir / "draft", tokenizer)
    device = "cpu" if dry else "cuda"
    out: dict = {"target": "llama-3.2-1b shape" + (" (scaled)" if dry else ""), "new_tokens": new_tokens}
    for name, drafter in (("model-draft", str(draft)), ("suffix", "suffix")):
        # No draft history: the suffix drafter must not learn an answer from the modes run before it.
        config = EngineConfig(target=str(target), draft=drafter, device=device, dtype="bfloat16", max_seq_len=1024,
                              draft_history=False)
        t0 = time.monotonic()
        with Engine.start(config) as eng:
            res: dict = {"start_s": round(time.monotonic() - t0, 1), "d": eng.info.d,
                         "devices": [r.device for r in eng.info.ranks], "identical": True, "tok_s": {}, "accepted": {}}
            totals = {m: [0, 0.0, 0.0] for m in ("ar", "sync", "async")}
            for prompt in PROMPTS:
                ref = None
                for mode in ("ar", "sync", "async"):
                    t = time.monotonic()
                    events = list(eng.generate([{"role": "user", "content": prompt}],
                                               SamplingParams(max_new_tokens=new_tokens, mode=mode, ignore_eos=True)))
                    secs = time.monotonic() - t
                    tokens = [tok for e in events for tok in e.token_ids]
                    ref = tokens if ref is None else ref
                    res["identical"] &= tokens == ref
                    totals[mode][0] += len(tokens)
                    totals[mode][1] += secs
                    totals[mode][2] += events[-1].stats.mean_accepted
            for mode, (n, secs, acc) in totals.items():
                res["tok_s"][mode] = round(n / secs, 1)
                res["accepted"][mode] = round(acc / len(PROMPTS), 2)
        out[name] = res
    out["identical"] = all(out[k]["identical"] for k in ("model-draft", "suffix"))
    return out


def random_transformer(cfg: dict, device: str, invariant: bool, slots: int):
    """Our Transformer (CUDA graphs on a GPU) with random bf16 weights drawn on the device."""
    from swiftspec.engine.model.cuda_graphs import GraphedModel
    from swiftspec.engine.model.model_args import ModelArgs
    from swiftspec.engine.model.transformer import Transformer

    args = ModelArgs.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.eval()
    if invariant:
        model.make_batch_invariant()
    if device == "cuda":
        graphed = GraphedModel(model)
        graphed.setup_cache(slots)
        return graphed, model
    model.setup_cache(slots)
    return model, model


def timed(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median seconds of fn (after warm-up), CUDA-event timed on a GPU."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def chain(n: int, prefix: int, device: str) -> tuple[torch.Tensor, ...]:
    """Inputs of an n-node verification (a chain, which is a tree) behind ``prefix`` cached tokens."""
    from swiftspec.engine.spec.tree import target_inputs

    positions, slots, mask = target_inputs(list(range(-1, n - 1)), prefix)
    tokens = torch.randint(0, 1000, (n,))
    return tuple(t.to(device) for t in (tokens, positions, slots, mask))


def step_decode(dry: bool, prefix: int, iters: int, peak_bw: float) -> dict:
    """The 8B-shaped target: step time, HBM share, verification cost by n, graphs on/off; with the
    batch-invariant kernels and with the plain ones (cuBLAS linears, the split attention)."""
    from swiftspec.engine.spec.tree_cache import prefill_forward

    cfg = scaled(CONFIGS["llama-3.1-8b"], dry)
    device = "cpu" if dry else "cuda"
    out: dict = {"model": "llama-3.1-8b shape" + (" (scaled)" if dry else ""), "prefix": prefix}
    for kernels in ("batch-invariant", "plain"):
        model, plain = random_transformer(cfg, device, kernels == "batch-invariant", prefix + 128)
        weights = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if "tok_embeddings" not in n)
        if plain.args.tie_embeddings:
            weights += plain.output.weight.numel() * plain.output.weight.element_size()
        prefill_forward(plain, torch.randint(0, 1000, (prefix,)).tolist(), 0, logits=False)
        a = plain.args
        kv = 2 * a.n_layers * a.n_kv_heads * (prefix + 1) * a.head_dim * 2
        res: dict = {"weights_gb": round(weights / 1e9, 2), "verify_ms": {}}
        for n in (1, 2, 4, 8, 16, 32, 64):
            inputs = chain(n, prefix, device)
            res["verify_ms"][n] = round(timed(partial(model, *inputs), iters, not dry) * 1e3, 3)
        step = res["verify_ms"][1] / 1e3
        res["step_ms"] = res["verify_ms"][1]
        res["hbm_share"] = round((weights + kv) / step / peak_bw, 3)
        res["verify_cost"] = {n: round(ms / res["step_ms"], 2) for n, ms in res["verify_ms"].items()}
        if not dry:  # the same forwards without graphs: what launching from Python costs
            res["eager_ms"] = {}
            for n in (1, 8):
                inputs = chain(n, prefix, device)
                res["eager_ms"][n] = round(timed(partial(plain, *inputs), max(5, iters // 4), True) * 1e3, 3)
        out[kernels] = res
        model = plain = None  # hand the weights back before the next copy
        if not dry:
            torch.cuda.empty_cache()
    out["invariant_cost"] = round(out["batch-invariant"]["step_ms"] / out["plain"]["step_ms"], 2)
    return out


def step_attention(dry: bool, iters: int) -> dict:
    """Tree attention of the 8B shape (32 q heads, 8 kv heads, d 128) for 1 and 8 new tokens."""
    device = "cpu" if dry else "cuda"
    H, Hkv, D = (4, 2, 32) if dry else (32, 8, 128)
    ops = importlib.import_module("swiftspec.kernels." + ("reference" if dry else "triton_kernels"))
    out: dict = {}
    for prefix in (1024, 8192):
        for T in (1, 8):
            S = prefix + T
            q = torch.randn(T, H, D, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(Hkv, S, D, device=device, dtype=torch.bfloat16) for _ in range(2))
            _, _, _, mask = chain(T, prefix, device)
            row = {}
            for name, invariant in (("triton" if not dry else "reference", False), ("invariant", True)):
                prepared = ops.prepare_mask(mask, H // Hkv, q.dtype, invariant)
                row[name] = round(timed(partial(ops.tree_attention, q, k, v, prepared), iters, not dry) * 1e6, 1)
            sdpa = partial(F.scaled_dot_product_attention, q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                           enable_gqa=True)
            row["sdpa"] = round(timed(sdpa, iters, not dry) * 1e6, 1)
            out[f"prefix {prefix}, {T} token(s), us"] = row
    return out


def step_rounds(dry: bool, prefix: int, iters: int, engine: dict) -> dict:
    """Transfers per verification round (a 4-node tree, TargetState.verify as the engine calls it),
    launches per layer of a one-token step, the graphed step's rate and the engine's ar rate beside it."""
    from swiftspec.engine.config import SamplingParams
    from swiftspec.engine.spec.decode import TargetState
    from swiftspec.engine.spec.sampling import Sampler
    from swiftspec.engine.spec.transfers import TransferCounter

    cfg = scaled(CONFIGS["llama-3.2-1b"], dry)
    device = "cpu" if dry else "cuda"
    # A dry run keeps torch's kernels: the CPU's batch-invariant fallback (one-row forwards) reads the mask.
    model, plain = random_transformer(cfg, device, not dry, prefix + 256)
    out: dict = {"model": "llama-3.2-1b shape" + (" (scaled)" if dry else ""), "transfers_per_round": {}}
    settings = {"greedy": SamplingParams(), "penalised": SamplingParams(repeat_penalty=1.1, repeat_last_n=64),
                "sampled": SamplingParams(temperature=0.7, min_p=0.05, seed=1)}
    prompt = torch.randint(3, 1000, (prefix,)).tolist()
    for name, params in settings.items():
        target = TargetState(model, model.max_slots)
        sampler = Sampler(params, target.device)
        root = target.prefill(prompt, sampler)
        counts = []
        for _ in range(8):
            with TransferCounter() as counter:
                root = target.verify([root, 5, 6, 7], [-1, 0, 1, 0], sampler).path[-1]
            counts.append((counter.up, counter.down, dict(counter.calls)))
        worst = counts[1:]  # the first round may grow the staging buffers
        out["transfers_per_round"][name] = {"up": max(c[0] for c in worst), "down": max(c[1] for c in worst),
                                            "calls": counts[-1][2]}
    inputs = chain(1, prefix, device)
    out["step_ms"] = round(timed(partial(model, *inputs), iters, not dry) * 1e3, 3)
    out["step_tok_s"] = round(1e3 / out["step_ms"], 1)
    out["launches_per_layer"] = round(launches(plain, inputs, dry) / plain.args.n_layers, 1)
    ar = engine.get("suffix", {}).get("tok_s", {}).get("ar")
    if ar:
        out["engine_ar_tok_s"] = ar
        out["engine_ar_share_of_step"] = round(ar / out["step_tok_s"], 3)
    return out


def launches(model, inputs: tuple[torch.Tensor, ...], dry: bool) -> int:
    """Kernels one eager forward launches (CUDA, from the profiler); on the CPU, the aten ops it runs."""
    from torch.profiler import ProfilerActivity, profile

    model(*inputs)  # warm-up: Triton compiles outside the profile
    activities = [ProfilerActivity.CPU] if dry else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        model(*inputs)
        if not dry:
            torch.cuda.synchronize()
    if dry:
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def print_table(data: dict) -> None:
    print(f"\ngpu_check on {data['device']} (torch {data['torch']}), {data['elapsed_s']} s of {data['budget_s']} s")
    for name, res in data["steps"].items():
        print(f"  {name:<10} {res.get('status')} ({res.get('seconds', 0)} s)")
        for key, value in res.items():
            if key not in ("status", "seconds"):
                print(f"      {key}: {json.dumps(value)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, scaled-down configs, no CUDA-only step")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (stops cleanly)")
    p.add_argument("--report", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="HBM bytes/s (H200 4.8e12, H100 SXM 3.35e12)")
    p.add_argument("--prefix", type=int, default=1024, help="cached tokens in the decode-step measurements")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per answer in the engine step")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch (use --dry-run on a CPU)")
    report = Report(args.report, args.budget)
    dry = args.dry_run
    if dry:
        report.data["steps"]["tests"] = {"status": "skipped: dry run (the gpu-marked tests need CUDA)"}
    else:
        report.run("tests", 150, lambda: step_tests(report))
    with tempfile.TemporaryDirectory(prefix="swiftspec-gpu-check-") as tmp:
        report.run("engine", 90, lambda: step_engine(dry, Path(tmp), 16 if dry else args.new_tokens))
    report.run("decode", 60, lambda: step_decode(dry, 64 if dry else args.prefix, 3 if dry else args.iters, args.peak_bw))
    report.run("attention", 20, lambda: step_attention(dry, 3 if dry else args.iters))
    engine = report.data["steps"].get("engine", {})
    report.run("rounds", 40, lambda: step_rounds(dry, 64 if dry else args.prefix, 3 if dry else args.iters, engine))
    print_table(report.data)
    print(f"gpu_check: report written to {args.report}")
    ok = all(r["status"].startswith(("ok", "skipped")) for r in report.data["steps"].values())
    ok &= report.data["steps"].get("tests", {}).get("passed", True) is not False
    ok &= report.data["steps"].get("engine", {}).get("identical", True) is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
