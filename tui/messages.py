"""The app's own messages: from its thread workers (engine start, answers, clipboard) and its widgets."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from swiftspec.conversation import Reply
from swiftspec.tui.stream import AnswerBuffer
from swiftspec.tui.widgets.message import MessageBox
from swiftspec.tui.widgets.notice import Notice


@dataclass
class EngineProgress(Message):
    text: str


class EngineReady(Message):
    pass


@dataclass
class EngineFailed(Message):
    cause: str


@dataclass
class Turn:
    """An answer on screen: its boxes, while the engine has not yet accepted it, are only proposed."""

    reply: Reply
    box: MessageBox  # the answer's (for /continue: the answer that grows)
    question: MessageBox | None  # the question's, for ask and edit
    buffer: AnswerBuffer
    edited: str | None = None  # the message an edit replaces
    notice: Notice | None = None  # the "turns left out" notice it added
    stop: bool = False  # Esc was pressed: told to the engine again once it has taken the request


@dataclass
class AnswerAccepted(Message):
    turn: Turn


@dataclass
class AnswerDone(Message):
    turn: Turn


@dataclass
class CopyDone(Message):
    what: str  # "the last answer", "the code block"
    tool: str | None  # the clipboard tool that took the text, if any
    error: str | None  # why the tools that were tried failed
