"""Pilot tests of what keeps a conversation going (FakeEngine): context overflow, /continue, /retry,
editing, the history screen, saving turn by turn, history database faults, /export, /copy."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
from fake_engine import ANSWER, FakeEngine, chunks
from helpers.pilot import boxes, idle, make_app, notes, ready, resumed_app, type_and_send, wait_for

from swiftspec import history
from swiftspec.engine.config import SamplingParams
from swiftspec.history import HistoryStore
from swiftspec.tui.dialogs import ConfirmScreen, TextPromptScreen
from swiftspec.tui.history_screen import HistoryScreen
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.notice import Notice
from swiftspec.tui.widgets.prompt_input import PromptInput


def notices(app) -> list[str]:
    return [n.text for n in app.query_one(ChatView).query(Notice)]


async def test_ten_turns_in_a_small_context_drop_the_oldest_with_notices(store):
    answer = "word " * 40  # 50 "tokens" streamed; counts 44 in a prompt
    factory = FakeEngine.factory(answer=answer, context_length=300)
    app = make_app(store, factory, max_new_tokens=512)  # room for the answer: half the context
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        for i in range(10):
            await type_and_send(pilot, f"question number {i}")
            await idle(pilot)
        assert not any("No answer" in n or "context length" in n for n in notes(app))
        assert len(boxes(app)) == 20 and all(text == answer for role, text in boxes(app) if role == "assistant")
        engine = factory.started[0]
        assert len(engine.calls) == 10
        for messages, params in engine.calls:  # each prompt fit, with room for the answer
            assert engine.count_tokens(messages) + min(params.max_new_tokens, 150) <= 300
        last = [m["content"] for m in engine.calls[-1][0]]
        assert last[-1] == "question number 9" and "question number 0" not in last
        assert last[0].startswith("question number")  # whole turns are dropped: it starts with a question
        # one notice per overflow, above the question it made room for; the window only moves forward
        found = notices(app)
        assert 3 <= len(found) <= 9 and all(n.startswith("Context full: left out the") for n in found)
        children = list(app.query_one(ChatView).children)
        first_notice = next(i for i, w in enumerate(children) if isinstance(w, Notice))
        assert isinstance(children[first_notice + 1], MessageBox) and children[first_notice + 1].role == "user"
        starts = [next(i for i in range(10) if f"question number {i}" in str(m)) for m, _ in engine.calls]
        assert starts == sorted(starts) and starts[-1] > 0
        # between overflows the prompt keeps its prefix (the workers reuse its KV cache)
        same_window = [(a, b) for (a, _), (b, _) in zip(engine.calls, engine.calls[1:], strict=False)
                       if a[0] == b[0]]
        assert same_window and all(b[:len(a)] == a for a, b in same_window)
    saved = store.messages(app.conversation.id)  # history keeps everything the user saw
    assert len(saved) == 20 and saved[0].content == "question number 0"


async def test_a_message_that_cannot_fit_is_given_back(store):
    factory = FakeEngine.factory(context_length=100)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "long " * 80)
        await pilot.pause()
        assert any("more than the context of 100 tokens" in n for n in notes(app))
        assert app.query_one(PromptInput).text == "long " * 80 and boxes(app) == []  # the input keeps it
        assert factory.started[0].calls == [] and store.list() == []


async def test_answer_cut_by_context_says_context(store):
    factory = FakeEngine.factory(answer="word " * 300, context_length=300)
    app = make_app(store, factory, max_new_tokens=512)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "go")
        await idle(pilot)
        assert "context" in app.query_one(ChatView).query(MessageBox).last().border_subtitle
        assert store.messages(app.conversation.id)[-1].stats["finish_reason"] == "context"
        assert any("/continue" in n for n in notes(app))


async def test_continue_an_answer_cut_by_length(store):
    factory = FakeEngine.factory()
    app = make_app(store, factory, max_new_tokens=5)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/continue")
        assert any("no answer to continue" in n for n in notes(app))
        await type_and_send(pilot, "hi")
        await idle(pilot)
        assert boxes(app)[-1][1] == ANSWER[:20]
        first_id = app.conversation.messages[-1].id
        while app.conversation.last_finish == "length":
            await type_and_send(pilot, "/continue")
            await idle(pilot)
        engine = factory.started[0]
        assert engine.calls[1][0][-1] == {"role": "assistant", "content": ANSWER[:20]}  # the model continues it
        assert boxes(app) == [("user", "hi"), ("assistant", ANSWER)] and app.conversation.last_finish == "eos"
        saved = store.messages(app.conversation.id)
        assert [(m.content, m.id) for m in saved[1:]] == [(ANSWER, first_id)]  # one answer, updated in place
        await type_and_send(pilot, "/continue")
        assert any("complete (eos)" in n for n in notes(app))
        assert len(engine.calls) == len(chunks(ANSWER)) // 5 + 1


async def test_a_loop_guard_stop_says_so_and_continues(store):
    factory = FakeEngine.factory(loops_at=3)
    app = make_app(store, factory, loop_guard=64)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hi")
        await idle(pilot)
        assert boxes(app)[-1][1] == ANSWER[:12] and app.conversation.last_finish == "repetition"
        assert any("repeating itself" in n and "/continue" in n for n in notes(app))
        assert store.messages(app.conversation.id)[-1].stats["finish_reason"] == "repetition"
        await type_and_send(pilot, "/continue")
        await idle(pilot)
        assert factory.started[0].calls[1][0][-1] == {"role": "assistant", "content": ANSWER[:12]}
        assert boxes(app) == [("user", "hi"), ("assistant", ANSWER[:24])]


async def test_retry_greedy_and_sampled(store):
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/retry")
        assert any("no answer to retry" in n for n in notes(app))
        await type_and_send(pilot, "hello")
        await idle(pilot)
        await type_and_send(pilot, "/retry")
        await idle(pilot)
        assert any("Greedy decoding" in n and "same answer" in n for n in notes(app))
        engine = factory.started[0]
        assert engine.calls[1][0] == [{"role": "user", "content": "hello"}]  # the old answer is not in it
        assert boxes(app) == [("user", "hello"), ("assistant", ANSWER)]
        await type_and_send(pilot, "/temp 0.8")
        await type_and_send(pilot, "/retry")
        await idle(pilot)
        seed = engine.calls[2][1].seed
        assert seed is not None and any(f"seed {seed}" in n for n in notes(app))
        assert app.conversation.params.seed is None  # the new seed was for that answer only
    saved = store.messages(app.conversation.id)
    assert [(m.role, m.content) for m in saved] == [("user", "hello"), ("assistant", ANSWER)]


async def test_edit_last_message_with_up_and_slash_edit(store):
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        await type_and_send(pilot, "first")
        await idle(pilot)
        await type_and_send(pilot, "secnd")
        await idle(pilot)
        await pilot.press("up")  # empty input: edit the last message
        assert prompt.text == "secnd" and prompt.editing and "editing" in str(prompt.border_title)
        await pilot.press("left", "left", "o")  # the cursor was at the end: "sec|nd" -> "second"
        await pilot.press("enter")
        await idle(pilot)
        assert boxes(app) == [("user", "first"), ("assistant", ANSWER), ("user", "second"), ("assistant", ANSWER)]
        assert factory.started[0].calls[-1][0][-1] == {"role": "user", "content": "second"}
        assert [m.content for m in store.messages(app.conversation.id)] == ["first", ANSWER, "second", ANSWER]
        await type_and_send(pilot, "/edit")
        assert prompt.text == "second" and prompt.editing
        await pilot.press("up")  # further up browses earlier prompts: those are sent as new messages
        assert prompt.text == "first" and not prompt.editing


async def test_each_message_is_saved_when_it_exists(store):
    factory = FakeEngine.factory(step_delay=0.05, answer="word " * 100)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "saved before the answer")
        await wait_for(pilot, lambda: boxes(app)[-1][1])
        # mid-answer the question is saved, and the answer as it streams (at most SAVE_EVERY_S behind)
        await wait_for(pilot, lambda: len(store.messages(app.conversation.id)) == 2)
        question, answer = HistoryStore(store.path).messages(app.conversation.id)
        assert question.content == "saved before the answer" and answer.stats["finish_reason"] == "partial"
        await wait_for(pilot, lambda: HistoryStore(store.path).messages(app.conversation.id)[1].content, 5)
        await pilot.press("escape")
        await idle(pilot)
        saved = store.messages(app.conversation.id)
        assert saved[1].stats["finish_reason"] == "cancelled" and saved[1].content == boxes(app)[-1][1]


async def test_history_screen_open_rename_delete(store):
    old = store.create("an old chat")
    store.add(old, "user", "old question")
    store.add(old, "assistant", "old answer", {"generated": 12})
    other = store.create("another chat")
    store.add(other, "user", "q")
    app = make_app(store)
    async with app.run_test(size=(110, 30)) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        screen = app.screen
        assert isinstance(screen, HistoryScreen)
        table = screen.query_one("DataTable")
        assert table.row_count == 2
        row = table.get_row(str(old))
        assert row[2] == "an old chat" and row[3:] == ["1", "12"] and row[1][:2] == "20"
        await pilot.press("down")  # the older one, listed second
        await pilot.press("r")
        assert isinstance(app.screen, TextPromptScreen)
        await pilot.press(*"renamed", "enter")  # the old title is selected: typing replaces it
        assert store.get(old).title == "renamed" and table.get_row(str(old))[2] == "renamed"
        await pilot.press("up", "d")
        assert isinstance(app.screen, ConfirmScreen) and "another chat" in app.screen.question
        await pilot.press("escape")  # not confirmed: kept
        assert table.row_count == 2 and store.get(other).title == "another chat"
        await pilot.press("d")
        await pilot.click("#confirm")
        await pilot.pause()
        assert table.row_count == 1 and [c.id for c in store.list()] == [old]
        await pilot.press("enter")
        await wait_for(pilot, lambda: boxes(app))
        assert not isinstance(app.screen, HistoryScreen) and app.conversation.id == old
        assert boxes(app) == [("user", "old question"), ("assistant", "old answer")]

        await pilot.press("f2")  # deleting the open conversation leaves a new, empty one
        await pilot.press("d")
        await pilot.click("#confirm")
        await pilot.pause()
        assert app.screen.query_one("#history-title").content == "No saved conversations yet"
        await pilot.press("escape")
        await pilot.pause()
        assert boxes(app) == [] and app.conversation.id is None and store.list() == []


@pytest.mark.parametrize("fault", ["locked", "read-only"])
async def test_history_faults_leave_the_chat_working_unsaved(tmp_path, monkeypatch, fault):
    monkeypatch.setattr(history, "LOCK_WAIT_S", 0.1)
    path = tmp_path / "history.sqlite3"
    HistoryStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    if fault == "locked":
        other.execute("BEGIN EXCLUSIVE")
    store = HistoryStore(path)
    if fault == "read-only":
        store._db.execute("PRAGMA query_only = ON")  # what a read-only file or medium gives (root ignores chmod)
    app = make_app(store)
    try:
        async with app.run_test() as pilot:
            await ready(pilot)
            await type_and_send(pilot, "hello")
            await idle(pilot)
            await type_and_send(pilot, "again")
            await idle(pilot)
            assert boxes(app)[-1] == ("assistant", ANSWER) and len(boxes(app)) == 4
            warnings = [n for n in notes(app) if "nothing is saved" in n]
            assert len(warnings) == 1 and ("locked" if fault == "locked" else "read-only") in warnings[0]
            assert "not saved" in app.sub_title
            await pilot.press("f2")
            assert not isinstance(app.screen, HistoryScreen)
    finally:
        other.rollback() if other.in_transaction else None
        other.close()


async def test_damaged_history_is_moved_aside_and_said(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    store = HistoryStore(path)
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        assert any("damaged" in n and "started a new one" in n for n in notes(app))
        await type_and_send(pilot, "hello")
        await idle(pilot)
    assert len(store.messages(app.conversation.id)) == 2
    assert len(list(tmp_path.glob("history.sqlite3.damaged-*"))) == 1


async def test_export_default_place_is_absolute(store, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        await type_and_send(pilot, "/export")
        files = list((tmp_path / "data" / "exports").glob("swiftspec-*.md"))
        assert len(files) == 1 and "## You\n\nhello" in files[0].read_text()
        assert any(f"Exported to {files[0]}" in n for n in notes(app)) and files[0].is_absolute()
        await type_and_send(pilot, "/export here.md")  # a relative name is shown resolved
        assert any(f"Exported to {tmp_path / 'here.md'}" in n for n in notes(app))


def _fake_tool(directory, name: str, body: str) -> None:
    tool = directory / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


async def test_copy_through_a_clipboard_tool_or_says_it_could_not(store, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        await pilot.press("ctrl+o")  # no tool at all: OSC 52 only, and said so
        await wait_for(pilot, lambda: any("Could not copy for sure" in n for n in notes(app)))
        assert any("no clipboard tool" in n for n in notes(app))
        _fake_tool(bin_dir, "xclip", "exit 1")
        await type_and_send(pilot, "/copy")
        await wait_for(pilot, lambda: any("xclip failed" in n for n in notes(app)))
        copied = tmp_path / "copied"
        _fake_tool(bin_dir, "xclip", f'/bin/cat > "{copied}"')  # PATH has only the fake tools
        await type_and_send(pilot, "/copy")
        await wait_for(pilot, lambda: any("Copied the last answer to the clipboard (xclip)" in n for n in notes(app)))
        assert copied.read_text() == ANSWER and app.clipboard == ANSWER


def test_no_copy_tool_is_tried_without_its_display(tmp_path, monkeypatch):
    from swiftspec.tui.clipboard import copy_with_tools

    _fake_tool(tmp_path, "wl-copy", "exit 0")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert copy_with_tools("x") == (None, None)
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    assert copy_with_tools("x") == ("wl-copy", None)


async def test_resumed_conversation_can_continue_its_cut_answer(store):
    conv = store.create("cut")
    store.add(conv, "user", "hi")
    store.add(conv, "assistant", ANSWER[:8], {"finish_reason": "length", "generated": 2})
    factory = FakeEngine.factory()
    app = resumed_app(store, conv, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/continue")
        await idle(pilot)
        assert boxes(app) == [("user", "hi"), ("assistant", ANSWER)]
    assert [m.content for m in store.messages(conv)] == ["hi", ANSWER]
    assert os.path.exists(store.path)


def test_readme_documents_every_slash_command_and_the_history_command():
    from pathlib import Path

    from swiftspec.tui.commands import SLASH_COMMANDS

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert all(f"`/{c.name}" in readme for c in SLASH_COMMANDS)
    for words in ("history list", "history show", "history export", "history delete", "--save", "F2",
                  "SWIFTSPEC_DATA_DIR", "exports/"):
        assert words in readme, words
    assert "DESIGN.md" not in readme


async def test_conversation_deleted_elsewhere_is_saved_anew(store):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "first")
        await idle(pilot)
        first = app.conversation.id
        other = HistoryStore(store.path)  # e.g. `swiftspec history delete` in another terminal
        other.delete(first)
        other.close()
        await type_and_send(pilot, "/save")  # says what happened instead of failing
        assert any(f"/save: no conversation with id {first}" in n for n in notes(app))
        await type_and_send(pilot, "second")
        await idle(pilot)
        assert app.conversation.id != first and any("deleted elsewhere" in n for n in notes(app))
    saved = store.messages(app.conversation.id)
    assert [m.content for m in saved] == ["first", ANSWER, "second", ANSWER]


async def test_an_edit_that_cannot_fit_keeps_the_turn_it_would_replace(store):
    factory = FakeEngine.factory(context_length=100)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "short")
        await idle(pilot)
        prompt = app.query_one(PromptInput)
        await pilot.press("up")
        prompt.insert(" much longer" * 60)
        await pilot.press("enter")
        await pilot.pause()
        assert any("more than the context" in n for n in notes(app))
        assert boxes(app) == [("user", "short"), ("assistant", ANSWER)] and len(store.messages(app.conversation.id)) == 2
        assert prompt.editing and prompt.text.startswith("short much longer")


async def test_a_refused_retry_keeps_the_answer_on_screen_and_saved(store):
    factory = FakeEngine.factory()
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        factory.started[0].refuse = "the workers are busy"
        await type_and_send(pilot, "/retry")
        await idle(pilot)
        assert any("the workers are busy" in n for n in notes(app))
        assert boxes(app) == [("user", "hello"), ("assistant", ANSWER)]
        assert [m.content for m in store.messages(app.conversation.id)] == ["hello", ANSWER]
        await type_and_send(pilot, "/max 5000")  # the retry no longer fits: refused before anything changes
        factory.started[0].refuse = None
        factory.started[0].info.context_length = 8  # room for the answer: half of it
        await type_and_send(pilot, "/retry")
        assert any("Does not fit" in str(n.title) for n in app._notifications)
        assert [m.content for m in store.messages(app.conversation.id)] == ["hello", ANSWER]


async def test_quitting_mid_answer_keeps_it_for_retry_and_continue(store):
    factory = FakeEngine.factory(step_delay=0.05, answer="word " * 200)
    app = make_app(store, factory)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "a long one")
        await wait_for(pilot, lambda: len(boxes(app)[-1][1]) > 20)
        await pilot.press("ctrl+q")
    (question, answer) = store.messages(app.conversation.id)
    assert answer.content and answer.stats["finish_reason"] == "cancelled"  # was: no answer saved at all
    again = resumed_app(store, app.conversation.id, FakeEngine.factory(answer="word " * 200))
    async with again.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/continue")
        await idle(pilot)
        assert boxes(again)[-1] == ("assistant", "word " * 200)
        await type_and_send(pilot, "/retry")
        await idle(pilot)
        assert not any("no answer to" in n for n in notes(again))
    assert [m.content for m in store.messages(app.conversation.id)] == ["a long one", "word " * 200]


async def test_settings_belong_to_the_conversation(store, tmp_path):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/temp 0.7")
        await type_and_send(pilot, "/system Be brief.")
        await type_and_send(pilot, "hello")
        await idle(pilot)
        first = app.conversation.id
        await type_and_send(pilot, "/new")  # was: the settings carried over
        assert app.conversation.params.temperature == 0.0 and app.conversation.settings.system is None
        assert "greedy" in app.sub_title
        await pilot.press("f2")
        await pilot.press("enter")  # the most recent: the first conversation
        await wait_for(pilot, lambda: boxes(app))
        assert app.conversation.id == first and app.conversation.params.temperature == 0.7
        assert app.conversation.settings.system == "Be brief." and "T0.7" in app.sub_title
        await type_and_send(pilot, "/system Be verbose.")  # set mid-chat: exported where it was set
        out = tmp_path / "chat.md"
        await type_and_send(pilot, f"/export {out}")
        exported = out.read_text()
        assert exported.index("Be brief.") < exported.index(ANSWER[:10]) < exported.index("Be verbose.")


async def test_clear_removes_the_conversation_from_the_history(store):
    app = make_app(store)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        await type_and_send(pilot, "/clear")
        await pilot.click("#confirm")
        await pilot.pause()
        assert boxes(app) == [] and store.list() == []  # was: listed under its old title with 0 turns


async def test_a_mode_the_engine_cannot_run_is_refused_and_not_offered(store):
    app = make_app(store, FakeEngine.factory(draft="none"), mode="ar")
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/mode sync")
        assert app.query_one(PromptInput).text == "/mode sync"  # refused: what was typed stays
        assert any("needs a draft" in n and "--mode sync" in n for n in notes(app))
        assert app.conversation.params.mode == "ar"
        offered = [c.title for c in app.get_system_commands(app.screen)]
        assert "Mode: ar" in offered and "Mode: sync" not in offered and "Mode: async" not in offered
        app.query_one(PromptInput).clear()
        await type_and_send(pilot, "hello")
        await idle(pilot)
        assert boxes(app)[-1] == ("assistant", ANSWER)


async def test_a_resumed_conversation_in_a_mode_the_engine_cannot_run_answers_in_ar(store):
    conversation = store.create("async chat", settings=SamplingParams(mode="async").to_dict())
    store.add(conversation, "user", "hi")
    store.add(conversation, "assistant", "hello", {"finish_reason": "eos"})
    app = resumed_app(store, conversation, FakeEngine.factory(draft="none"))
    async with app.run_test() as pilot:
        await ready(pilot)
        assert app.conversation.params.mode == "ar" and any("ar only" in n for n in notes(app))
