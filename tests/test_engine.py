"""Worker groups end to end: tensor-parallel logits, and every mode of every engine layout token for token
the target's own greedy decoding (run in this process), with stop strings, cancels, corpora and drafts
checked at start. The tests that start workers are marked slow (each start is a torchrun group of 2-3
processes)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.engines import N_TOKENS, PENALISED, PROMPTS, answer, no_processes_left, reference, start
from tiny_models import tiny_model_dir

from swiftspec import window
from swiftspec.conversation import Conversation, Reply, Settings
from swiftspec.engine.config import (
    Activations,
    ConfigError,
    Dtype,
    EngineConfig,
    KvCache,
    SamplingParams,
    TreeParams,
)
from swiftspec.engine.host.client import Engine, EngineError
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.worker.profiling import choose_d


def _tp_logits(rank: int, world: int, store_path: str, paths: list, out: dict) -> None:
    import torch.distributed as dist

    from swiftspec.engine.model.loader import load_model

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    ids = torch.arange(3, 40) % 300
    pos = torch.arange(len(ids))
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    for i, path in enumerate(paths):
        model = load_model(path, max_slots=64, tp_group=group, tp_rank=rank, tp_world=world)
        got = model(ids, pos, pos, mask)
        if rank == 0:
            ref = load_model(path, max_slots=64)(ids, pos, pos, mask)
            out[i] = float((got - ref).abs().max())
    dist.destroy_process_group()

TP_CONFIGS = [
    dict(heads=4, kv_heads=2),  # divides
    dict(heads=4, kv_heads=1),  # fewer KV heads than ranks: replicated
    dict(heads=6, kv_heads=3, hidden=96),  # KV heads do not divide: padded
    dict(arch="qwen2", heads=4, kv_heads=2),  # q/k/v biases
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tp_logits_equal_tp1(world, tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        paths = [tiny_model_dir(**kw) for kw in TP_CONFIGS]  # written here: ranks > 0 would not save
        mp.spawn(_tp_logits, args=(world, str(tmp_path / "store"), paths, out), nprocs=world)
        diffs = dict(out)
    assert len(diffs) == len(TP_CONFIGS)
    assert max(diffs.values()) <= 1e-4, diffs

ENGINES = {
    # name: (target_procs, draft); "self" = the target as its own draft (deep acceptance),
    # "other" = a different tiny model (mostly rejected)
    "1+1-self": (1, "self"),
    "1+1-suffix": (1, "suffix"),
    "1+1-int8": (1, "int8"),
    "2+1-other": (2, "other"),
    "2+1-suffix": (2, "suffix"),
    "1+1-head": (1, "head"),
}


@pytest.fixture(scope="module")
def references(target_dir):
    return [reference(target_dir, m, N_TOKENS) for m in PROMPTS]


@pytest.fixture(scope="module")
def penalised_references(target_dir, references):
    out = [reference(target_dir, m, N_TOKENS, PENALISED) for m in PROMPTS]
    assert out != references  # the penalty changes the answers
    return out


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, target_dir):
    procs, draft = ENGINES[request.param]
    eng = start(target_dir, draft, procs)
    yield eng
    eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_every_mode_equals_target_greedy_penalised(engine, penalised_references):
    """Each tree node penalised by its own path, on every layout (TP 2 included): every mode keeps the
    penalised target's greedy tokens."""
    for messages, ref in zip(PROMPTS, penalised_references, strict=True):
        for mode in ("async", "ar", "sync"):
            tokens, _, _ = answer(engine, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True,
                                  repeat_penalty=PENALISED.repeat_penalty, repeat_last_n=PENALISED.repeat_last_n,
                                  frequency_penalty=PENALISED.frequency_penalty)
            assert tokens == ref, (mode, messages)


@pytest.mark.slow
def test_every_mode_equals_target_greedy(engine, references):
    roles = [r.role for r in engine.info.ranks]
    assert roles[-1] == "draft" and set(roles[:-1]) == {"target"}
    info = engine.info
    assert info.d_auto and info.d == choose_d(info.t_verify_ms, info.t_expand_ms)
    for messages, ref in zip(PROMPTS, references, strict=True):
        for mode in ("async", "ar", "sync"):
            tokens, _, events = answer(engine, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)
            assert tokens == ref, (mode, messages)
            assert events[-1].finish_reason == "length"
            if mode != "ar":
                verified = [e.stats for e in events if e.stats.tree_size]
                assert events[-1].stats.d == engine.info.d and events[-1].stats.mean_accepted == pytest.approx(
                    sum(s.accepted + 1 for s in verified) / len(verified))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_on_the_cpu_every_mode_equals_ar(target_dir, dtype):
    """bf16 off CUDA takes the batch-invariant one-row forwards; float16 on the CPU (fp16 weights, fp32
    math) forwards whole trees, as fp32 does: sync and async give ar's tokens either way."""
    with start(target_dir, "self", dtype=dtype) as eng:
        for messages in PROMPTS:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
            for mode in ("async", "sync"):
                assert answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)[0] == ar, mode
    assert no_processes_left(eng)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, activations, label", [("int4", "int8", "int8 activations"),
                                                       ("bfloat16", "bf16", "bfloat16 weights · bf16 activations")])
def test_narrower_activations_every_mode_equals_ar(target_dir, dtype, activations, label):
    """--activations int8 (the blocks' llama.cpp width) or bf16 (bfloat16 weights on bf16 activations:
    vdpbf16ps where the CPU has it) changes what the target computes (the label says so), not that every
    mode computes it: sync and async give ar's tokens."""
    with start(target_dir, "self", dtype=dtype, activations=activations) as eng:
        assert label in eng.info.target
        for messages in PROMPTS:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
            for mode in ("async", "sync"):
                assert answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)[0] == ar, mode
    assert no_processes_left(eng)


def test_bf16_activations_on_a_target_not_stored_in_bfloat16_are_refused_before_any_process(target_dir):
    from swiftspec.engine.model.model_dir import LoadError

    started = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("swiftspec.engine.host.launcher.spawn", lambda *a, **k: started.append(a))
        with pytest.raises(LoadError, match="--activations bf16 multiplies bfloat16 weights"):
            Engine.start(EngineConfig(target=str(target_dir), activations="bf16"))  # auto: the tiny model's fp32
    assert started == []


def test_bf16_activations_need_bfloat16_weights():
    assert EngineConfig(dtype="bfloat16", activations="bf16").validate().activations is Activations.BF16
    assert EngineConfig(activations="bf16").validate().dtype is Dtype.AUTO  # a bfloat16 checkpoint's own width
    for dtype in ("float32", "float16", "gguf", "int4"):
        with pytest.raises(ConfigError, match="--activations bf16"):
            EngineConfig(dtype=dtype, activations="bf16").validate()


def test_the_kv_cache_setting_is_one_of_its_words():
    assert EngineConfig(kv_cache="float32").validate().kv_cache is KvCache.FLOAT32
    with pytest.raises(ConfigError, match="kv-cache"):
        EngineConfig(kv_cache="int8").validate()


def test_int8_activations_need_integer_blocks():
    with pytest.raises(ConfigError, match="--activations int8"):
        EngineConfig(dtype="float32", activations="int8").validate()
    with pytest.raises(ConfigError, match="activations"):
        EngineConfig(activations="int4").validate()


@pytest.mark.slow
def test_step_times_are_measured_once_then_read_from_the_profile_cache(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_CACHE", str(tmp_path))  # the workers inherit it
    said: list[str] = []
    first = start(target_dir, "self", progress=said.append)
    first.close()
    assert any(line.startswith("profiling") for line in said)
    assert "CPU backend float32 (the checkpoint's own width)" in said  # one candidate: nothing to measure
    more_cores = len(os.sched_getaffinity(0)) > 1  # the target's share is one core less than the machine's
    assert ("measuring the CPU kernels' threads" in said) == more_cores
    (threads,) = [line for line in said if line.startswith("CPU kernel threads: ")] or [None]
    (profile,) = (tmp_path / "profiles").glob("*.json")
    stored = json.loads(profile.read_text())
    assert stored["t_verify_ms"] == first.info.t_verify_ms and stored["t_expand_ms"] == first.info.t_expand_ms
    # figures no measurement would give: the next start must take them from the file, d and tree sizes too
    profile.write_text(json.dumps({"t_verify_ms": 50.0, "t_expand_ms": 10.0, "verify_cost": [1.0] + [99.0] * 7}))
    said.clear()
    with start(target_dir, "self", progress=said.append) as eng:
        assert "step times from the profile cache" in said
        assert any(line.startswith("CPU backend ") for line in said)
        assert "measuring the CPU kernels' threads" not in said and threads in (said if more_cores else [None])
        assert (eng.info.t_verify_ms, eng.info.t_expand_ms, eng.info.d) == (50.0, 10.0, choose_d(50.0, 10.0))
        _, _, events = answer(eng, PROMPTS[0], mode="sync", max_new_tokens=16, ignore_eos=True)
        assert {e.stats.tree_size for e in events if e.stats.tree_size} == {1}  # 2+ nodes "cost" 99 steps
    said.clear()
    with start(target_dir, "self", progress=said.append, tree=TreeParams(bs=4)):  # another setting: measured
        assert any(line.startswith("profiling") for line in said)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2


@pytest.fixture(scope="module")
def self_engine(target_dir):
    """The target drafting for itself, 4 expansions a round whatever the machine's timings: no cost policy,
    which sits rounds out on a busy machine (1.04 tokens a round in a full run on a 2-core Zen 4)."""
    eng = start(target_dir, "self", max_seq_len=2048, tree=TreeParams(d=4), verify_cost=False)
    yield eng
    eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_self_draft_accepts_deep_paths(self_engine, references):
    tokens, _, events = answer(self_engine, PROMPTS[0], mode="async", max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]
    # a perfect draft, d fixed
    assert self_engine.info.d == 4 and not self_engine.info.d_auto
    assert events[-1].stats.mean_accepted > 2.5


@pytest.mark.slow
def test_stop_strings_eos_and_multi_turn_reuse(self_engine):
    messages = PROMPTS[1]
    ref, text, _ = answer(self_engine, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _, cut, events = answer(self_engine, messages, mode="async", max_new_tokens=N_TOKENS, ignore_eos=True,
                            stop=[stop])
    assert events[-1].finish_reason == "stop" and cut == text[:text.index(stop)]
    tokens, _, events = answer(self_engine, messages, mode="async", max_new_tokens=N_TOKENS)
    if 2 in ref:  # the tiny models' EOS ends the answer, and is its last token
        assert events[-1].finish_reason == "eos" and tokens == ref[:ref.index(2) + 1]
    else:
        assert events[-1].finish_reason == "length" and tokens == ref
    # a follow-up turn prefills only what is new since the committed conversation
    follow = messages + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Again."}]
    first, second = (encode_chat(self_engine.tokenizer, m) for m in (messages, follow))
    assert second[:len(first)] == first
    _, _, events = answer(self_engine, follow, mode="async", max_new_tokens=4)
    assert events[0].stats.prefill_tokens <= len(second) - len(first)


@pytest.mark.slow
def test_a_turn_is_templated_once(self_engine, monkeypatch):
    """The chat fits a turn into the context (its window), then sends the ids it fitted: one template pass."""
    calls = []
    template = self_engine.tokenizer.apply_chat_template
    monkeypatch.setattr(self_engine.tokenizer, "apply_chat_template",
                        lambda *a, **k: (calls.append(1), template(*a, **k))[1])
    conversation = Conversation(None, Settings("Be brief.", SamplingParams(mode="ar", max_new_tokens=2)))
    reply = conversation.run(Reply(conversation.plan("ask", window.Context.of(self_engine), "Once?")), self_engine)
    assert len(calls) == 1 and reply.error is None and reply.last.stats.prefill_tokens <= len(reply.plan.ids)


@pytest.mark.slow
def test_cancel_then_generate_again(self_engine, references):
    gen = self_engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(gen)
    threading.Thread(target=self_engine.cancel).start()
    events = list(gen)
    assert events[-1].finish_reason == "cancelled" and sum(len(e.token_ids) for e in events) < 1999
    tokens, _, _ = answer(self_engine, PROMPTS[0], max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]
    gen = self_engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    next(gen)
    del gen  # abandoning an answer cancels it
    tokens, _, _ = answer(self_engine, PROMPTS[0], mode="sync", max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]


@pytest.mark.slow
def test_ctrl_c_cancels_and_the_engine_stays_usable(self_engine, references):
    streaming = threading.Event()  # Ctrl-C once tokens flow: mid-answer however fast the engine is

    def ctrl_c():
        streaming.wait(60)
        os.kill(os.getpid(), signal.SIGINT)

    # A shell's background job starts with SIGINT ignored and Python keeps it so: put back the handler a
    # terminal gives, or the Ctrl-C would be dropped.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupter.start()
            for _ in self_engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=2000, ignore_eos=True,
                                                                     mode="ar")):
                streaming.set()
        interrupter.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert self_engine.alive
    tokens, _, _ = answer(self_engine, PROMPTS[0], max_new_tokens=N_TOKENS, ignore_eos=True)
    assert tokens == references[0]


@pytest.mark.slow
def test_an_engine_without_draft_runs_the_target_alone(target_dir, references):
    with start(target_dir, "none") as eng:
        assert [r.role for r in eng.info.ranks] == ["target"] and eng.info.draft == "none"
        assert answer(eng, PROMPTS[0], mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)[0] == references[0]
        with pytest.raises(EngineError, match="without one"):
            eng.generate(PROMPTS[0], SamplingParams(mode="sync"))
    assert no_processes_left(eng)


@pytest.mark.slow
def test_over_long_prompt_is_refused_before_sending(self_engine):
    with pytest.raises(EngineError, match="context length"):
        self_engine.generate([{"role": "user", "content": "speculative decoding " * 2000}])


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["draft", "target"])
def test_killed_rank_fails_fast_and_leaves_no_process(victim, target_dir):
    eng = start(target_dir, "suffix", max_seq_len=4096)
    try:
        pid = next(r.pid for r in eng.info.ranks if r.role == victim)
        gen = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=4000, ignore_eos=True))
        next(gen)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as failure:
            for _ in gen:
                pass
        assert time.monotonic() - t0 < 10
        # in words, which worker and how, then where the workers' whole output is; no torchrun log lines
        rank = next(r.rank for r in eng.info.ranks if r.role == victim)
        first, *rest = str(failure.value).splitlines()
        assert first == f"the {victim} worker (rank {rank}) was killed by signal 9 (SIGKILL)", str(failure.value)
        log = Path(rest[-1].removeprefix("the workers' full output: "))
        assert "exitcode" in log.read_text() and not any("exitcode" in line for line in rest)
        log.unlink()  # kept for the user after a failure; not for the tests' own
        assert no_processes_left(eng, within_s=10 - (time.monotonic() - t0))
        with pytest.raises(EngineError):
            answer(eng, PROMPTS[0], max_new_tokens=4)
    finally:
        eng.close()
    assert no_processes_left(eng)


@pytest.mark.slow
def test_worker_start_up_failure_carries_the_cause(tmp_path, target_dir):
    """A draft whose weights do not fit its config passes the start-up checks and fails in its worker: the
    error names that worker, the worker's own exception, and the log of everything the workers wrote."""
    bad = tmp_path / "wrong-shapes"
    shutil.copytree(target_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(EngineError) as failure:
        start(target_dir, str(bad))
    message = str(failure.value)
    assert message.startswith("the draft worker (rank 1) exited with code 1 during start-up"), message
    assert "LoadError" in message and "weights do not match the config" in message
    log = Path(message.splitlines()[-1].removeprefix("the workers' full output: "))
    assert "Traceback" in log.read_text()
    log.unlink()


def _corpus(path: Path, model_dir: Path, sequences: list[tuple[list[int], int]] | None = None) -> Path:
    from swiftspec.engine.model.model_dir import load_tokenizer
    from swiftspec.engine.spec.corpus import save_corpus

    save_corpus(path, sequences or [([1, 2, 3, 4], 2)], load_tokenizer(Path(model_dir)))
    return path


@pytest.mark.slow
def test_a_corpus_of_the_targets_answers_drafts_them_and_every_mode_stays_exact(target_dir, references, tmp_path):
    """The suffix drafter with a corpus of the target's own answers to these prompts (session history off:
    an earlier mode's answer must not be what drafts): the first round of each answer, which has nothing
    of its own to copy yet, is drafted from the corpus and accepted; the tokens are ar's. The rounds draft
    3 expansions whatever the machine's timings (no cost policy, which may sit rounds out on a busy one)."""
    from swiftspec.engine.model.model_dir import load_tokenizer

    tok = load_tokenizer(Path(target_dir))
    prompts = [encode_chat(tok, m) for m in PROMPTS]
    corpus = _corpus(tmp_path / "answers.safetensors", target_dir,
                     [(p + ref, len(p)) for p, ref in zip(prompts, references, strict=True)])
    with start(target_dir, "suffix", draft_corpus=str(corpus), draft_history=False, tree=TreeParams(d=3),
               verify_cost=False) as eng:
        assert eng.info.draft == "suffix + corpus answers"
        for messages, ref in zip(PROMPTS, references, strict=True):
            for mode in ("sync", "async"):
                tokens, _, events = answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)
                assert tokens == ref, mode
                rounds = [e.stats for e in events if e.stats.tree_size]
                assert rounds[0].accepted >= 1, mode
                assert sum(s.accepted + 1 for s in rounds) / len(rounds) >= 1.5, mode
    assert no_processes_left(eng)


def test_a_bad_draft_corpus_is_refused_at_start(target_dir, tmp_path):
    from swiftspec.engine.model.model_dir import LoadError

    with pytest.raises(ConfigError, match="suffix drafter"):
        start(target_dir, "int8", draft_corpus=str(tmp_path / "answers.safetensors"))
    with pytest.raises(LoadError, match="not a file"):
        start(target_dir, draft_corpus=str(tmp_path / "missing.safetensors"))
    other = _corpus(tmp_path / "other.safetensors", tiny_model_dir(vocab=320))
    with pytest.raises(LoadError, match="another tokenizer"):
        start(target_dir, draft_corpus=str(other))
    with pytest.raises(LoadError, match="not a SwiftSpec draft corpus"):
        start(target_dir, draft_corpus=str(Path(target_dir) / "model.safetensors"))


def test_draft_with_another_vocabulary_is_refused_at_start(target_dir):
    from swiftspec.engine.spec.drafters import VocabMismatch

    with pytest.raises(VocabMismatch, match="tokenizer"):
        start(target_dir, str(tiny_model_dir(vocab=320)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft", ["self", "suffix"])
def test_cuda_async_equals_ar(target_dir, draft, dtype):
    """One GPU: gloo for control, a model draft shares GPU 0 with the target, the suffix drafter's rank
    stays on the CPU; bit-exact in bf16 too (the batch-invariant kernels)."""
    with start(target_dir, draft, device="cuda", dtype=dtype) as eng:
        assert eng.info.backend == "gloo" and eng.info.ranks[0].device == "cuda:0"  # one target rank: no NCCL
        for messages in PROMPTS:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)
            for mode in ("async", "sync"):
                assert answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)[0] == ar
    assert no_processes_left(eng)


@pytest.mark.slow
def test_embedded_model_async_equals_ar():
    with Engine.start(EngineConfig()) as eng:
        assert eng.info.draft == "suffix + corpus smollm2-135m-instruct"  # the shipped corpus, by default
        for messages in PROMPTS[:2]:
            ar, _, _ = answer(eng, messages, mode="ar", max_new_tokens=32)
            for mode in ("async", "sync"):
                tokens, _, _ = answer(eng, messages, mode=mode, max_new_tokens=32)
                assert tokens == ar, mode
    assert no_processes_left(eng)


@pytest.mark.slow
def test_workers_started_as_programs_answer_as_forked_ones(target_dir, monkeypatch):
    """On GPUs torchrun starts the workers as programs (it never forks there), on the CPU it forks them:
    the program path, run here on the CPU, answers the same, and ends every process."""
    from swiftspec.engine.host import launcher
    from swiftspec.engine.worker.torchrun import WORKER_NAME

    expected = reference(target_dir, PROMPTS[0], 16)
    build = launcher.build_command
    monkeypatch.setattr(launcher, "build_command", lambda *a, **kw: build(*a, **{**kw, "cuda": True}))
    with start(target_dir) as eng:
        assert answer(eng, PROMPTS[0], max_new_tokens=16, mode="async")[0] == expected
        names = {Path(f"/proc/{r.pid}/comm").read_text().strip() for r in eng.info.ranks}
    assert not any(n.startswith(WORKER_NAME) for n in names)  # programs, not forks
    assert no_processes_left(eng)
