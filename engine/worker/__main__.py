"""``python -m swiftspec.engine.worker``: the entry point torchrun starts on every rank."""

from swiftspec.engine.lifeline import die_with_launcher

die_with_launcher()  # first thing: importing torch takes seconds (see lifeline)

import sys  # noqa: E402

from swiftspec.engine.worker.serve import main  # noqa: E402

sys.exit(main())
