"""``swiftspec history``: the saved conversations listed, shown, deleted and exported (swiftspec.history
keeps them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from swiftspec.cli.options import app, complete_choices, exit_with
from swiftspec.cli.usage import CommandLine, choice, whole_number

history_app = CommandLine(
    help="Saved conversations (kept in SWIFTSPEC_DATA_DIR, default the user data dir; "
    "`swiftspec history list` prints where).",
    no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(history_app, name="history")


def _history_store():
    """The store, or exit 1 saying why it cannot be read."""
    from swiftspec.history import HistoryStore  # sqlite3: --help imports none of it

    store = HistoryStore()
    if store.notice:
        typer.echo(f"swiftspec: {store.notice}", err=True)
    if store.problem:
        raise exit_with(store.problem, 1)
    return store


def _conversation(store, conversation_id: int):
    """The conversation an ID argument names."""
    from swiftspec.history import HistoryError  # sqlite3: --help imports none of it

    try:
        return store.get(conversation_id)
    except HistoryError as e:
        raise exit_with(str(e), 2) from None


def _confirm(question: str) -> bool:
    """A y/N question on stderr; anything but y or yes, end of input included, is a no."""
    typer.echo(f"{question} [y/N]: ", err=True, nl=False)
    answer = sys.stdin.readline()
    if not answer.endswith("\n"):
        typer.echo(err=True)  # end of input: the next line starts on a line of its own
    return answer.strip().lower() in ("y", "yes")


IdArg = Annotated[int, typer.Argument(
    metavar="ID", parser=whole_number(1, meaning="a conversation id, as swiftspec history list shows them"),
    show_default=False, help="The conversation's id.")]


@history_app.command("list")
def history_list(
    limit: Annotated[int, typer.Option("--limit", "-n", parser=whole_number(1), metavar="N",
                                       help="At most N, newest first.")] = 50,
) -> None:
    """List saved conversations: id, date, turns, tokens generated, title."""
    from swiftspec.history import local_time  # sqlite3: --help imports none of it

    store = _history_store()
    conversations = store.list(limit)
    if not conversations:
        typer.echo(f"No saved conversations in {store.path}")
        return
    typer.echo(f"{'ID':>5}  {'UPDATED':<16}  {'TURNS':>5}  {'TOKENS':>6}  TITLE")
    for c in conversations:
        typer.echo(f"{c.id:>5}  {local_time(c.updated):<16}  {c.turns:>5}  {c.tokens:>6}  {c.title}")
    typer.echo(f"({store.path})", err=True)


@history_app.command("show")
def history_show(conversation_id: IdArg) -> None:
    """Print a conversation as Markdown."""
    store = _history_store()
    typer.echo(store.export_markdown(_conversation(store, conversation_id).id), nl=False)


@history_app.command("delete")
def history_delete(
    conversation_id: IdArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete a conversation and its messages (asks first, unless --yes; declining keeps it, exit 0)."""
    store = _history_store()
    conv = _conversation(store, conversation_id)
    if not yes and not _confirm(f"Delete #{conv.id} “{conv.title}” ({conv.turns} turns)?"):
        typer.echo(f"Kept #{conv.id}: {conv.title}", err=True)
        return
    store.delete(conv.id)
    if store.problem:
        raise exit_with(store.problem, 1)
    typer.echo(f"Deleted #{conv.id}: {conv.title}", err=True)


@history_app.command("export")
def history_export(
    conversation_id: IdArg,
    format_: Annotated[str, typer.Option(
        "--format", "-f", parser=choice(("md", "json"), "format"), metavar="FORMAT", autocompletion=complete_choices("md", "json"),
        help="md (Markdown) or json.")] = "md",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Write to FILE instead of stdout.")] = None,
) -> None:
    """Export a conversation as Markdown or JSON (with each answer's figures)."""
    store = _history_store()
    conversation_id = _conversation(store, conversation_id).id
    text = store.export_json(conversation_id) if format_ == "json" else store.export_markdown(conversation_id)
    if output is None:
        typer.echo(text, nl=False)
        return
    path = output.expanduser().resolve()
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise exit_with(f"cannot write {path}: {e}", 1) from None
    typer.echo(f"Exported #{conversation_id} to {path}", err=True)
