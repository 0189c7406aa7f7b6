"""Slash commands: their names, arguments and help, shared by the dispatcher, /help and the palette."""

from __future__ import annotations

from typing import NamedTuple


class SlashCommand(NamedTuple):
    name: str
    args: str
    help: str


SLASH_COMMANDS = [
    SlashCommand("help", "", "show commands and keys"),
    SlashCommand("continue", "", "go on with the last answer where the token limit, the context, the loop guard or Esc cut it"),
    SlashCommand("retry", "", "write the last answer again (a new seed when sampling; greedy repeats itself)"),
    SlashCommand("edit", "", "edit your last message (as ↑ on an empty input); sending it re-runs from there"),
    SlashCommand("history", "", "saved conversations: open, rename, delete (F2)"),
    SlashCommand("clear", "", "erase this conversation's messages (screen, context and saved copy; asks first)"),
    SlashCommand("new", "", "start a new conversation; this one stays saved"),
    SlashCommand("system", "[TEXT]", "show or set the system prompt (`/system off` removes it)"),
    SlashCommand("mode", "MODE", "decoding mode for the next answers: async, sync or ar"),
    SlashCommand("temp", "T", "temperature (0 = greedy)"),
    SlashCommand("max", "N", "most new tokens per answer"),
    SlashCommand("save", "[TITLE]", "name the saved conversation"),
    SlashCommand("export", "[FILE.md]", "write the conversation as Markdown (default: the exports folder)"),
    SlashCommand("copy", "", "copy the last answer (wl-copy, xclip or pbcopy, and OSC 52)"),
    SlashCommand("quit", "", "leave"),
]
NAMES = {c.name for c in SLASH_COMMANDS}

KEYS = [
    ("enter", "send"),
    ("ctrl+j / shift+enter", "new line"),
    ("↑ on an empty input", "edit your last message (esc cancels); ↑ again goes to earlier prompts"),
    ("↑ / ↓", "earlier prompts (from the first / last line)"),
    ("esc", "stop the answer"),
    ("ctrl+o", "copy the last answer"),
    ("ctrl+n", "new conversation"),
    ("f2", "saved conversations (enter opens, r renames, d deletes)"),
    ("ctrl+p", "command palette (continue, retry, resume a saved conversation …)"),
    ("f1", "this help"),
    ("ctrl+q", "quit"),
]


def help_markdown() -> str:
    lines = ["## Commands", ""]
    lines += [f"- `/{c.name}{' ' + c.args if c.args else ''}` — {c.help}" for c in SLASH_COMMANDS]
    lines += ["", "## Keys", ""]
    lines += [f"- `{key}` — {what}" for key, what in KEYS]
    return "\n".join(lines)
