"""Scripted mode: prompts from stdin (or -p), the answer alone on stdout, figures on stderr.

Used when stdin or stdout is not a terminal, so ``swiftspec chat < q.txt > a.txt`` and pipelines work.
``--jsonl`` turns stdout into one JSON object per event, for programs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TextIO

from swiftspec import window
from swiftspec.config import SamplingParams, StepEvent
from swiftspec.engine.protocol import EngineAPI
from swiftspec.history import TurnRecorder, stats_line

EXIT_OK, EXIT_ENGINE, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a reader that went away


class InputError(ValueError):
    """Stdin cannot be used as prompts: not UTF-8, or nothing in it."""



def read_prompts(data: bytes, each_line: bool = False, prompt: str | None = None) -> list[str]:
    """Turns stdin into prompts; ``prompt`` (from -p) leads each one, stdin being its material."""
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise InputError(
            f"stdin is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
            "convert it first, e.g. with iconv -f latin1 -t utf-8"
        ) from None
    if each_line:
        pieces = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        pieces = [text.strip()] if text.strip() else []
    if prompt is not None and not prompt.strip():
        raise InputError("the prompt given with -p is empty")
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable argv bytes arrive as lone surrogates
            raise InputError(f"the prompt given with -p is not valid UTF-8 (character {e.start}); "
                             "check the terminal's locale") from None
    if prompt is None:
        if not pieces:
            raise InputError("empty input: pipe a prompt on stdin or pass -p PROMPT")
        return pieces
    return [f"{prompt}\n\n{piece}" for piece in pieces] or [prompt]


def run(
    engine: EngineAPI,
    prompts: Sequence[str],
    params: SamplingParams,
    *,
    system: str | None = None,
    context: Sequence[dict] = (),
    jsonl: bool = False,
    out: TextIO,
    err: TextIO,
    record: Callable[[str, str, dict | None], None] | None = None,
) -> int:
    """Answers each prompt independently (after ``context``, of which the oldest turns are left out if
    they no longer fit, as in the chat) and returns the exit code. ``record`` receives (role, text,
    figures) of each message as soon as it exists: the prompt before its answer, the answer after it.
    A prompt the engine refuses (e.g. too long) is reported and the others are still answered while the
    engine lives; a reader that closes stdout ends the run quietly (exit 141, as for SIGPIPE)."""
    try:
        return _answer_each(engine, prompts, params, system, context, jsonl, out, err, record)
    except BrokenPipeError:
        return EXIT_BROKEN_PIPE


def _answer_each(engine: EngineAPI, prompts: Sequence[str], params: SamplingParams, system: str | None,
                 context: Sequence[dict], jsonl: bool, out: TextIO, err: TextIO,
                 record: Callable[[str, str, dict | None], None] | None) -> int:
    failed = False
    for index, prompt in enumerate(prompts):
        head = [{"role": "system", "content": system}] if system else []
        conversation = list(context) + [{"role": "user", "content": prompt}]
        try:
            start = window.fit(conversation, 0, system, engine.count_tokens, engine.info.context_length,
                               params.max_new_tokens)
        except window.ContextError as e:
            if jsonl:
                _write_json(out, {"event": "error", "index": index, "message": str(e)})
            err.write(f"swiftspec: {e}\n")
            err.flush()
            return EXIT_USAGE
        if start:
            err.write(f"swiftspec: context full: left out the {window.turns_between(conversation, 0, start)} "
                      f"oldest of {window.turns_between(conversation, 0, len(conversation) - 1)} earlier turns\n")
            err.flush()
        if record is not None:
            record("user", prompt, None)
        recorder = TurnRecorder(params.mode)
        answer: list[str] = []
        try:
            for ev in engine.generate(head + conversation[start:], params):
                recorder.add(ev)
                answer.append(ev.text)
                _emit_token(ev, index, jsonl, out)
        except BrokenPipeError:
            raise
        except Exception as e:  # the engine cannot answer this prompt: report, exit 1 in the end
            message = str(e) or type(e).__name__
            if jsonl:
                _write_json(out, {"event": "error", "index": index, "message": message})
            err.write(f"swiftspec: engine error: {message}\n")
            err.flush()
            failed = True
            if engine.alive:
                continue
            return EXIT_ENGINE
        summary = recorder.summary()
        if record is not None:
            record("assistant", "".join(answer), summary)
        if jsonl:
            _write_json(out, {"event": "done", "index": index, "stats": summary,
                              "finish_reason": summary["finish_reason"]})
        else:
            out.write("\n")
            out.flush()
        err.write(f"[{stats_line(summary)}]\n")
        err.flush()
    return EXIT_ENGINE if failed else EXIT_OK


def _emit_token(ev: StepEvent, index: int, jsonl: bool, out: TextIO) -> None:
    if jsonl:
        if ev.token_ids or ev.text:
            _write_json(out, {"event": "token", "index": index, "text": ev.text, "token_ids": ev.token_ids})
    elif ev.text:
        out.write(ev.text)
        out.flush()


def _write_json(out: TextIO, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    out.flush()
