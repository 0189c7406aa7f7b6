"""Drafters: what proposes the children of tree leaves (engine/spec/draft_io.py: the interface), and
``make_drafter``, the one place that turns a resolved draft into a drafter."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from swiftspec.engine.config import Device, DraftKind
from swiftspec.engine.model.cpu_backends import kernels_available, library
from swiftspec.engine.model.fp16_linear import fbgemm_available
from swiftspec.engine.model.loader import load_target_io
from swiftspec.engine.model.model_dir import load_tokenizer, read_args
from swiftspec.engine.spec.corpus import CorpusIndex, load_corpus
from swiftspec.engine.spec.draft_head import HeadDrafter, load_head
from swiftspec.engine.spec.draft_io import Drafter, Expansion, Features, read_top
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.spec.history_corpus import StoredHistory, tokenizer_fingerprint
from swiftspec.engine.spec.transfers import Staging
from swiftspec.engine.spec.tree_cache import TreeKVCache, prefill_forward


class VocabMismatch(ValueError):
    """The draft does not share the target's vocabulary, so its proposals would be garbage."""


def check_vocab_compatible(target_tokenizer, draft_tokenizer) -> int:
    """Raises VocabMismatch unless both tokenizers map the same strings to the same ids; returns the
    shared vocabulary size (model vocabularies may be padded beyond it)."""
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])
        example = ", ".join(f"{tok!r}->{i}" for tok, i in diff[:3])
        raise VocabMismatch(
            f"the draft's tokenizer differs from the target's ({len(tv)} vs {len(dv)} tokens, "
            f"{len(diff)} differing entries, e.g. {example}); a draft model must share the target's "
            "tokenizer (same family), or use --draft suffix")
    return len(tv)


class ModelDrafter:
    """A Llama-family draft model with its own evolving tree cache."""

    wants_features = False

    def __init__(self, model, vocab_size: int | None = None):
        """vocab_size: the shared vocabulary (see check_vocab_compatible); padded ids beyond it are never
        proposed."""
        self.model = model
        self.cache = TreeKVCache(model)
        self.vocab_size = vocab_size or model.args.vocab_size
        self.staging = Staging(model.k_cache.device)

    def prefill(self, tokens: list[int], reuse: int, features: Features | None = None) -> None:
        prefill_forward(self.model, tokens[reuse:], reuse, logits=False)

    def extend(self, tokens: list[int], features: Tensor | None = None) -> None:
        pass  # the KV of verified tokens is moved by the cache commit

    def propose(self, exp: Expansion, k: int) -> list[list[tuple[int, float]]]:
        """One copy of the rows to the device and one read of the proposals."""
        s = self.staging.upload(exp.tree.draft_inputs(exp.leaves, exp.n_prefix, exp.pending))
        logits = self.model(s.tokens, s.positions, s.slots, s.mask, logits_rows=slice(len(exp.pending), None))
        return read_top(logits[:, :self.vocab_size].log_softmax(-1), k)


class SuffixIndex:
    """A bounded-depth suffix trie over a token sequence, extended incrementally: for every position and
    every context length n <= max_order, the n tokens before it map to counts of the token that followed."""

    def __init__(self, max_order: int):
        self.max_order = max_order
        self.tokens: list[int] = []
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def extend(self, tokens: list[int]) -> None:
        ctx = self.tokens
        for t in tokens:
            n = len(ctx)
            for order in range(1, min(self.max_order, n) + 1):
                counts = self.counts.setdefault(tuple(ctx[n - order:]), {})
                counts[t] = counts.get(t, 0) + 1
            ctx.append(t)

    def lookup(self, context: list[int]) -> tuple[dict[int, int], int]:
        """Counts of the continuations of the longest indexed suffix of context, and its length."""
        for order in range(min(self.max_order, len(context)), 0, -1):
            counts = self.counts.get(tuple(context[-order:]))
            if counts is not None:
                return counts, order
        return {}, 0


class SuffixDrafter:
    """Model-free: proposes what followed the current context earlier in the conversation, in earlier
    conversations (the history store's answers, ``stored``, or else this session's), or in the target's
    own answers to other prompts (a corpus).

    A leaf's context is the committed text plus its root path; its children come from the longest suffix
    of that context found in the current conversation's index (the prompt and everything generated). Where
    that match is shorter than two tokens, a longer one in the history wins (a model reuses its own
    phrasing across answers), and a longer one still in the corpus (a static ``CorpusIndex`` of
    the target's answers: generic phrasing that no conversation has shown yet). Lookups cost O(max_order)
    per leaf.

    Probabilities are the continuation frequencies times a confidence in the match length n
    (``match_weight``): n / (n + c) with c = 1.75, but c = 4 for a one-token match, and 0.955 for a match
    as long as the index is deep (max_order), a copy whose real length is unknown. These constants are
    fitted to how often a match of each length predicts the target's next token, teacher-forced over the
    shipped corpus's answers (``benchmarks/history_calibration.py``; docs/ARCHITECTURE.md gives the
    figures): a single n / (n + 2) would under-size the trees of long copies, which second turns are full
    of. A corpus match of the same length is right less often (c = 4, calibrated on held-out questions).
    So weights stay calibrated and the tree grows deep along confident copies and stays small where the
    context is ambiguous.

    A history match is sized by its support too (adaptive speculation, as SuffixDecoding scores a match by
    its length and counts): a continuation seen c times after a context seen t times is proposed with
    p = c / (t + h / n), as if a match of n tokens left h / n continuations unseen. One sighting gives
    n / (n + h), the rule above; a context seen often gives its frequencies. h = 5 fits the same benchmark:
    a short match seen once is right less often than the conversation's rule would say, a context seen
    often more often. The cost-aware trees (``DraftState``) size each round by these probabilities: depth
    along well-supported copies, siblings where the support is split, nothing where it is thin.
    """

    HISTORY_TOKENS = 200_000
    wants_features = False

    def __init__(self, max_order: int = 16, confidence: float = 1.75, history_tokens: int = HISTORY_TOKENS,
                 corpus: CorpusIndex | None = None, corpus_confidence: float = 4.0,
                 stored: StoredHistory | None = None, history_unseen: float = 5.0,
                 one_token_confidence: float = 4.0, full_depth_weight: float = 0.955):
        """stored: the history store's answers, instead of the session's conversations (history_tokens)."""
        self.max_order = max_order
        self.confidence = confidence
        self.one_token_confidence = one_token_confidence
        self.full_depth_weight = full_depth_weight
        self.history_tokens = history_tokens
        self.corpus = corpus
        self.corpus_confidence = corpus_confidence
        self.history_unseen = history_unseen
        self.cache = TreeKVCache(None)
        self.context = SuffixIndex(max_order)
        self.history = SuffixIndex(max_order)
        self.stored = stored

    def prefill(self, tokens: list[int], reuse: int, features: Features | None = None) -> None:
        old = self.context.tokens
        if tokens[:len(old)] != old:  # another conversation, or an edited one: index it afresh
            if self.stored is None and len(self.history.tokens) + len(old) > self.history_tokens:
                self.history = SuffixIndex(self.max_order)
            if self.stored is None and len(old) <= self.history_tokens:  # history_tokens=0: no history at all
                self.history.extend(old)
            self.context = SuffixIndex(self.max_order)
        if self.stored is not None:  # answers finished or deleted since the last one
            self.stored.update()
        self.context.extend(tokens[len(self.context.tokens):])

    def extend(self, tokens: list[int], features: Tensor | None = None) -> None:
        self.context.extend(tokens)

    def match_weight(self, n: int) -> float:
        """The chance that a match of n tokens in the conversation predicts right (see the class)."""
        if n >= self.max_order:
            return self.full_depth_weight
        return n / (n + (self.one_token_confidence if n == 1 else self.confidence))

    def lookup(self, context: list[int]) -> tuple[dict[int, int], float]:
        """The continuation counts of the best match of context's suffix, and the chance that such a
        match predicts right: ``match_weight(n)`` for a match of n tokens in the conversation,
        t / (t + h / n) for a history match of a context seen t times."""
        counts, order = self.context.lookup(context)
        weight = self.match_weight(order)
        if order < 2:
            older, longer = (self.stored or self.history).lookup(context)
            if longer > order:
                counts, order = older, longer
                seen = sum(counts.values())
                weight = seen / (seen + self.history_unseen / order)
            if self.corpus is not None:
                common, longer = self.corpus.lookup(context)
                if longer > order:
                    counts, order = common, longer
                    weight = order / (order + self.corpus_confidence)
        return counts, weight

    def propose(self, exp: Expansion, k: int) -> list[list[tuple[int, float]]]:
        tail = self.context.tokens[-self.max_order:]
        out = []
        for path in exp.paths():
            counts, weight = self.lookup(tail + path)
            if not counts:
                out.append([])
                continue
            scale = weight / sum(counts.values())
            best = sorted(counts.items(), key=lambda kv: -kv[1])[:k]
            out.append([(t, math.log(c * scale)) for t, c in best])
        return out


def make_drafter(draft: DraftSpec, target_dir: Path, trust_remote_code: bool, history: bool,
                 load: Callable[[Path, bool], object], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_slots: int = 4096, corpus: Path | None = None,
                 vocab_size: int | None = None, history_db: Path | None = None) -> Drafter:
    """The one place a draft becomes a drafter: the suffix drafter, the target in dynamic int8, a draft
    head (with the target's embedding and lm_head, on ``device`` in ``dtype``) or a draft model.
    ``load(path, int8)`` loads a draft model on this rank; ``history``: the suffix drafter also
    drafts from earlier conversations, those of ``history_db`` (a history database) when given, else the
    session's; ``max_slots``: a head's KV cache; ``corpus``: the suffix drafter's corpus file;
    ``vocab_size``: a draft model's vocabulary shared with the target, as the Engine checked it (None:
    checked here)."""
    match draft.kind:
        case DraftKind.SUFFIX:
            stored = StoredHistory(history_db, tokenizer_fingerprint(target_dir)) if history and history_db else None
            return SuffixDrafter(history_tokens=SuffixDrafter.HISTORY_TOKENS if history else 0,
                                 corpus=load_corpus(corpus, read_args(target_dir).vocab_size) if corpus else None,
                                 stored=stored)
        case DraftKind.INT8:
            return ModelDrafter(load(target_dir, True))
        case DraftKind.HEAD:
            head = load_head(draft.path, read_args(target_dir), device, dtype)
            head.attach_target(*load_target_io(target_dir, device, dtype))
            if Device.of(device) is Device.CPU and dtype == torch.float32:
                if kernels_available(head.args.model_args()) is None:
                    head.pack_cpu_kernels(library())
                elif fbgemm_available():
                    head.pack_fp16_cpu_weights()
            return HeadDrafter(head, max_slots)
        case DraftKind.MODEL:
            if vocab_size is None:
                vocab_size = check_vocab_compatible(load_tokenizer(target_dir, trust_remote_code),
                                                    load_tokenizer(draft.path, trust_remote_code))
            return ModelDrafter(load(draft.path, False), vocab_size)
    raise ValueError(f"no drafter for {draft}")
