"""``swiftspec history``: the saved conversations listed, shown, deleted and exported (swiftspec.history
keeps them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from swiftspec.cli.options import app, complete_choices, exit_with

history_app = typer.Typer(
    help="Saved conversations (kept in SWIFTSPEC_DATA_DIR, default the user data dir; "
    "`swiftspec history list` prints where).",
    no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(history_app, name="history")


def _history_store():
    """The store, or exit 1 saying why it cannot be read."""
    from swiftspec.history import HistoryStore

    store = HistoryStore()
    if store.notice:
        typer.echo(f"swiftspec: {store.notice}", err=True)
    if store.problem:
        raise exit_with(store.problem, 1)
    return store


def _conversation(store, conversation_id: str):
    """The conversation an ID argument names (taken as text, so that a bad one gets our one-line error)."""
    from swiftspec.history import HistoryError

    try:
        return store.get(int(conversation_id))
    except ValueError:
        raise exit_with(f"a conversation id is a number (swiftspec history list shows them), not {conversation_id!r}",
                    2) from None
    except HistoryError as e:
        raise exit_with(str(e), 2) from None


IdArg = Annotated[str, typer.Argument(metavar="ID", show_default=False, help="The conversation's id.")]


@history_app.command("list")
def history_list(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most N, newest first.")] = 50,
) -> None:
    """List saved conversations: id, date, turns, tokens generated, title."""
    from swiftspec.history import local_time

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
    if not yes and not typer.confirm(f"Delete #{conv.id} “{conv.title}” ({conv.turns} turns)?", err=True):
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
        "--format", "-f", metavar="FORMAT", autocompletion=complete_choices("md", "json"),
        help="md (Markdown) or json.")] = "md",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="Write to FILE instead of stdout.")] = None,
) -> None:
    """Export a conversation as Markdown or JSON (with each answer's figures)."""
    store = _history_store()
    conversation_id = _conversation(store, conversation_id).id
    if format_ not in ("md", "json"):
        raise exit_with(f"format must be md or json, not {format_!r}", 2)
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
