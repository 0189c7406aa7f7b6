"""Pilot tests of what the chat shows staying true and in view (FakeEngine), at 100 and 230 columns:
notifications never over the live figures or the input, /help titled and fitting 45 rows, /retry's notice
true for the answer it replaces, a continued message's whole token count, a refused command kept selected,
the Layout box uncut and widening with the terminal."""

from __future__ import annotations

import pytest
from fake_engine import INFO
from helpers.pilot import make_app, notes, ready, send_each, text_of, type_and_send

from swiftspec.tui.screens import HelpScreen
from swiftspec.tui.widgets.chat_view import ChatView
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.prompt_input import PromptInput
from swiftspec.tui.widgets.stats_panel import StatsPanel

WIDTHS = [100, 230]


@pytest.mark.parametrize("width", WIDTHS)
async def test_notifications_never_cover_the_live_figures_or_the_input(store, width):
    from textual.widgets._toast import Toast

    app = make_app(store)
    async with app.run_test(size=(width, 40), notifications=True) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "/set")  # the longest notification: every setting in force
        for i in range(3):
            app.notify(f"notice {i} " + "word " * 20, timeout=30)
        await pilot.pause(0.3)
        toasts = list(app.screen.query(Toast))
        shown = [app.screen.find_widget(t) for t in toasts]
        shown = [geometry.region.intersection(geometry.clip) for geometry in shown]  # what is in view
        assert len(toasts) == 4 and shown[-1].area  # the newest in view
        panel, prompt = app.query_one(StatsPanel).region, app.query_one(PromptInput).region
        assert not any(region.overlaps(panel) or region.overlaps(prompt) for region in shown), shown


@pytest.mark.parametrize("width", WIDTHS)
async def test_help_has_a_title_says_how_to_close_and_fits_45_rows(store, width):
    app = make_app(store)
    async with app.run_test(size=(width, 45)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        await pilot.pause(0.2)
        box = app.screen.query_one("#help-box")
        assert isinstance(app.screen, HelpScreen)
        assert box.border_title == "SwiftSpec help" and "Esc" in box.border_subtitle
        assert box.max_scroll_y == 0 and box.region.height <= 45  # the Keys section needs no scrolling
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_the_retry_notice_is_true_for_the_answer_it_replaces(store):
    app = make_app(store, temperature=0.7)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send_each(pilot, "hi", "/temp 0", "/retry")  # replaces an answer sampled at 0.7: may differ
        assert any(n.startswith("Retrying greedily") for n in notes(app))
        assert not any("same answer again" in n for n in notes(app))
        await send_each(pilot, "/retry")  # replaces a greedy answer: the same one comes back
        assert any("same answer again" in n for n in notes(app))


async def test_a_continued_message_counts_all_its_tokens(store):
    app = make_app(store, max_new_tokens=5)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await send_each(pilot, "hi", "/continue")
        box = app.query_one(ChatView).query(MessageBox).last()
        assert box.border_subtitle.split(" · ")[1] == "10 tok"  # 5 + 5, not the continued part's 5
        assert app.conversation.messages[-1].stats["generated"] == 10
        assert store.messages(app.conversation.id)[-1].stats["generated"] == 10


async def test_a_refused_command_stays_selected_so_that_typing_replaces_it(store):
    app = make_app(store)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        await type_and_send(pilot, "/mode bogus")
        assert prompt.text == "/mode bogus" and prompt.selected_text == "/mode bogus"
        await pilot.press(*"/temp 0")
        assert prompt.text == "/temp 0"  # was: "/mode bogus/temp 0"
        await pilot.press("enter")
        assert prompt.text == "" and app.conversation.params.temperature == 0


@pytest.mark.parametrize("width", WIDTHS)
async def test_the_layout_box_shows_everything_and_widens_with_the_terminal(store, width):
    app = make_app(store)
    async with app.run_test(size=(width, 40)) as pilot:
        await ready(pilot)
        layout = text_of(app.query_one(StatsPanel).query_one("#layout"))
        assert "…" not in layout
        words = " ".join(layout.split())
        assert INFO.target in words or INFO.target.replace(" ", "") in words.replace(" ", "")
        assert "r0 cpu · kernel threads ar 2, sync 2, async 1" in words  # by mode, as profiling chose them
        assert "r1 cpu · 1 thread" in words
        assert app.title == INFO.target  # the title bar names what runs
        assert app.query_one(StatsPanel).region.width == (30 if width < 120 else 56)
