"""Slash commands: each an object with its name, arguments, help and handler, shared by the dispatcher,
/help, the README check and the palette."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from textual.app import SystemCommand
from textual.widgets.markdown import MarkdownFence

from swiftspec.conversation import Conversation, Kind, Settings
from swiftspec.engine.config import ConfigError
from swiftspec.history import HistoryError, HistoryStore, exports_dir, local_time
from swiftspec.tui import clipboard
from swiftspec.tui.dialogs import ConfirmScreen
from swiftspec.tui.sampling import listing, with_setting
from swiftspec.tui.widgets.chat_view import ChatView, turns
from swiftspec.tui.widgets.prompt_input import PromptInput


class ChatApp(Protocol):
    """What the commands use of the chat app (tui/app.py's SwiftSpecApp), so that they need not import it."""

    conversation: Conversation
    store: HistoryStore
    defaults: Settings

    async def answer(self, kind: Kind, text: str | None = None) -> bool: ...
    def idle(self, what: str) -> bool: ...
    def available_modes(self) -> tuple[str, ...]: ...
    async def show_conversation(self, conversation: Conversation | None = None) -> None: ...
    async def resume_conversation(self, conversation_id: int) -> None: ...
    def update_title(self) -> None: ...
    def action_stop(self) -> None: ...
    def action_copy_last(self) -> None: ...
    def action_toggle_stats(self) -> None: ...
    async def action_new_chat(self) -> None: ...
    def action_help(self) -> None: ...
    def action_history(self) -> None: ...
    # Textual's App
    def notify(self, message: str, **options: Any) -> None: ...
    def query_one(self, selector: Any) -> Any: ...
    def push_screen(self, screen: Any, callback: Any = None) -> Any: ...
    def exit(self, result: Any = None) -> None: ...


Handler = Callable[[ChatApp, str], Awaitable[bool]]  # (app, argument) -> whether to clear the input


class SlashCommand(NamedTuple):
    name: str
    args: str
    help: str
    run: Handler


async def run(app: ChatApp, text: str) -> bool:
    """Runs ``/name args``; returns whether it worked (the input is cleared only then)."""
    name, _, arg = text[1:].partition(" ")
    command = BY_NAME.get(name)
    if command is None:
        app.notify(f"Unknown command /{name} — /help lists them.", severity="error")
        return False
    try:
        return await command.run(app, arg.strip())
    except (ConfigError, OSError, HistoryError) as e:  # a bad argument, an unwritable file, a conversation
        app.notify(f"/{name}: {e}", severity="error", markup=False)  # deleted elsewhere
        return False


async def _help(app: ChatApp, arg: str) -> bool:
    app.action_help()
    return True


async def _history(app: ChatApp, arg: str) -> bool:
    app.action_history()
    return True


async def _continue(app: ChatApp, arg: str) -> bool:
    return await app.answer("continue")


async def _retry(app: ChatApp, arg: str) -> bool:
    return await app.answer("retry")


async def _edit(app: ChatApp, arg: str) -> bool:
    if not app.idle("edit"):
        return False
    prompt = app.query_one(PromptInput)
    if prompt.editable is None:
        app.notify("There is no message to edit.", severity="warning")
        return False
    prompt.start_edit(prompt.editable)
    return False  # the input now holds the message being edited: it must not be cleared


async def _clear(app: ChatApp, arg: str) -> bool:
    if not app.idle("clear"):
        return False
    conversation = app.conversation

    async def erase(yes: bool | None = True) -> None:
        if yes:
            conversation.clear()
            await app.show_conversation()
            app.notify("Conversation cleared.")

    if conversation.id is None or not app.store.available:
        await erase()
        return True
    app.push_screen(ConfirmScreen(f"Erase “{conversation.title}” from the screen and from the history? This "
                                  "cannot be undone.", "Erase"), erase)
    return True


async def _new(app: ChatApp, arg: str) -> bool:
    if not app.idle("start a new conversation"):
        return False
    await app.show_conversation(Conversation(app.store, app.defaults.copy()))
    app.notify("New conversation.")
    return True


async def _system(app: ChatApp, arg: str) -> bool:
    conversation = app.conversation
    if not arg:
        app.notify(f"System prompt: {conversation.settings.system or '(none)'}", markup=False)
        return True
    conversation.set_system(None if arg == "off" else arg)
    app.notify("System prompt removed." if conversation.settings.system is None else
               "System prompt set (for the next answers).")
    return True


def _setter(name: str) -> Handler:
    async def set_one(app: ChatApp, arg: str) -> bool:
        return _apply(app, name, arg)

    return set_one


async def _set(app: ChatApp, arg: str) -> bool:
    if not arg:
        app.notify(listing(app.conversation.params), title="Settings (/set NAME VALUE)", markup=False, timeout=15)
        return True
    name, _, value = arg.partition(" ")
    return _apply(app, name, value)


def _apply(app: ChatApp, name: str, value: str) -> bool:
    """One setting of this conversation; a mode this engine cannot run is refused here, with the reason."""
    params = with_setting(app.conversation.params, name, value)
    if params.mode not in app.available_modes():
        raise ConfigError(f"mode {params.mode} needs a draft, and this engine was started without one "
                          f"(--mode ar): start swiftspec again with --mode {params.mode}")
    app.conversation.set_params(params)
    app.update_title()
    app.notify(f"{name.replace('_', '-')} = {value or '(default)'}", markup=False)
    return True


async def _save(app: ChatApp, arg: str) -> bool:
    conversation = app.conversation
    if app.store.problem:
        app.notify(f"Cannot save: {app.store.problem}", severity="error", markup=False)
        return False
    if conversation.id is None:
        app.notify("Nothing to save yet: send a message first.", severity="warning")
        return False
    title = app.store.get(conversation.id).title  # HistoryError when it was deleted elsewhere
    if arg:
        conversation.rename(arg)
        title = conversation.title
    app.notify(f"Saved as #{conversation.id}: {title} (swiftspec chat --resume {conversation.id})", markup=False)
    return True


async def _export(app: ChatApp, arg: str) -> bool:
    conversation = app.conversation
    if not conversation.messages:
        app.notify("Nothing to export yet.", severity="warning")
        return False
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default = exports_dir() / f"swiftspec-{conversation.id or 'unsaved'}-{stamp}.md"
    path = (Path(arg).expanduser() if arg else default).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(conversation.to_markdown(), encoding="utf-8")
    app.notify(f"Exported to {path}", markup=False, timeout=10)
    return True


async def _copy(app: ChatApp, arg: str) -> bool:
    if not arg:
        app.action_copy_last()
        return True
    answers = [b for b in app.query_one(ChatView).messages if b.role == "assistant"]
    blocks = [fence.code for fence in answers[-1].query(MarkdownFence)] if answers else []
    if not arg.isdigit() or not 1 <= int(arg) <= len(blocks):
        raise ConfigError(f"the last answer has {len(blocks)} code block(s): /copy 1 .. /copy {len(blocks)}"
                          if blocks else "the last answer has no code block")
    clipboard.copy(app, blocks[int(arg) - 1], "the code block")
    return True


async def _quit(app: ChatApp, arg: str) -> bool:
    app.exit(0)
    return True


SLASH_COMMANDS = [
    SlashCommand("help", "", "show commands and keys", _help),
    SlashCommand("continue", "", "go on with the last answer where the token limit, the context, the loop "
                 "guard, a stop or a failure cut it", _continue),
    SlashCommand("retry", "", "write the last answer again (a new seed when sampling; greedy repeats itself)",
                 _retry),
    SlashCommand("edit", "", "edit your last message (as ↑ on an empty input); sending it re-runs from there",
                 _edit),
    SlashCommand("history", "", "saved conversations: open, rename, delete (F2)", _history),
    SlashCommand("clear", "", "erase this conversation (screen, context and history; asks first)", _clear),
    SlashCommand("new", "", "start a new conversation with the session's settings; this one stays saved", _new),
    SlashCommand("system", "[TEXT]", "show or set the system prompt (`/system off` removes it)", _system),
    SlashCommand("set", "[NAME VALUE]", "show every sampling setting, or set one: `/set top-p 0.9`", _set),
    SlashCommand("mode", "MODE", "decoding mode for the next answers: async, sync or ar", _setter("mode")),
    SlashCommand("temp", "T", "temperature (0 = greedy)", _setter("temperature")),
    SlashCommand("max", "N", "most new tokens per answer", _setter("max_new_tokens")),
    SlashCommand("save", "[TITLE]", "name the saved conversation", _save),
    SlashCommand("export", "[FILE.md]", "write the conversation as Markdown (default: the exports folder)",
                 _export),
    SlashCommand("copy", "[N]", "copy the last answer, or its N-th code block (a click on a block copies it)",
                 _copy),
    SlashCommand("quit", "", "leave", _quit),
]
BY_NAME = {c.name: c for c in SLASH_COMMANDS}

KEYS = [
    ("enter", "send"),
    ("ctrl+j / shift+enter", "new line"),
    ("↑ on an empty input", "edit your last message (esc cancels); ↑ again goes to earlier prompts"),
    ("↑ / ↓", "earlier prompts (from the first / last line)"),
    ("esc / ctrl+c", "stop the answer"),
    ("ctrl+o", "copy the last answer (a click on a code block copies that block)"),
    ("ctrl+n", "new conversation"),
    ("f2", "saved conversations (enter opens, r renames, d deletes)"),
    ("f3", "show or hide the stats panel"),
    ("ctrl+p", "command palette (continue, retry, resume a saved conversation, theme …)"),
    ("f1", "this help"),
    ("ctrl+q", "quit"),
]


def palette(app: ChatApp) -> Iterator[SystemCommand]:
    """The command palette's own entries (besides Textual's: theme, screenshot, quit)."""
    yield SystemCommand("New conversation", "Start afresh; this one stays saved", app.action_new_chat)
    yield SystemCommand("History", "Saved conversations: open, rename, delete (F2)", app.action_history)
    yield SystemCommand("Stop the answer", "Cancel the answer being generated (Esc)", app.action_stop)
    yield SystemCommand("Continue the answer", "Go on where the last answer was cut (/continue)",
                        partial(run, app, "/continue"))
    yield SystemCommand("Retry the answer", "Write the last answer again (/retry)", partial(run, app, "/retry"))
    yield SystemCommand("Copy last answer", "To the clipboard", app.action_copy_last)
    yield SystemCommand("Show or hide the stats", "The live stats panel (F3)", app.action_toggle_stats)
    yield SystemCommand("Export to Markdown", "Write this conversation to a .md file", partial(run, app, "/export"))
    yield SystemCommand("Help", "Slash commands and keys", app.action_help)
    for mode in app.available_modes():  # only what this engine can run
        yield SystemCommand(f"Mode: {mode}", "Decoding mode for the next answers", partial(run, app, f"/mode {mode}"))
    for conv in app.store.list(20):
        yield SystemCommand(f"Resume #{conv.id}: {conv.title}", f"Saved {local_time(conv.updated)}, "
                            f"{turns(conv.turns)}", partial(app.resume_conversation, conv.id), discover=False)


def help_markdown() -> str:
    lines = ["## Commands", ""]
    lines += [f"- `/{c.name}{' ' + c.args if c.args else ''}` — {c.help}" for c in SLASH_COMMANDS]
    lines += ["", "## Keys", ""]
    lines += [f"- `{key}` — {what}" for key, what in KEYS]
    return "\n".join(lines)
