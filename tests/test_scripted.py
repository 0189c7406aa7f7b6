"""Scripted mode in-process against the FakeEngine: stdout/stderr split, --jsonl schema, --each-line,
exit codes and bad input. Real subprocess runs against the real engine are in test_cli."""

from __future__ import annotations

import io
import json
import re

import pytest
from fake_engine import ANSWER, FakeEngine, chunks

from swiftspec import scripted
from swiftspec.conversation import Conversation, Message, Settings
from swiftspec.engine.config import SamplingParams
from swiftspec.engine.host.client import Engine, EngineError
from swiftspec.engine.host.protocol import EngineAPI


def run(prompts, engine=None, params=None, system=None, context=(), store=None, **kw):
    """scripted.run after ``context`` (role, content) pairs, saved into ``store`` when given."""
    conversation = Conversation(store, Settings(system, params or SamplingParams()))
    conversation.messages = [Message(m["role"], m["content"], i) for i, m in enumerate(context)]
    out, err = io.StringIO(), io.StringIO()
    code = scripted.run(engine or FakeEngine(), prompts, conversation, out=out, err=err, **kw)
    return code, out.getvalue(), err.getvalue()


def test_the_fake_engine_offers_the_engine_api():
    """What the TUI, scripted mode and bench may call, checked on the fake they are tested with."""
    assert isinstance(FakeEngine(), EngineAPI) and not isinstance(object(), EngineAPI)
    assert all(callable(getattr(Engine, name)) for name in ("generate", "count_tokens", "cancel", "close"))


def test_answer_alone_on_stdout_stats_on_stderr():
    code, out, err = run(["hello"])
    assert code == 0
    assert out == ANSWER + "\n"
    assert "async" in err and "tok/s" in err and "eos" in err
    assert ANSWER not in err


def test_jsonl_schema():
    engine = FakeEngine()
    code, out, _ = run(["hello"], engine, jsonl=True)
    assert code == 0
    events = [json.loads(line) for line in out.splitlines()]
    tokens, done = events[:-1], events[-1]
    assert tokens and all(e["event"] == "token" for e in tokens)
    assert all(set(e) == {"event", "index", "text", "token_ids"} for e in tokens)
    assert "".join(e["text"] for e in tokens) == ANSWER
    assert [i for e in tokens for i in e["token_ids"]] == list(range(len(chunks(ANSWER))))
    assert done["event"] == "done" and done["finish_reason"] == "eos"
    assert "accepted" not in done["stats"]  # the last step's count: the answer's figures are the two below
    assert all(e["text"] for e in tokens)  # the EOS that ended it is no token event of its own
    for key in ("acceptance_rate", "mean_accepted", "tokens_per_s", "token_latency_ms", "tree_size", "draft_ms",
                "target_ms", "d", "generated", "ms_per_token_p50", "mode"):
        assert key in done["stats"], key


def test_each_line_prompts_are_independent():
    engine = FakeEngine(answer="ok")
    code, out, err = run(["first", "second"], engine, jsonl=True, system="Be brief.")
    assert code == 0
    done = [json.loads(line) for line in out.splitlines() if '"done"' in line]
    assert [d["index"] for d in done] == [0, 1]
    assert [m for m, _ in engine.calls] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "second"}],
    ]
    assert err.count("\n") == 2  # one stats line per answer


def test_max_new_tokens_and_context():
    engine = FakeEngine()
    code, out, err = run(["q"], engine, params=SamplingParams(max_new_tokens=2),
                         context=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert code == 0 and out == ANSWER[:8] + "\n" and "length" in err
    assert [m["content"] for m in engine.calls[0][0]] == ["a", "b", "q"]


@pytest.mark.parametrize("jsonl", [False, True])
def test_engine_error_exit_1(jsonl):
    code, out, err = run(["hello"], FakeEngine(die_after=2), jsonl=jsonl)
    assert code == 1
    assert "engine error" in err and "signal 9" in err
    if jsonl:
        last = json.loads(out.splitlines()[-1])
        assert last["event"] == "error" and "signal 9" in last["message"]


def test_read_prompts():
    assert scripted.read_prompts(b"  whole\nstdin  \n") == ["whole\nstdin"]
    assert scripted.read_prompts(b"a\n\n b \n", each_line=True) == ["a", "b"]
    assert scripted.read_prompts(b"", prompt="-p text") == ["-p text"]
    assert scripted.read_prompts(b"material", prompt="Summarise:") == ["Summarise:\n\nmaterial"]
    assert scripted.read_prompts("\ufeffcaf\u00e9 \U0001f600".encode()) == ["caf\u00e9 \U0001f600"]


@pytest.mark.parametrize("data, kw, message", [
    (b"", {}, "empty input"),
    (b" \n\t\n", {"each_line": True}, "empty input"),
    (b"caf\xe9", {}, "not valid UTF-8"),
    (b"", {"prompt": "  "}, "-p is empty"),
])
def test_bad_input(data, kw, message):
    with pytest.raises(scripted.InputError, match=message):
        scripted.read_prompts(data, **kw)


def test_long_resumed_conversation_leaves_out_its_oldest_turns():
    context = []
    for i in range(12):
        context += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "word " * 20}]
    engine = FakeEngine(context_length=200)
    code, out, err = run(["last question"], engine, system="Be brief.", context=context)
    assert code == 0 and out == ANSWER + "\n"
    sent = engine.calls[0][0]
    assert sent[0] == {"role": "system", "content": "Be brief."}  # never dropped
    assert sent[1]["content"].startswith("question ") and sent[-1]["content"] == "last question"
    assert engine.count_tokens(sent) + 100 <= 200  # room for the answer: half the context
    dropped = int(sent[1]["content"].split()[1])
    assert f"context full: left out the {dropped} oldest of 12 earlier turns" in err


@pytest.mark.parametrize("jsonl", [False, True])
def test_prompt_that_cannot_fit_is_a_usage_error(jsonl):
    engine = FakeEngine(context_length=100)
    code, out, err = run(["word " * 90], engine, jsonl=jsonl)
    assert code == 2 and "more than the context of 100 tokens" in err and engine.calls == []
    if jsonl:
        assert json.loads(out)["event"] == "error"


def test_answer_cut_by_the_context_says_context():
    code, _, err = run(["q"], FakeEngine(answer="word " * 200, context_length=200))
    assert code == 0 and "context" in err.splitlines()[-1]


def test_each_line_answers_are_separated_by_a_blank_line():
    code, out, err = run(["first", "second"], FakeEngine(answer="one\ntwo"))
    assert code == 0 and out == "one\ntwo\n\none\ntwo\n"


def test_quiet_prints_no_figures():
    code, out, err = run(["hello"], quiet=True)
    assert code == 0 and out == ANSWER + "\n" and err == ""


def test_saved_prompts_are_turns_of_one_conversation(tmp_path):
    """With a store (--save, --resume) each prompt sees the earlier ones: the saved record is what the
    model was shown."""
    from swiftspec.history import HistoryStore

    store = HistoryStore(tmp_path / "h.sqlite3")
    engine = FakeEngine(answer="ok")
    code, _, _ = run(["first", "second"], engine, store=store)
    assert code == 0 and [m["content"] for m in engine.calls[1][0]] == ["first", "ok", "second"]
    (saved,) = store.list()
    assert [m.content for m in store.messages(saved.id)] == ["first", "ok", "second", "ok"]


def test_each_line_answers_the_other_lines_after_one_is_refused():
    import io

    from fake_engine import FakeEngine

    from swiftspec import scripted

    class RefusesLongPrompts(FakeEngine):
        def generate(self, messages, params):
            if len(messages[-1]["content"]) > 20:
                raise EngineError("the conversation is 9000 tokens, but the context length is 4096")
            return super().generate(messages, params)

    out, err = io.StringIO(), io.StringIO()
    code = scripted.run(RefusesLongPrompts(answer="ok"), ["first", "x" * 100, "third"], Conversation(None, Settings()),
                        jsonl=True, out=out, err=err)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == scripted.EXIT_ENGINE and "context length" in err.getvalue()
    assert [(e["event"], e["index"]) for e in events if e["event"] != "token"] == [
        ("done", 0), ("error", 1), ("done", 2)]


def test_a_closed_stdout_is_not_an_engine_error():
    """`swiftspec chat -p ... | head -c 1`: the reader goes away; that is no engine error."""
    import io

    from fake_engine import FakeEngine

    from swiftspec import scripted

    class ClosedAfterOneWrite(io.StringIO):
        def write(self, text):
            if self.getvalue():
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    err = io.StringIO()
    engine = FakeEngine()
    code = scripted.run(engine, ["one", "two"], Conversation(None, Settings()), out=ClosedAfterOneWrite(), err=err)
    assert code == scripted.EXIT_BROKEN_PIPE and "engine error" not in err.getvalue()
    assert len(engine.calls) == 1


def test_a_prompt_that_is_not_utf8_is_a_usage_error():
    from swiftspec import scripted

    with pytest.raises(scripted.InputError, match="not valid UTF-8"):
        scripted.read_prompts(b"", prompt=b"caf\xe9".decode("utf-8", "surrogateescape"))


def test_ctrl_c_ends_the_line_and_prints_the_figures_marked_interrupted():
    """Ctrl-C mid-answer (here: while a token is written): stdout's line is ended, stderr has the figures
    so far marked interrupted, and the interrupt goes on to the caller (exit 130)."""
    class InterruptedOnce(io.StringIO):
        writes = 0

        def write(self, text):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return super().write(text)

    out, err = InterruptedOnce(), io.StringIO()
    conversation = Conversation(None, Settings(None, SamplingParams()))
    with pytest.raises(KeyboardInterrupt):
        scripted.run(FakeEngine(), ["hello"], conversation, out=out, err=err)
    written = out.getvalue()
    assert written.endswith("\n") and len(written) > 1 and ANSWER.startswith(written[:-1]) and written[:-1] != ANSWER
    assert re.fullmatch(r"\[async · [1-9]\d* tok · [^\n]* · interrupted\]\n", err.getvalue()), err.getvalue()
    jsonl_out, quiet_err = InterruptedOnce(), io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        scripted.run(FakeEngine(), ["hello"], conversation, jsonl=True, quiet=True, out=jsonl_out, err=quiet_err)
    done = json.loads(jsonl_out.getvalue().splitlines()[-1])
    assert done["event"] == "done" and done["finish_reason"] == "cancelled" and quiet_err.getvalue() == ""
