"""``swiftspec cache``: what the cache holds, and clearing it (swiftspec.cache knows its entries)."""

from __future__ import annotations

from typing import Annotated

import typer

from swiftspec.cli.options import app, exit_with
from swiftspec.cli.usage import CommandLine
from swiftspec.engine.paths import cache_dir

cache_app = CommandLine(help="What the cache holds (converted GGUF models, profiled step times, logs of "
                        "failed workers) and its size; clear it to free the space.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def cache_list() -> None:
    """List the cache's entries with their sizes."""
    from swiftspec.cache import entries, human_size  # the GGUF reader: --help imports none of it
    found = entries()
    typer.echo(f"{cache_dir()} (SWIFTSPEC_CACHE moves it)")
    width = max((len(e.name) for e in found), default=0)
    for e in found:
        typer.echo(f"  {human_size(e.size):>9}  {e.name:<{width}}  {e.what}")
    typer.echo(f"  {human_size(sum(e.size for e in found)):>9}  in all")


@cache_app.command("clear")
def cache_clear(
    name: Annotated[str | None, typer.Argument(
        metavar="NAME", show_default=False, help="The entry to remove, as cache list names it. Default: all.")] = None,
) -> None:
    """Remove one cache entry, or all of them. A converted model is converted again when next used."""
    from swiftspec.cache import CacheError, clear, human_size  # the GGUF reader: --help imports none of it

    try:
        removed = clear(name)
    except CacheError as e:
        raise exit_with(str(e), 2) from None
    for e in removed:
        typer.echo(f"removed {e.name} ({human_size(e.size)})")
    typer.echo(f"freed {human_size(sum(e.size for e in removed))}")
