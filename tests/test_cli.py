"""The command line: flags, help, exit codes, scripted mode through `chat` (FakeEngine in-process, and a
few real subprocess runs against the real engine on a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_engine import ANSWER, FakeEngine
from helpers.cli import invoke

from swiftspec import cli
from swiftspec.cli import chat as cli_chat
from swiftspec.engine.config import EngineConfig, SamplingParams
from swiftspec.history import HistoryStore
from swiftspec.settings import CHAT_DEFAULTS


def test_model_flag_names_and_positional_prompt(fake, data_dir, monkeypatch, tmp_path):
    seen = []
    generate = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: seen.append(m) or generate(self, m, p))
    for flag in ("-m", "--model", "--target"):
        assert invoke(["chat", flag, str(tmp_path), "Why is the sky blue?"]).exit_code == 0
    assert [c.target for c in fake] == [str(tmp_path)] * 3
    assert [m[-1]["content"] for m in seen] == ["Why is the sky blue?"] * 3
    both = invoke(["chat", "one", "-p", "two"])
    assert both.exit_code == 2 and both.stderr.startswith("swiftspec: -p: given with a PROMPT argument too; ")


def test_version_short_and_long():
    for flag in ("-V", "--version"):
        result = invoke([flag])
        assert result.exit_code == 0 and result.stdout.startswith("swiftspec 0.")


def test_layout_flags_reach_the_engine_config(fake, data_dir, tmp_path):
    result = invoke(["chat", "-p", "hi", "--target-devices", "0,1", "--draft-devices", "2", "--bs", "16",
                     "--w", "4", "--d", "3", "--max-seq-len", "2048", "--draft", str(tmp_path), "--threads", "2"])
    assert result.exit_code == 0, result.output
    config = fake[0]
    assert (config.target_devices, config.draft_devices, config.draft) == ([0, 1], [2], str(tmp_path))
    assert (config.tree.bs, config.tree.w, config.tree.d, config.max_seq_len, config.threads) == (16, 4, 3, 2048, 2)
    assert config.verify_cost  # EngineConfig's default
    assert invoke(["chat", "-p", "hi", "--no-verify-cost"]).exit_code == 0 and not fake[-1].verify_cost


def test_the_draft_corpus_flag_goes_with_the_suffix_drafter(fake, data_dir):
    assert invoke(["chat", "-p", "hi", "--draft-corpus", "/c/answers.safetensors"]).exit_code == 0
    assert fake[-1].draft_corpus == "/c/answers.safetensors" and EngineConfig().draft_corpus == "auto"
    result = invoke(["chat", "-p", "hi", "--draft", "int8", "--draft-corpus", "/c/answers.safetensors"])
    assert result.exit_code == 2 and "--draft suffix" in result.output and len(fake) == 1
    assert invoke(["chat", "-p", "hi", "--mode", "ar", "--draft-corpus", "/c/answers.safetensors"]).exit_code == 0
    assert (fake[-1].draft, fake[-1].draft_corpus) == ("none", "none")  # ar starts no draft, so no corpus


def test_sampling_flags_reach_the_engine(fake, data_dir, monkeypatch):
    seen = []
    generate = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: seen.append(p) or generate(self, m, p))
    result = invoke(["chat", "-p", "hi", "--mode", "sync", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40",
                     "--seed", "7", "--max-new-tokens", "5", "--stop", "END", "--stop", "###"])
    assert result.exit_code == 0, result.output
    p = seen[0]
    assert (p.mode, p.temperature, p.top_p, p.top_k, p.seed, p.max_new_tokens, p.stop) == (
        "sync", 0.8, 0.9, 40, 7, 5, ["END", "###"])
    result = invoke(["chat", "-p", "hi", "--min-p", "0.1", "--repeat-penalty", "1.2", "--repeat-last-n", "32",
                     "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--loop-guard", "40",
                     "--loop-repeats", "4", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    p = seen[1]
    assert (p.min_p, p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty, p.loop_guard,
            p.loop_repeats, p.temperature) == (0.1, 1.2, 32, 0.5, -0.5, 40, 4, 0.0)


def test_chat_sampling_defaults_come_from_the_model(fake, data_dir, monkeypatch, tmp_path):
    """The embedded default and GGUF files: the measured chat defaults, which --help states; a model
    directory: its generation_config.json as transformers reads it (greedy unless do_sample, its own
    defaults for what the file leaves out); a flag wins over both; a broken file is a usage error."""
    seen = []
    generate = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: seen.append(p) or generate(self, m, p))
    assert invoke(["chat", "-p", "hi"]).exit_code == 0
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert invoke(["chat", "-p", "hi", "-m", str(tmp_path / "x.gguf")]).exit_code == 0
    defaults = {f: getattr(CHAT_DEFAULTS, f) for f in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                                       "repeat_last_n", "loop_guard", "loop_repeats")}
    for p in seen:
        assert {f: getattr(p, f) for f in defaults} == defaults
    assert CHAT_DEFAULTS.summary() in " ".join(invoke(["chat", "--help"]).output.split())
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05, "eos_token_id": 2}))
    assert invoke(["chat", "-p", "hi", "-m", str(model)]).exit_code == 0
    p = seen[-1]
    assert (p.temperature, p.top_p, p.top_k, p.repeat_penalty, p.min_p) == (0.6, 0.9, 50, 1.05, 0.0)
    assert (p.loop_guard, p.repeat_last_n) == (CHAT_DEFAULTS.loop_guard, CHAT_DEFAULTS.repeat_last_n)
    assert invoke(["chat", "-p", "hi", "-m", str(model), "--top-k", "5", "--temperature", "1"]).exit_code == 0
    assert (seen[-1].top_k, seen[-1].temperature, seen[-1].top_p) == (5, 1.0, 0.9)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "repetition_penalty": 1.2}))
    assert invoke(["chat", "-p", "hi", "-m", str(model)]).exit_code == 0
    assert (seen[-1].temperature, seen[-1].repeat_penalty) == (0.0, 1.2)  # no do_sample: greedy, penalised
    for text, message in (("{", "cannot read"), ('{"do_sample": true, "top_p": 7}', "top-p must be a number in (0, 1]")):
        (model / "generation_config.json").write_text(text)
        result = invoke(["chat", "-p", "hi", "-m", str(model)])
        assert result.exit_code == 2 and message in result.stderr and "generation_config.json" in result.stderr


def test_piped_stdin_answers_on_stdout(fake, data_dir):
    result = invoke(["chat"], b"hello\n")
    assert result.exit_code == 0
    assert result.stdout == ANSWER + "\n"
    assert "tok/s" in result.stderr and "loading target" in result.stderr


def test_jsonl_each_line(fake, data_dir):
    result = invoke(["chat", "--jsonl", "--each-line", "--max-new-tokens", "2"], b"one\ntwo\n")
    assert result.exit_code == 0
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["index"] for e in events if e["event"] == "done"] == [0, 1]
    assert all(e["finish_reason"] == "length" for e in events if e["event"] == "done")


@pytest.mark.parametrize("stdin, message", [(b"", "empty input"), (b"\xff\xfe\x00", "not valid UTF-8")])
def test_bad_input_exit_2(stdin, message, fake, data_dir):
    result = invoke(["chat"], stdin)
    assert result.exit_code == 2 and message in result.stderr
    assert not fake


def test_engine_start_failure_exit_1(monkeypatch, data_dir):
    from swiftspec.engine.host.client import EngineError

    def start(config, progress):
        raise EngineError("the workers exited (torchrun exit code 1)")

    monkeypatch.setattr(cli_chat, "_start_engine", start)
    result = invoke(["chat", "-p", "hi"])
    assert result.exit_code == 1 and "torchrun exit code 1" in result.stderr


def test_resume_in_scripted_mode_uses_the_saved_conversation(fake, data_dir, monkeypatch):
    store = HistoryStore()
    old = store.create("old", system="Be terse.")
    store.add(old, "user", "my name is Ada")
    store.add(old, "assistant", "hello Ada")
    generate = FakeEngine.generate
    calls = []
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: calls.append(m) or generate(self, m, p))
    assert invoke(["chat", "-p", "what is my name?", "--resume"]).exit_code == 0
    assert [m["content"] for m in calls[0]] == ["Be terse.", "my name is Ada", "hello Ada", "what is my name?"]
    saved = HistoryStore().messages(old)  # the new turn is appended to the resumed conversation
    assert [(m.role, m.content) for m in saved[2:]] == [("user", "what is my name?"), ("assistant", ANSWER)]
    assert saved[3].stats["finish_reason"] == "eos"
    assert invoke(["chat", "-p", "x", "--resume", "999"]).exit_code == 2


def test_normalise_argv():
    assert cli.normalise_argv(["chat", "--resume"]) == ["chat", "--resume", "latest"]
    assert cli.normalise_argv(["chat", "--resume", "--mode", "ar"]) == ["chat", "--resume", "latest", "--mode", "ar"]
    assert cli.normalise_argv(["chat", "--resume", "7"]) == ["chat", "--resume", "7"]


def test_python_dash_m_help():
    result = subprocess.run([sys.executable, "-m", "swiftspec", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("swiftspec ")


# --- the real engine, in a subprocess, on a tiny random model ---------------------------------------------

def swiftspec(args, stdin: bytes, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWIFTSPEC_DATA_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "swiftspec", "chat", *args], input=stdin, capture_output=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def tiny_target():
    from tiny_models import tiny_model_dir

    return str(tiny_model_dir(seed=0, layers=2))


@pytest.mark.slow
def test_real_engine_jsonl_each_line(tiny_target, tmp_path):
    result = swiftspec(["--target", tiny_target, "--max-seq-len", "256", "--max-new-tokens", "12", "--jsonl",
                        "--each-line", "--mode", "async"], b"first prompt\nsecond prompt\n", tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    events = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert {e["event"] for e in events} == {"token", "done"}
    done = [e for e in events if e["event"] == "done"]
    assert [d["index"] for d in done] == [0, 1]
    for d in done:
        tokens = [i for e in events if e["event"] == "token" and e["index"] == d["index"] for i in e["token_ids"]]
        assert len(tokens) == d["stats"]["generated"] <= 12
        assert d["stats"]["mode"] == "async" and d["finish_reason"] in ("eos", "length")
    assert "ready" in result.stderr.decode()


@pytest.mark.slow
def test_real_engine_saved_answer_survives_the_fast_exit(tiny_target, tmp_path, monkeypatch):
    """The program ends with os._exit (cli.run): what it wrote before, history included, is all there."""
    result = swiftspec(["--target", tiny_target, "--max-seq-len", "256", "--max-new-tokens", "6", "--save",
                        "-p", "hi"], b"", tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path))
    store = HistoryStore()
    (conversation,) = store.list()
    saved = store.messages(conversation.id)
    assert [m.role for m in saved] == ["user", "assistant"] and saved[0].content == "hi"
    assert saved[1].content.strip() == result.stdout.decode().strip()


def test_real_bad_target_exit_2(tmp_path):
    """A missing model is found before any worker starts: a usage error naming the path."""
    missing = swiftspec(["--target", str(tmp_path / "nope"), "-p", "hi"], b"", tmp_path)
    assert missing.returncode == 2 and b"nope" in missing.stderr


def test_terminal_runs_the_tui(monkeypatch, data_dir, tmp_path):
    from swiftspec.tui.app import SwiftSpecApp

    store = HistoryStore()
    old = store.create("earlier")
    apps = []
    monkeypatch.setattr(cli_chat, "_interactive", lambda: True)
    monkeypatch.setattr(cli_chat, "_prepare_models", lambda config: None)
    monkeypatch.setattr(SwiftSpecApp, "run", lambda self: apps.append(self) or 0)
    result = invoke(["chat", "--mode", "sync", "--temperature", "0.5", "--system", "Be kind.", "--resume"])
    assert result.exit_code == 0, result.output
    app = apps[0]
    conversation = app.conversation
    assert (conversation.params.mode, conversation.params.temperature, conversation.settings.system,
            conversation.id) == ("sync", 0.5, "Be kind.", old)


def test_missing_model_is_a_usage_error_before_the_tui(monkeypatch, data_dir, tmp_path, target_dir):
    monkeypatch.setattr(cli_chat, "_interactive", lambda: True)
    result = invoke(["chat", "--target", str(tmp_path / "missing")])
    assert result.exit_code == 2 and result.stderr.startswith("swiftspec: --target: no model at ")
    result = invoke(["chat", "--draft", str(tmp_path / "missing-draft.gguf")])
    assert result.exit_code == 2 and result.stderr.startswith("swiftspec: --draft: no draft at ")
    (tmp_path / "notes.txt").write_text("not a model")  # found only when the models are resolved: named too
    result = invoke(["chat", "--target", str(target_dir), "--draft", str(tmp_path / "notes.txt")])
    assert result.exit_code == 2 and f"draft '{tmp_path / 'notes.txt'}' is a file but not a .gguf" in result.stderr


def test_bench_passes_its_options_through(monkeypatch, tmp_path):
    import swiftspec.bench

    bad = invoke(["bench", "--modes", "bogus"])  # checked before any model loads
    assert bad.exit_code == 2 and "bogus" in bad.stderr
    seen = {}
    monkeypatch.setattr(swiftspec.bench, "bench_command", lambda **kw: seen.update(kw) or {})
    result = invoke(["bench", "--modes", "ar,async", "--set", "code", "--limit", "2", "--max-new-tokens", "16",
                     "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), "--target-procs", "2",
                     "--temperature", "0.7", "--top-k", "20", "--seed", "3", "--system", "Be brief.", "--bs", "4"])
    assert result.exit_code == 0, result.output
    assert (seen["modes"], seen["prompt_set"], seen["limit"], seen["system"]) == ("ar,async", "code", 2, "Be brief.")
    s = seen["sampling"]
    assert (s.max_new_tokens, s.temperature, s.top_k, s.seed) == (16, 0.7, 20, 3)
    assert seen["config"].tree.bs == 4
    assert (seen["json_path"], seen["plot_path"]) == (tmp_path / "r.json", tmp_path / "r.png")
    assert seen["config"].target_procs == 2 and seen["prompts"] is None
    assert invoke(["bench", "--repeat-penalty", "1.3", "--presence-penalty", "0.2", "--min-p", "0.1"]).exit_code == 0
    s = seen["sampling"]
    assert (s.repeat_penalty, s.presence_penalty, s.min_p, s.temperature) == (1.3, 0.2, 0.1, 0.0)
    assert invoke(["bench"]).exit_code == 0  # a benchmark is greedy and unpenalised unless asked
    assert seen["sampling"] == SamplingParams(max_new_tokens=128)


def test_bench_interrupted_exits_130(monkeypatch):
    import swiftspec.bench

    monkeypatch.setattr(swiftspec.bench, "bench_command", lambda **kw: {"partial": {"finished": 1, "planned": 3}})
    assert invoke(["bench"]).exit_code == 130

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(swiftspec.bench, "bench_command", interrupted)
    result = invoke(["bench"])
    assert result.exit_code == 130 and "nothing to report" in result.stderr


def test_a_head_for_another_target_is_a_usage_error(monkeypatch, tmp_path):
    """--draft HEAD whose hidden size is not the target's: exit 2 before the TUI, naming both sizes."""
    from tiny_models import tiny_model_dir

    from swiftspec.engine.model.model_dir import read_args
    from swiftspec.engine.spec.draft_head import DraftHead, HeadArgs, save_head

    target = tiny_model_dir(seed=1)
    args = HeadArgs.for_target(read_args(target))
    args.dim *= 2
    save_head(DraftHead(args), tmp_path / "head")
    monkeypatch.setattr(cli_chat, "_interactive", lambda: True)
    result = invoke(["chat", "--target", str(target), "--draft", str(tmp_path / "head")])
    assert result.exit_code == 2, result.output
    assert f"hidden size {args.dim}" in result.stderr and f"hidden size {args.dim // 2}" in result.stderr


def test_train_draft_checks_its_values():
    result = invoke(["train-draft", "--out", "x", "--steps", "0"])
    assert result.exit_code == 2 and "steps" in result.stderr


def test_save_from_the_environment_and_the_id_it_prints(fake, data_dir, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_SAVE", "1")
    result = invoke(["chat", "-p", "hi"])
    (saved,) = HistoryStore().list()
    assert result.exit_code == 0 and f"saved as conversation #{saved.id} (swiftspec chat --resume {saved.id})" \
        in result.stderr


def test_quiet_leaves_stderr_empty(fake, data_dir):
    loud = invoke(["chat", "-p", "hi"])
    quiet = invoke(["chat", "-p", "hi", "--quiet"])
    assert loud.stderr.count("\n") >= 3 and quiet.stderr == "" and quiet.stdout == loud.stdout == ANSWER + "\n"


def test_a_prompt_that_cannot_fit_is_refused_before_the_engine_starts(fake, data_dir, monkeypatch):
    from swiftspec import window
    from swiftspec.engine.host.client import Engine

    monkeypatch.setattr(Engine, "context", staticmethod(
        lambda config, progress=None: window.Context(FakeEngine.count_tokens, 1024, 1024)))
    result = invoke(["chat", "-p", "word " * 1500, "--max-seq-len", "1024"])
    assert result.exit_code == 2 and not fake  # was: the engine started (7.5 s), then refused
    assert "more than the context of 1024 tokens" in result.stderr
    assert "raise --max-seq-len" not in result.stderr and "already the model's maximum" in result.stderr
    assert invoke(["chat", "-p", "a short one"]).exit_code == 0  # no tokenizer needed: surely fits


def test_help_names_every_exit_code():
    out = " ".join(invoke(["chat", "--help"]).output.split())
    assert all(code in out for code in ("0 ok", "1 engine error", "2 usage error", "130 interrupted"))


def test_serve_binds_its_port_before_any_worker_starts_and_hands_it_to_uvicorn(monkeypatch, data_dir):
    """A taken port is refused before the engine starts (was: after loading it, seconds to minutes);
    otherwise the socket bound first is the one uvicorn serves on."""
    import socket

    import uvicorn

    from swiftspec.engine.host.client import Engine

    started, served = [], []

    def start(config, progress=None):  # the port is already ours when the workers would start
        with pytest.raises(OSError):
            socket.create_server(("127.0.0.1", port))
        started.append(config)
        return FakeEngine.start(config, progress)

    monkeypatch.setattr(Engine, "start", staticmethod(start))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: served.extend(s.getsockname() for s in sockets))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = invoke(["serve", "--port", str(port)])
        assert result.exit_code == 2 and not started
        assert result.stderr == (f"swiftspec: --port: cannot listen on 127.0.0.1:{port} (Address already in use); "
                                 "a free port, or 0 for any\n")
    result = invoke(["serve", "--port", str(port)])
    assert result.exit_code == 0, result.output
    assert len(started) == 1 and served == [("127.0.0.1", port)]



def test_a_taken_port_is_refused_before_the_server_or_torch_is_imported():
    """What makes a taken port fail in a fraction of a second: nothing heavy is imported before the bind."""
    import socket

    code = ("import sys\nfrom swiftspec.cli import main\nsys.argv = ['swiftspec', 'serve', '--port', sys.argv[1]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('uvicorn', 'starlette', 'torch') if m in sys.modules))")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        out = subprocess.run([sys.executable, "-c", code, str(taken.getsockname()[1])], capture_output=True,
                             text=True, timeout=60)
    assert out.stdout.strip() == "2 []", out.stderr
    assert "--port: cannot listen" in out.stderr

def test_grammar_flags_reach_the_engine_and_bad_files_are_usage_errors(fake, data_dir, monkeypatch, tmp_path):
    from swiftspec.engine.config import Grammar, GrammarKind

    seen = []
    generate = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: seen.append(p) or generate(self, m, p))
    schema, lark, gbnf = tmp_path / "s.json", tmp_path / "g.lark", tmp_path / "g.gbnf"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    lark.write_text('start: "yes" | "no"')
    gbnf.write_text('root ::= "yes" | "no"')
    for flags, grammar in ((["--json"], Grammar(GrammarKind.JSON)),
                           (["--json-schema", str(schema)], Grammar(GrammarKind.JSON_SCHEMA, schema.read_text())),
                           (["--grammar", str(lark)], Grammar(GrammarKind.LARK, lark.read_text())),
                           (["--grammar", str(gbnf)], Grammar(GrammarKind.LARK, gbnf.read_text()))):
        result = invoke(["chat", "-p", "hi", *flags])
        assert result.exit_code == 0, result.output
        assert seen[-1].grammar == grammar
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objectx"}')
    for flags, words in ((["--json-schema", str(bad)], "objectx"), (["--grammar", str(tmp_path / "none")], "cannot be read"),
                         (["--json", "--grammar", str(lark)], "one grammar")):
        result = invoke(["chat", "-p", "hi", *flags])
        assert result.exit_code == 2 and words in result.output, result.output


@pytest.mark.slow
def test_real_engine_answers_in_json(tiny_target, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, '
                      '"required": ["n"], "additionalProperties": false}')
    result = swiftspec(["--target", tiny_target, "--max-seq-len", "256", "--max-new-tokens", "40", "--json-schema",
                        str(schema), "-p", "a number", "--mode", "sync"], b"", tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert 0 <= json.loads(result.stdout.decode())["n"] <= 99
