"""Slash commands: their names, arguments and help, shared by the dispatcher, /help and the palette."""

from __future__ import annotations

from typing import NamedTuple


class SlashCommand(NamedTuple):
    name: str
    args: str
    help: str


SLASH_COMMANDS = [
    SlashCommand("help", "", "show commands and keys"),
    SlashCommand("clear", "", "erase this conversation's messages (screen, context and saved copy)"),
    SlashCommand("new", "", "start a new conversation; this one stays saved"),
    SlashCommand("system", "[TEXT]", "show or set the system prompt (`/system off` removes it)"),
    SlashCommand("mode", "MODE", "decoding mode for the next answers: async, sync or ar"),
    SlashCommand("temp", "T", "temperature (0 = greedy)"),
    SlashCommand("max", "N", "most new tokens per answer"),
    SlashCommand("save", "[TITLE]", "name the saved conversation"),
    SlashCommand("export", "[FILE.md]", "write the conversation as Markdown"),
    SlashCommand("copy", "", "copy the last answer to the clipboard (OSC 52)"),
    SlashCommand("quit", "", "leave"),
]
NAMES = {c.name for c in SLASH_COMMANDS}

KEYS = [
    ("enter", "send"),
    ("ctrl+j / shift+enter", "new line"),
    ("↑ / ↓", "earlier prompts (from the first / last line)"),
    ("esc", "stop the answer"),
    ("ctrl+o", "copy the last answer"),
    ("ctrl+n", "new conversation"),
    ("ctrl+p", "command palette (resume a saved conversation there)"),
    ("f1", "this help"),
    ("ctrl+q", "quit"),
]


def help_markdown() -> str:
    lines = ["## Commands", ""]
    lines += [f"- `/{c.name}{' ' + c.args if c.args else ''}` — {c.help}" for c in SLASH_COMMANDS]
    lines += ["", "## Keys", ""]
    lines += [f"- `{key}` — {what}" for key, what in KEYS]
    return "\n".join(lines)
