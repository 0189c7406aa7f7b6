"""A corpus for the suffix drafter: the target's own answers to many prompts (``swiftspec train-draft``
writes one), as a file and as a static n-gram table.

A small model's phrasing recurs across answers ("Here are some tips to help you", "In summary,"), so a
corpus of its answers to other prompts predicts its next token on fresh chat questions more often than
the conversation alone does (``benchmarks/corpus_hit_rate.py``; the README gives figures). The drafter
still proposes only: the target verifies every token, so a corpus can make speculation slower or faster,
never wrong.

The file is safetensors: ``tokens`` (int32, the answers, each led in by the last tokens of its prompt, -1
between answers) and metadata naming the format, the vocabulary size and a fingerprint of the tokenizer's
vocabulary, so a corpus made with another tokenizer is refused by name, not used as noise. No torch here:
the Engine checks a corpus file before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from swiftspec.engine.model.model_dir import LoadError, check_safetensors

FORMAT = "swiftspec-corpus/1"
LEAD_IN = 3  # prompt tokens kept before each answer: the chat template's assistant header


def builtin_corpus() -> Path:
    """The embedded default's corpus, shipped with the package (its answers to SwiftSpec's own training
    prompts, none of which share a topic with the bench's fresh questions)."""
    from importlib.resources import files

    return Path(str(files("swiftspec") / "corpus" / "smollm2-135m-instruct.safetensors"))


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id map: equal for tokenizers that share a vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def save_corpus(path: Path, sequences: list[tuple[list[int], int]], tokenizer) -> int:
    """Writes the answers of (tokens, prompt length) sequences as a corpus; returns its answer tokens."""
    from safetensors.numpy import save_file

    parts, answer_tokens = [], 0
    for tokens, prompt_len in sequences:
        parts += tokens[max(0, prompt_len - LEAD_IN):] + [-1]
        answer_tokens += len(tokens) - prompt_len
    meta = {"format": FORMAT, "vocab_size": str(len(tokenizer)), "vocab_sha256": vocab_fingerprint(tokenizer),
            "answers": str(len(sequences)), "answer_tokens": str(answer_tokens)}
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": np.array(parts, dtype=np.int32)}, str(tmp), metadata=meta)
    tmp.replace(path)
    return answer_tokens


def read_metadata(path: Path) -> dict[str, str]:
    """A corpus file's metadata, from its header only; LoadError naming the file if it is none."""
    if not path.is_file():
        raise LoadError(f"draft corpus {str(path)!r} is not a file")
    header = check_safetensors(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or "tokens" not in header:
        raise LoadError(f"{path} is not a SwiftSpec draft corpus (made by swiftspec train-draft)")
    return meta


def check_corpus(path: Path, tokenizer) -> None:
    """LoadError naming both vocabularies if the corpus was made with another tokenizer than the target's."""
    meta = read_metadata(path)
    if meta.get("vocab_sha256") != vocab_fingerprint(tokenizer):
        raise LoadError(f"draft corpus {path} was made with another tokenizer (vocabulary of "
                        f"{meta.get('vocab_size')} tokens) than the target's ({len(tokenizer)} tokens): its "
                        "proposals would be noise; make one for this target with swiftspec train-draft")


def load_corpus(path: Path, vocab_size: int, max_order: int = 6) -> CorpusIndex:
    """The corpus file's n-gram table; LoadError if its tokens are not ids of a vocab_size vocabulary."""
    from safetensors.numpy import load_file

    read_metadata(path)
    tokens = load_file(str(path))["tokens"]
    if tokens.ndim != 1 or (len(tokens) and (tokens.min() < -1 or tokens.max() >= vocab_size)):
        raise LoadError(f"draft corpus {path} holds token ids outside the target's vocabulary of {vocab_size}")
    return CorpusIndex(tokens, max_order)


class CorpusIndex:
    """A static n-gram table over a corpus of the target's own answers: for every context of 1..max_order
    tokens, the top_k tokens that followed it, with their counts. The suffix drafter falls back to it where
    the conversation matches fewer than two tokens: a model's phrasing recurs across answers.

    Built with numpy from the token array (answers separated by -1) in a fraction of a second; a lookup
    hashes each context length (64-bit polynomial, the same in numpy and Python) and binary-searches one
    sorted array per order, so the table costs ~20 bytes per distinct n-gram and no Python objects.
    """

    MULT = 0x100000001B3  # FNV prime: the rolling hash's multiplier

    def __init__(self, tokens: np.ndarray, max_order: int = 6, top_k: int | None = 4):
        """top_k None keeps every continuation with its exact count (the history index subtracts from it)."""
        self.max_order = max_order
        self.tables = []  # per order: sorted context hashes, offsets, next tokens, counts
        tokens = np.asarray(tokens, dtype=np.int64)
        h = np.zeros(len(tokens), dtype=np.uint64)  # h[i]: the hash of the `order` tokens ending at i
        broken = np.zeros(len(tokens), dtype=bool)  # a separator among them
        for order in range(1, max_order + 1):
            older = np.roll(tokens, order - 1)
            with np.errstate(over="ignore"):
                h = h * np.uint64(self.MULT) + (older + 2).astype(np.uint64)
            broken |= older < 0
            broken[:order - 1] = True
            ctx = np.flatnonzero(~broken[:-1] & (tokens[1:] >= 0))  # contexts followed by a token
            self.tables.append(_top_continuations(h[ctx], tokens[ctx + 1], top_k))

    @classmethod
    def from_tables(cls, max_order: int, tables: list[tuple[np.ndarray, ...]]) -> CorpusIndex:
        """A table saved before (the history index's cache), without building it again."""
        self = cls.__new__(cls)
        self.max_order, self.tables = max_order, tables
        return self

    def lookup(self, context: list[int]) -> tuple[dict[int, int], int]:
        """The top continuations of the longest suffix of context in the table, and its length."""
        hashes = self.hashes(context)
        for order in range(len(hashes), 0, -1):
            counts = self.counts(hashes, order)
            if counts:
                return counts, order
        return {}, 0

    def hashes(self, context: list[int]) -> list[int]:
        """Per order 1..max_order, the hash of the last `order` tokens of context (as the table hashed them)."""
        hashes, h = [], 0
        for t in reversed(context[-self.max_order:]):  # newest token first, as the table was hashed
            h = (h * self.MULT + t + 2) & 0xFFFFFFFFFFFFFFFF
            hashes.append(h)
        return hashes

    def counts(self, hashes: list[int], order: int) -> dict[int, int]:
        """The continuations of the context of that order (empty: not in the table)."""
        keys, offsets, nexts, counts = self.tables[order - 1]
        i = int(keys.searchsorted(np.uint64(hashes[order - 1])))
        if i < len(keys) and int(keys[i]) == hashes[order - 1]:
            a, b = offsets[i], offsets[i + 1]
            return dict(zip(nexts[a:b].tolist(), counts[a:b].tolist(), strict=True))
        return {}


def _top_continuations(keys: np.ndarray, nexts: np.ndarray, top_k: int | None):
    """From (context hash, next token) pairs: the sorted distinct hashes, offsets into the next two arrays,
    and per hash its top_k next tokens with their counts, the most frequent first."""
    by_pair = np.lexsort((nexts, keys))
    keys, nexts = keys[by_pair], nexts[by_pair]
    first = _run_starts(keys, nexts)
    counts = np.diff(np.append(first, len(keys)))
    keys, nexts = keys[first], nexts[first]
    by_count = np.lexsort((-counts, keys))
    keys, nexts, counts = keys[by_count], nexts[by_count], counts[by_count]
    starts = _run_starts(keys)
    rank = np.arange(len(keys)) - np.repeat(starts, np.diff(np.append(starts, len(keys))))
    if top_k is not None:
        keys, nexts, counts = keys[rank < top_k], nexts[rank < top_k], counts[rank < top_k]
    starts = _run_starts(keys)
    return keys[starts], np.append(starts, len(keys)), nexts.astype(np.int32), counts.astype(np.int32)


def _run_starts(*columns: np.ndarray) -> np.ndarray:
    """Where each run of equal rows starts, in columns sorted by them."""
    if not len(columns[0]):
        return np.zeros(0, dtype=np.int64)
    change = np.zeros(len(columns[0]) - 1, dtype=bool)
    for c in columns:
        change |= c[1:] != c[:-1]
    return np.flatnonzero(np.append(True, change))
