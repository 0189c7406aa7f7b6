"""Incremental detokenization that only ever emits complete text.

A byte-level BPE token can end in the middle of a UTF-8 character (emoji, CJK); decoding it alone
gives U+FFFD. We decode a small window ending at the newest token and hold the text back while it ends
in U+FFFD, so the concatenation of the streamed deltas equals the final decoded text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self) -> str:
        return self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        delta = self._delta()
        if not delta or delta.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. a final, genuinely incomplete character)."""
        delta = self._delta()
        self._prefix = self._read = len(self.ids)
        return delta
