"""Copying through the system clipboard tools, which, unlike the terminal's OSC 52, say whether it worked."""

from __future__ import annotations

import os
import shutil
import subprocess

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
