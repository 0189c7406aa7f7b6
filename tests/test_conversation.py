"""The Conversation against the FakeEngine and a real history store: no path through retry, edit,
continue, clear, quitting or an engine failure loses a saved turn; settings are the conversation's own."""

from __future__ import annotations

import dataclasses

import pytest
from fake_engine import ANSWER, INFO, FakeEngine
from tiny_models import tiny_model_dir

from swiftspec import window
from swiftspec.conversation import CannotAnswer, Conversation, Reply, Settings
from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent, StepStats
from swiftspec.engine.host.client import Engine
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model.model_dir import load_tokenizer
from swiftspec.history import HistoryStore


@pytest.fixture
def store(tmp_path):
    s = HistoryStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


def ask(conversation, engine, kind="ask", text=None):
    return conversation.run(Reply(conversation.plan(kind, window.Context.of(engine), text)), engine)


def saved(store, conversation) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in store.messages(conversation.id)]


def one_turn(store, **params):
    conversation = Conversation(store, Settings(params=SamplingParams(**params)))
    ask(conversation, FakeEngine(), text="hello")
    assert saved(store, conversation) == [("user", "hello"), ("assistant", ANSWER)]
    return conversation


def test_a_refused_retry_keeps_the_saved_answer(store):
    conversation = one_turn(store)
    refusing = FakeEngine(refuse="the engine refuses")
    reply = ask(conversation, refusing, "retry")
    assert reply.error == "the engine refuses" and not reply.accepted
    assert saved(store, conversation) == [("user", "hello"), ("assistant", ANSWER)]  # was: all deleted
    assert [m.content for m in conversation.messages] == ["hello", ANSWER]


def test_a_retry_in_a_mode_the_engine_cannot_run_keeps_the_saved_answer(store):
    conversation = one_turn(store)
    conversation.set_params(SamplingParams(mode="sync"))
    reply = ask(conversation, FakeEngine(draft="none"), "retry")
    assert "needs a draft" in reply.error
    assert saved(store, conversation) == [("user", "hello"), ("assistant", ANSWER)]


def test_a_retry_that_no_longer_fits_changes_nothing(store):
    conversation = Conversation(store, Settings(params=SamplingParams(max_new_tokens=5)))
    engine = FakeEngine(context_length=100)
    ask(conversation, engine, text="word " * 56)  # 60 "tokens": fits with 5 of room, not with 50
    conversation.set_params(SamplingParams(max_new_tokens=100))
    with pytest.raises(window.ContextError):
        conversation.plan("retry", window.Context.of(engine))
    assert len(saved(store, conversation)) == 2 and store.get(conversation.id)


def test_an_accepted_retry_replaces_the_answer(store):
    conversation = one_turn(store, temperature=0.8)
    ask(conversation, FakeEngine(answer="another"), "retry")
    assert saved(store, conversation) == [("user", "hello"), ("assistant", "another")]


def test_an_edit_replaces_the_turn_only_once_accepted(store):
    conversation = one_turn(store)
    ask(conversation, FakeEngine(refuse="no"), "edit", "hello again")
    assert saved(store, conversation) == [("user", "hello"), ("assistant", ANSWER)]
    ask(conversation, FakeEngine(answer="hi"), "edit", "hello again")
    assert saved(store, conversation) == [("user", "hello again"), ("assistant", "hi")]


def test_an_engine_death_mid_answer_keeps_the_turn_and_continue_goes_on(store):
    conversation = Conversation(store, Settings())
    reply = ask(conversation, FakeEngine(die_after=2), text="hello")
    assert reply.fatal and "signal 9" in reply.error
    (question, answer) = store.messages(conversation.id)
    assert question.content == "hello" and ANSWER.startswith(answer.content) and answer.content
    assert answer.stats["finish_reason"] == "error"
    ask(conversation, FakeEngine(), "continue")
    assert saved(store, conversation) == [("user", "hello"), ("assistant", ANSWER)]


def test_an_answer_interrupted_by_quitting_is_kept_and_resumes(store):
    conversation = Conversation(store, Settings())
    engine = FakeEngine()
    reply = Reply(conversation.plan("ask", window.Context.of(engine), "hello"))

    def quit_after_two(event, seen=[]):  # noqa: B006 (a counter)
        seen.append(event)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conversation.run(reply, engine, on_event=quit_after_two)
    resumed = Conversation.resume(store, conversation.id, Settings())
    assert resumed.last_finish == "cancelled" and resumed.messages[-1].content
    ask(resumed, engine, "continue")
    assert saved(store, resumed) == [("user", "hello"), ("assistant", ANSWER)]


def test_an_answer_cut_by_a_crash_is_partial_and_can_go_on(store):
    conversation_id = store.create("crashed")
    store.add(conversation_id, "user", "hello")
    store.add(conversation_id, "assistant", ANSWER[:8], {"finish_reason": "partial"})  # as saved mid-stream
    resumed = Conversation.resume(store, conversation_id, Settings())
    ask(resumed, FakeEngine(), "continue")
    assert saved(store, resumed) == [("user", "hello"), ("assistant", ANSWER)]
    with pytest.raises(CannotAnswer, match="complete"):
        resumed.plan("continue", window.Context.of(FakeEngine()))


def test_clear_deletes_the_conversation_not_just_its_messages(store):
    conversation = one_turn(store)
    conversation.clear()
    assert store.list() == [] and conversation.messages == [] and conversation.id is None


def test_settings_are_kept_with_the_conversation_and_restored(store):
    conversation = one_turn(store)
    conversation.set_params(SamplingParams(temperature=0.5, top_k=40, max_new_tokens=64))
    resumed = Conversation.resume(store, conversation.id, Settings())
    assert (resumed.params.temperature, resumed.params.top_k, resumed.params.max_new_tokens) == (0.5, 40, 64)
    given = Conversation.resume(store, conversation.id, Settings(params=SamplingParams(temperature=0.9)),
                                prefer={"temperature"})  # a flag given for this run wins
    assert (given.params.temperature, given.params.top_k) == (0.9, 40)


def test_a_system_prompt_set_mid_chat_is_exported_where_it_was_set(store):
    conversation = Conversation(store, Settings(system="Be brief."))
    ask(conversation, FakeEngine(answer="first answer"), text="one")
    conversation.set_system("Be verbose.")
    engine = FakeEngine(answer="second answer")
    ask(conversation, engine, text="two")
    assert engine.calls[0][0][0] == {"role": "system", "content": "Be verbose."}
    for markdown in (conversation.to_markdown(), store.export_markdown(conversation.id)):
        assert markdown.index("**System:** Be brief.") < markdown.index("first answer")
        assert markdown.index("first answer") < markdown.index("Be verbose.") < markdown.index("second answer")
    resumed = Conversation.resume(store, conversation.id, Settings())
    assert resumed.settings.system == "Be verbose." and resumed.to_markdown() == conversation.to_markdown()


def test_a_conversation_deleted_elsewhere_is_saved_anew_whole(store):
    conversation = Conversation(store, Settings(system="Be brief."))
    ask(conversation, FakeEngine(answer="a1"), text="q1")
    conversation.set_system("Be verbose.")
    HistoryStore(store.path).delete(conversation.id)
    ask(conversation, FakeEngine(answer="a2"), text="q2")
    assert any("deleted elsewhere" in w for w in conversation.take_warnings())
    assert saved(store, conversation) == [("user", "q1"), ("assistant", "a1"), ("system", "Be verbose."),
                                          ("user", "q2"), ("assistant", "a2")]
    assert [m.id for m in conversation.messages] == [m.id for m in store.messages(conversation.id)
                                                     if m.role != "system"]


class TemplatingEngine(Engine):
    """The Engine's own generate, generate_ids and encode_chat on a tiny model's tokenizer, without workers:
    what it would send them is kept in ``sent``; each answer is one cut-short step."""

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer, self.sent = tokenizer, []
        self.info = dataclasses.replace(INFO, context_length=context_length)

    def _stream(self, ids, params):
        self.sent.append(ids)
        yield StepEvent([7], " and so on", StepStats(generated=1), True, "length")

    @property
    def alive(self) -> bool:
        return True


@pytest.mark.parametrize("templated", [True, False])
def test_a_turn_is_sent_as_the_ids_its_window_was_fitted_with(templated):
    """A turn is templated once, to fit it into the context, and those ids are sent: the very ids the
    Engine's generate() makes of the same messages (template, generation prompt, a continued answer, a
    moved window; a tokenizer without a template too)."""
    tokenizer = load_tokenizer(tiny_model_dir())
    template, calls = tokenizer.apply_chat_template, []
    tokenizer.apply_chat_template = lambda *a, **k: (calls.append(1), template(*a, **k))[1]
    if not templated:
        tokenizer.chat_template = None
    engine = TemplatingEngine(tokenizer, context_length=80)
    conversation = Conversation(None, Settings("Be brief.", SamplingParams(max_new_tokens=8)))
    moved = False
    for kind, text in [("ask", "What is 17 times 23?"), ("continue", None), ("ask", "def fibonacci(n):"),
                       ("retry", None), ("edit", "Summarise speculative decoding in a few words."),
                       ("ask", "The quick brown fox jumps over the lazy dog, and again, and again.")]:
        calls.clear()
        plan = conversation.plan(kind, window.Context.of(engine), text)
        moved = moved or plan.left_out > 0
        reply = conversation.run(Reply(plan), engine)
        assert reply.error is None and list(plan.ids) == engine.sent[-1]
        if not plan.left_out:  # the window stayed: one template pass, for counting and sending alike
            assert len(calls) == int(templated)
        list(Engine.generate(engine, list(plan.messages), plan.params))  # what sending the messages sends
        assert engine.sent[-1] == engine.sent[-2] == encode_chat(tokenizer, list(plan.messages))
    assert moved and plan.messages[0]["role"] == "system"
