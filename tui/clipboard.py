"""Copying through the system clipboard tools, which, unlike the terminal's OSC 52, say whether it worked."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from swiftspec.tui.messages import CopyDone

if TYPE_CHECKING:
    from textual.app import App

# (tool, its arguments, the environment variable without which it cannot reach a clipboard)
TOOLS = [
    ("wl-copy", [], "WAYLAND_DISPLAY"),
    ("xclip", ["-selection", "clipboard"], "DISPLAY"),
    ("pbcopy", [], None),
]
TIMEOUT_S = 3.0


def copy_with_tools(text: str) -> tuple[str | None, str | None]:
    """Tries each usable tool in turn; returns (the tool that took the text, None), or (None, why the
    tools that were tried failed; None when there was none to try)."""
    failures = []
    for name, args, needs in TOOLS:
        exe = shutil.which(name)
        if exe is None or (needs is not None and not os.environ.get(needs)):
            continue
        try:
            # Output to /dev/null: xclip and wl-copy leave a child serving the clipboard, which must not
            # hold pipes that we would wait on.
            subprocess.run([exe, *args], input=text.encode(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=TIMEOUT_S, check=True)
            return name, None
        except (OSError, subprocess.SubprocessError) as e:
            failures.append(f"{name} failed ({e})")
    return None, "; ".join(failures) or None


def copy(app: App, text: str, what: str) -> None:
    """OSC 52 through the terminal, and the system clipboard tool where there is one (in a thread, posting
    CopyDone): only a tool can confirm that the text arrived, so only then does the notice say "copied"."""
    app.copy_to_clipboard(text)
    app.run_worker(lambda: app.post_message(CopyDone(what, *copy_with_tools(text))), thread=True, group="clipboard")


def report(app: App, done: CopyDone) -> None:
    if done.tool is not None:
        app.notify(f"Copied {done.what} to the clipboard ({done.tool}).")
        return
    why = f"{done.error}; " if done.error else "no clipboard tool (wl-copy, xclip, pbcopy) found; "
    app.notify(f"Could not copy for sure: {why}{done.what} was sent to the terminal (OSC 52), which copies it "
               "only if the terminal supports that.", severity="warning", markup=False, timeout=10)
