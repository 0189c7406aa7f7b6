"""``swiftspec bench``: decoding modes and peers side by side, on the same prompts, in one run.

Each prompt is decoded by every mode before the next prompt starts, and the mode order rotates from one
prompt to the next, so that drift of a shared machine hits all modes alike. Ratios are only meaningful
within one run; absolute figures are not comparable across runs.

Fairness rules, applied to every mode: the same decoding settings (greedy unless a temperature is
given), the same chat-templated prompt ids, the same ``max_new_tokens``, generation stops at EOS (the EOS
token itself is not counted), and tokens/s is total generated tokens / total wall time from request to
last token over all prompts. A speedup is the ratio of two modes' tokens/s, in the table, the JSON and
the plot alike.

Modules, each importing only those above it: ``prompts`` (the prompt sets, ``BenchError``), ``runners``
(the modes and the interleaved run), ``llamacpp`` (the llama.cpp peer, in a process of its own),
``report`` (figures, tables, JSON, plot) and ``command`` (``bench_command``, the command itself).
"""

from swiftspec.bench.command import bench_command
from swiftspec.bench.prompts import BenchError, parse_jsonl

__all__ = ["BenchError", "bench_command", "parse_jsonl"]
