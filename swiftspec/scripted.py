"""Scripted mode: prompts from stdin (or -p), the answer alone on stdout, figures on stderr.

Used when stdin or stdout is not a terminal, so ``swiftspec chat < q.txt > a.txt`` and pipelines work.
``--jsonl`` turns stdout into one JSON object per event, for programs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from swiftspec import window
from swiftspec.conversation import Conversation, Reply
from swiftspec.engine.events import StepEvent
from swiftspec.engine.host.answer import AnswerSummary
from swiftspec.engine.host.protocol import EngineAPI

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


def run(engine: EngineAPI, prompts: Sequence[str], conversation: Conversation, *, jsonl: bool = False,
        quiet: bool = False, out: TextIO, err: TextIO) -> int:
    """Answers each prompt after ``conversation`` (of which the oldest turns are left out if they no longer
    fit, as in the chat) and returns the exit code. A conversation that is saved (--save, --resume) takes
    the prompts as its next turns, saved as they stream; otherwise each prompt is answered on its own.
    A prompt the engine refuses is reported and the others are still answered while the engine lives; a
    reader that closes stdout ends the run quietly (exit 141, as for SIGPIPE). Ctrl-C ends the answer's
    line and prints its figures so far, marked interrupted, then is raised again (exit 130 for the caller)."""
    try:
        return _answer_each(engine, prompts, conversation, jsonl, quiet, out, err)
    except BrokenPipeError:
        return EXIT_BROKEN_PIPE


def _answer_each(engine: EngineAPI, prompts: Sequence[str], conversation: Conversation, jsonl: bool, quiet: bool,
                 out: TextIO, err: TextIO) -> int:
    failed = False
    alone = conversation.store is None
    base, base_start = list(conversation.messages), conversation.window_start
    eos = set(engine.info.eos_token_ids)
    for index, prompt in enumerate(prompts):
        if alone:
            conversation.messages, conversation.window_start = list(base), base_start
        try:
            plan = conversation.plan("ask", window.Context.of(engine), prompt)
        except window.ContextError as e:
            if jsonl:
                _write_json(out, {"event": "error", "index": index, "message": str(e)})
            _say(err, str(e))
            return EXIT_USAGE
        if plan.left_out:
            _say(err, f"context full: left out the {plan.earlier + 1 - plan.kept} oldest of {plan.earlier} "
                      "earlier turns")
        if index and not jsonl:
            out.write("\n")  # a blank line between answers
        reply = Reply(plan)
        try:
            conversation.run(reply, engine, on_event=lambda ev, i=index: _emit_token(ev, i, eos, jsonl, out))
        except KeyboardInterrupt:
            _interrupted(reply.answer.stats if reply.answer else None, index, jsonl, quiet, out, err)
            raise
        for warning in conversation.take_warnings():
            _say(err, warning)
        if reply.error is not None:  # the engine cannot answer this prompt: report, exit 1 in the end
            if jsonl:
                _write_json(out, {"event": "error", "index": index, "message": reply.error})
            _say(err, f"engine error: {reply.error}")
            failed = True
            if engine.alive:
                continue
            return EXIT_ENGINE
        summary = reply.answer.stats
        if jsonl:
            _write_json(out, {"event": "done", "index": index, "stats": summary,
                              "finish_reason": summary["finish_reason"]})
        else:
            out.write("\n")
            out.flush()
        if not quiet:
            err.write(f"[{AnswerSummary.from_dict(summary).line()}]\n")
            err.flush()
    return EXIT_ENGINE if failed else EXIT_OK


def _interrupted(stats: dict | None, index: int, jsonl: bool, quiet: bool, out: TextIO, err: TextIO) -> None:
    """Ctrl-C mid-answer: the answer's line ended (or its done event, finish reason "cancelled"), and on
    stderr its figures so far, marked interrupted."""
    summary = AnswerSummary.from_dict(stats or {})
    if jsonl:
        _write_json(out, {"event": "done", "index": index, "stats": stats or {}, "finish_reason": "cancelled"})
    elif summary.stats.generated:
        out.write("\n")
        out.flush()
    if not quiet:
        summary.finish_reason = "interrupted"
        err.write(f"[{summary.line()}]\n")
        err.flush()


def _say(err: TextIO, line: str) -> None:
    err.write(f"swiftspec: {line}\n")
    err.flush()


def _emit_token(ev: StepEvent, index: int, eos: set[int], jsonl: bool, out: TextIO) -> None:
    """The answer's tokens; the EOS that ended it is no token of the answer (the done event says "eos")."""
    if jsonl:
        ids = [t for t in ev.token_ids if t not in eos] if ev.finish_reason == "eos" else ev.token_ids
        if ids or ev.text:
            _write_json(out, {"event": "token", "index": index, "text": ev.text, "token_ids": ids})
    elif ev.text:
        out.write(ev.text)
        out.flush()


def _write_json(out: TextIO, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    out.flush()
