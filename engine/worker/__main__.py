"""``python -m swiftspec.engine.worker``: the entry point torchrun starts on every rank."""

from swiftspec.engine.host.lifeline import die_with_launcher

die_with_launcher()  # first thing: importing torch takes seconds (see lifeline)

import os  # noqa: E402
import sys  # noqa: E402

from swiftspec.engine.worker.serve import main  # noqa: E402

code = main()
# A clean end skips the interpreter's teardown of torch (which the Engine's close would wait for):
# the process group is destroyed, the leader's socket flushed, and nothing else is left to write.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
