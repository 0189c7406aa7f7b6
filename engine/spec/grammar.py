"""A request's grammar through the token tree, on llguidance (chosen by measurement:
benchmarks/grammar_libs.py): the grammar compiled and checked, the vocabulary as the library sees it,
and ``Constraint``, the matcher state after the answer's tokens with the states along a tree's paths.

Every node's state is its parent's, copied, plus its own token (a matcher copy costs microseconds), so a
tree of n nodes costs n copies and n masks. The target masks every node's logits by its state; the draft
drops the proposals its leaf's state refuses and proposes the token the state forces with probability 1.
No torch here: the Engine's process checks grammars without it.

A pathological grammar costs bounded time and memory: the library's limits (``LIMITS``) end a compile or
a mask that would cost more with a GrammarError, and the library compiles on a stack deep enough for any
grammar ``MAX_GRAMMAR_CHARS`` lets through (``compiled``), where a default one would crash the process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from swiftspec.engine.config import ConfigError, Grammar, GrammarKind

# The library's limits, each a bound on time or memory (its own rates on a desktop core; its defaults, but
# the states, whose default of 250,000 could hold ~0.5 GB). A grammar that reaches one fails with the
# library's reason: at compile (a 400 on the server) or at a mask mid-answer (the answer fails).
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes at compile: ~20 ms
    step_lexer_fuel=200_000,  # the lexer's work for one mask: ~14 ms
    step_max_items=50_000,  # the parser's Earley items for one mask: ~2.5 ms
    max_items_in_row=2_000,  # Earley items in one row: the grammar's branching at one point
    max_lexer_states=50_000,  # lexer states kept for an answer: ~100 MB
    max_grammar_size=500_000,  # symbols in the compiled grammar
    verbose_errors=False,  # one line, not a dump of the parser's state and the grammar
)
# The library compiles recursively, up to ~6 KB of stack a level of nesting (a chain of $refs or of Lark
# rules): the MAX_GRAMMAR_CHARS characters hold ~2,500 levels of $refs or ~6,000 of rules, ~25 MB of stack,
# where a default 8 MB stack crashes the process (SIGSEGV) at ~1,200 $refs.
COMPILE_STACK_BYTES = 256 << 20
_stack_size = threading.Lock()

# JSON as json.dumps writes it: one space after ':' and ',', none elsewhere. Fixed separators are tokens
# the grammar forces (drafted for free), and a model cannot spend its answer on whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class GrammarError(ConfigError):
    """A grammar the library cannot compile, or an answer it refused; the message says why."""


def compiled(build: Callable[[], object]):
    """``build()``, a call that compiles a grammar, run on a thread with a stack of COMPILE_STACK_BYTES;
    its exception, if any, raised here."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = build()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    with _stack_size:  # the size applies to every thread started meanwhile: only this one
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar compile")
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def library_grammar(grammar: Grammar) -> str:
    """``grammar`` in llguidance's own form (not checked: ``check`` does)."""
    try:
        match grammar.kind:
            case GrammarKind.JSON:
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
            case GrammarKind.JSON_SCHEMA:
                return llguidance.LLMatcher.grammar_from_json_schema(json.loads(grammar.source), defaults=JSON_OPTIONS)
            case GrammarKind.LARK:  # or llama.cpp's GBNF, which the library converts
                return llguidance.LLMatcher.grammar_from_lark(_lark(grammar.source))
            case GrammarKind.REGEX:
                return llguidance.LLMatcher.grammar_from_regex(grammar.source)
    except (ValueError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep to read
        raise GrammarError(f"the {grammar.kind} is not valid: {e}") from None


def _lark(source: str) -> str:
    """A Lark grammar as it is, llama.cpp's GBNF converted to Lark; a ValueError when the converter refuses
    it (it raises bare Exceptions: "No 'root' rule found" for an empty file)."""
    try:
        return any_to_lark(source)
    except Exception as e:
        raise ValueError(str(e)) from None


def check(grammar: Grammar) -> str:
    """The compiled grammar, or the GrammarError saying why the library refuses it."""
    source = library_grammar(grammar)
    is_error, messages = compiled(lambda: llguidance.LLMatcher.validate_grammar_with_warnings(source, limits=LIMITS))
    if is_error:
        raise GrammarError(f"the {grammar.kind} does not compile: {messages[0].strip()}")
    return source


@dataclass(frozen=True)
class Vocabulary:
    """A model's tokenizer as llguidance will read it, once a grammar asks: its tokenizer.json, the ids
    that end an answer and the mask's width (the logits'; None: the tokenizer's own)."""

    tokenizer_json: Path
    eos: tuple[int, ...]
    n_vocab: int | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        return _tokenizer(self)


@cache
def _tokenizer(vocab: Vocabulary) -> llguidance.LLTokenizer:
    """Built once a process, at its first constrained request: it reads the whole vocabulary."""
    if not vocab.tokenizer_json.is_file():
        raise GrammarError("a grammar needs the model's tokenizer.json (a fast tokenizer), which it lacks")
    return llguidance.LLTokenizer(vocab.tokenizer_json.read_text(), n_vocab=vocab.n_vocab, eos_token=list(vocab.eos))


def single_token(masks: np.ndarray) -> np.ndarray:
    """[n] bool: the bitmask rows that let exactly one token through (the grammar forces it)."""
    words = masks.view(np.uint32)
    one_word = np.count_nonzero(words, axis=1) == 1
    word = words.max(axis=1)
    return one_word & ((word & (word - 1)) == 0)


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether a bitmask row (int32 words, bit t of the row = token t) lets ``token`` through."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class Constraint:
    """One answer's grammar: ``matcher`` has consumed the tokens the answer holds so far (on the target,
    every emitted token; on the draft, every verified one). ``draft_forced``: the draft's proposals
    include the tokens the grammar forces."""

    def __init__(self, vocab: Vocabulary, grammar: Grammar, draft_forced: bool = True):
        self.draft_forced = draft_forced
        tokenizer = vocab.tokenizer()
        self.eos = frozenset(tokenizer.eos_tokens)
        source = check(grammar)
        self.matcher = compiled(lambda: llguidance.LLMatcher(tokenizer, source, log_level=0, limits=LIMITS))
        self._raise_on_error()
        self.words = llguidance.numpy.get_bitmask_shape(1, tokenizer.vocab_size)[1]
        self._after_path: dict[tuple[int, ...], llguidance.LLMatcher | None] = {}

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            error = self.matcher.get_error().replace("<non-verbose/>", "").strip()  # LIMITS' short form
            raise GrammarError(f"the grammar failed: {error}")

    def _after(self, state: llguidance.LLMatcher, token: int) -> llguidance.LLMatcher | None:
        """A copy of ``state`` past ``token``; None where the grammar refuses it. A complete grammar
        allows only EOS, and stays as it is past one."""
        if state.is_stopped():
            return state if token in self.eos else None
        state = state.deep_copy()
        return state if state.consume_token(token) else None

    def _state(self, path: tuple[int, ...]) -> llguidance.LLMatcher | None:
        """The state past ``path`` from the answer's, kept until the answer advances: a leaf's path is its
        parent's plus one token, so an expansion copies one state a leaf, not one a token of its path."""
        if not path:
            return self.matcher
        if path not in self._after_path:
            parent = self._state(path[:-1])
            self._after_path[path] = None if parent is None else self._after(parent, path[-1])
        return self._after_path[path]

    def advance(self, tokens: list[int]) -> None:
        """The answer's next tokens, each one the grammar allowed."""
        self._after_path.clear()
        for token in tokens:
            if self.matcher.is_stopped() and token in self.eos:
                continue
            if not self.matcher.consume_token(token):
                self._raise_on_error()
                raise GrammarError(f"the grammar refused token {token}")

    def states(self, tokens: list[int], parents: list[int]) -> list[llguidance.LLMatcher | None]:
        """Each tree node's state after its path (node 0 is the current state: its token is consumed);
        None for a node the grammar refuses, and for its descendants."""
        out: list[llguidance.LLMatcher | None] = [self.matcher]
        for i in range(1, len(tokens)):
            parent = out[parents[i]]
            out.append(None if parent is None else self._after(parent, tokens[i]))
        return out

    def masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """[n, words] int32: node i's bitmask for the token after its path. A refused node (never reached:
        its parent's choice obeys the grammar) lets every token through."""
        masks = np.full((len(tokens), self.words), -1, dtype=np.int32)
        for i, state in enumerate(self.states(tokens, parents)):
            if state is not None:
                llguidance.numpy.fill_next_token_bitmask(state, masks, i)
        self._raise_on_error()
        return masks

    def proposals(self, paths: list[list[int]], proposed: list[list[tuple[int, float]]]
                  ) -> list[list[tuple[int, float]]]:
        """The draft's proposals under the grammar, per leaf (``paths``: its tokens from the root, root
        included, after the verified ones): the token the leaf's state forces at probability 1 (log 0),
        else the proposals it allows."""
        out = []
        mask = np.zeros((1, self.words), dtype=np.int32)
        for path, props in zip(paths, proposed, strict=True):
            state = self._state(tuple(path))
            if state is None:
                out.append([])
                continue
            forced = state.compute_ff_tokens() if self.draft_forced else []
            if forced:
                out.append([(forced[0], 0.0)])
                continue
            llguidance.numpy.fill_next_token_bitmask(state, mask, 0)
            out.append([(t, logp) for t, logp in props if allowed(mask[0], t)])
        return out

    @property
    def complete(self) -> bool:
        """Whether the answer so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
