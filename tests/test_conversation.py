"""The Conversation against the FakeEngine and a real history store: no path through retry, edit,
continue, clear, quitting or an engine failure loses a saved turn; settings are the conversation's own."""

from __future__ import annotations

import pytest
from fake_engine import ANSWER, FakeEngine

from swiftspec import window
from swiftspec.conversation import CannotAnswer, Conversation, Reply, Settings
from swiftspec.engine.config import SamplingParams
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
