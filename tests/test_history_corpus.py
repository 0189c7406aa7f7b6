"""The history store as the suffix drafter's corpus: the index against a brute-force scan over a growing
history with deletions and a cap, its cache between starts, deletion end to end through the drafter,
answers of another tokenizer, the switch (flag, env, config file), the answers' tokens kept by a
conversation, and exactness of every mode with history drafting on."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from helpers.cli import invoke
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model_dir

from swiftspec import window
from swiftspec.conversation import Conversation, Reply, Settings
from swiftspec.engine.config import DraftKind, EngineConfig, SamplingParams, TreeParams
from swiftspec.engine.host import launcher
from swiftspec.engine.host.worker_spec import WorkerSpec
from swiftspec.engine.spec import history_corpus
from swiftspec.engine.spec.corpus import CorpusIndex
from swiftspec.engine.spec.decode import DraftState
from swiftspec.engine.spec.draft_spec import DraftSpec
from swiftspec.engine.spec.drafters import SuffixDrafter, make_drafter
from swiftspec.engine.spec.history_corpus import StoredHistory, summarise, tokenizer_fingerprint
from swiftspec.history import HistoryStore

VOCAB = "v" * 64


def save(store: HistoryStore, tokens: list[int], vocab: str = VOCAB) -> int:
    """A conversation of one turn whose answer has these tokens; returns its id."""
    cid = store.create("t")
    store.add(cid, "user", "q")
    store.append_tokens(store.add(cid, "assistant", "a"), vocab, tokens)
    return cid


def brute(answers: list[list[int]], context: list[int], max_order: int) -> tuple[dict[int, int], int]:
    """The longest suffix of context (at most max_order tokens) that some answer holds followed by a
    token, and those tokens' counts, by scanning every answer."""
    for order in range(min(max_order, len(context)), 0, -1):
        counts: dict[int, int] = {}
        for a in answers:
            for i in range(order, len(a)):
                if a[i - order:i] == context[-order:]:
                    counts[a[i]] = counts.get(a[i], 0) + 1
        if counts:
            return counts, order
    return {}, 0


def within_cap(live: dict[int, list[int]], cap: int) -> list[list[int]]:
    """The answers the drafter may use: newest (highest id) first while their tokens fit in cap."""
    out, total = [], 0
    for cid in sorted(live, reverse=True):
        total += len(live[cid])
        if total > cap:
            break
        out.append(live[cid])
    return out


answer_st = st.lists(st.integers(0, 3), min_size=1, max_size=16)
op_st = st.one_of(st.tuples(st.just("add"), answer_st), st.tuples(st.just("delete"), st.integers(0, 30)),
                  st.tuples(st.just("restart"), st.none()))


@given(st.lists(op_st, min_size=1, max_size=25), st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6),
                                                          min_size=1, max_size=6),
       st.integers(1, 4), st.integers(5, 60))
@settings(max_examples=60, deadline=None)
def test_the_index_matches_a_brute_force_scan_of_a_growing_history(ops, contexts, max_order, cap):
    """After every change (an answer added, a conversation deleted, a restart that reads the cached
    table), every lookup equals a scan of the answers still in the store, newest first within the cap."""
    with tempfile.TemporaryDirectory() as tmp:
        store = HistoryStore(Path(tmp) / "history.sqlite3")
        live: dict[int, list[int]] = {}

        def start():
            return StoredHistory(store.path, VOCAB, cap=cap, max_order=max_order)

        history = start()
        for op, arg in ops:
            if op == "add":
                live[save(store, arg)] = arg
            elif op == "delete" and live:
                cid = sorted(live)[arg % len(live)]
                store.delete(cid)
                del live[cid]
            elif op == "restart":
                history = start()
            history.update()
            for context in contexts:
                assert history.lookup(context) == brute(within_cap(live, cap), context, max_order)
        store.close()


def test_nothing_deleted_is_ever_proposed_again(tmp_path):
    """The drafter proposes an earlier answer's continuation; once its conversation is deleted (and after
    a restart, whose cached table held it), no round proposes it again."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    secret = [20, 21, 22, 23, 24, 25]
    cid = save(store, secret)
    save(store, [30, 31, 32, 33])

    def first_round(drafter) -> list[int]:
        state = DraftState(drafter, TreeParams(bs=8, w=4))
        state.prefill([1, 2, 20])
        state.start(21)
        for _ in range(4):
            state.expand()
        return state.subtree()[0]

    def drafter():
        return SuffixDrafter(history_tokens=0, stored=StoredHistory(store.path, VOCAB))

    live = drafter()
    assert first_round(live)[:4] == [21, 22, 23, 24]  # copied from the earlier answer
    store.delete(cid)
    assert first_round(live) == [21]  # the same session: gone before its next answer
    for restarted in (drafter(), drafter()):  # the table is rebuilt without it, then cached without it
        assert first_round(restarted) == [21]
        for i in range(1, len(secret)):
            assert not restarted.stored.lookup(secret[:i])[0]
    store.close()


def test_the_cap_keeps_the_newest_answers(tmp_path):
    store = HistoryStore(tmp_path / "history.sqlite3")
    save(store, [1, 2, 3, 4])
    save(store, [5, 6, 7, 8])
    save(store, [9, 10, 11, 12])
    history = StoredHistory(store.path, VOCAB, cap=10)
    assert history.lookup([1, 2]) == ({}, 0) and history.lookup([5, 6]) == ({7: 1}, 2)
    save(store, [13, 14])  # 4 + 4 + 2 tokens: still room for the second answer
    history.update()
    assert history.lookup([5, 6]) == ({7: 1}, 2) and history.lookup([13]) == ({14: 1}, 1)
    save(store, [15, 16])
    history.update()
    assert history.lookup([5, 6]) == ({}, 0) and history.lookup([9, 10]) == ({11: 1}, 2)
    assert history.index.tokens == 8
    store.close()


def test_the_cached_table_serves_the_next_start(tmp_path, monkeypatch):
    """An unchanged history, or one with a few more answers, starts from the cached table; a deletion
    among its answers builds it anew (the cache then holds nothing deleted)."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    answers = [[i, i + 1, i + 2, i + 3] for i in range(0, 400, 4)]
    ids = [save(store, a) for a in answers]
    StoredHistory(store.path, VOCAB)
    (table,) = tmp_path.glob("history.sqlite3.index-*.npz")  # beside the database, private
    assert oct(table.stat().st_mode & 0o777) == "0o600"
    built = []
    init = CorpusIndex.__init__
    monkeypatch.setattr(CorpusIndex, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k))
    save(store, [500, 501, 502])
    history = StoredHistory(store.path, VOCAB)
    assert not built and history.lookup([500]) == ({501: 1}, 1) and history.lookup([8, 9]) == ({10: 1}, 2)
    store.delete(ids[2])
    history = StoredHistory(store.path, VOCAB)
    assert built == [1] and history.lookup([8, 9]) == ({}, 0)
    store.close()


def test_answers_of_another_tokenizer_are_ignored_with_a_notice(tmp_path):
    store = HistoryStore(tmp_path / "history.sqlite3")
    save(store, [1, 2, 3])
    save(store, [1, 2, 4], vocab="other")
    history = StoredHistory(store.path, VOCAB)
    assert history.lookup([1, 2]) == ({3: 1}, 2)
    summary = summarise(store.path, VOCAB)
    assert (summary.answers, summary.tokens, summary.foreign) == (1, 3, 1)
    assert "1 answers by another tokenizer are ignored" in summary.line()
    assert "another tokenizer" not in summarise(store.path, "other").line().split(";")[0]
    store.close()


def test_a_missing_or_unreadable_history_drafts_from_nothing(tmp_path):
    history = StoredHistory(tmp_path / "none.sqlite3", VOCAB)
    history.update()
    assert history.lookup([1, 2]) == ({}, 0)
    (tmp_path / "junk.sqlite3").write_bytes(b"not a database" * 100)
    assert StoredHistory(tmp_path / "junk.sqlite3", VOCAB).lookup([1]) == ({}, 0)


def test_the_fingerprint_is_the_vocabulary():
    a, b, other = tiny_model_dir(seed=0), tiny_model_dir(seed=1, layers=1), tiny_model_dir(vocab=320)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) != tokenizer_fingerprint(other)


def test_draft_history_off_restores_the_drafter_without_history(tmp_path):
    """off: no history of either kind, the drafter of the session-less benchmarks; on: the store's when the
    chat keeps its conversations, else the session's."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    save(store, [1, 2, 3])
    target = tiny_model_dir(seed=0)
    make = dict(target_dir=target, trust_remote_code=False, load=None, history_db=store.path)
    off = make_drafter(DraftSpec(DraftKind.SUFFIX), history=False, **make)
    assert off.stored is None and off.history_tokens == 0
    assert make_drafter(DraftSpec(DraftKind.SUFFIX), history=True, **{**make, "history_db": None}).stored is None
    assert make_drafter(DraftSpec(DraftKind.SUFFIX), history=True, **make).stored is not None
    config = EngineConfig(target=str(target), history_db=str(store.path))
    spec = WorkerSpec(config, launcher.plan_layout(config, 0), str(target), "suffix")
    read = WorkerSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).config  # as the workers read it
    assert read.history_db == str(store.path) and read.drafts_from_store
    assert not dataclasses.replace(read, draft_history=False).drafts_from_store
    store.close()


def test_the_switch_reads_flag_env_and_config_file(fake, data_dir, monkeypatch, tmp_path):
    assert invoke(["chat", "-p", "hi"]).exit_code == 0
    assert fake[-1].draft_history and fake[-1].history_db is None  # unsaved: the session's history
    assert invoke(["chat", "-p", "hi", "--save"]).exit_code == 0
    assert fake[-1].history_db == str(data_dir / "history.sqlite3") and fake[-1].drafts_from_store
    assert invoke(["chat", "-p", "hi", "--save", "--draft-history", "off"]).exit_code == 0
    assert not fake[-1].draft_history and not fake[-1].drafts_from_store
    monkeypatch.setenv("SWIFTSPEC_DRAFT_HISTORY", "off")
    assert invoke(["chat", "-p", "hi"]).exit_code == 0 and not fake[-1].draft_history
    monkeypatch.delenv("SWIFTSPEC_DRAFT_HISTORY")
    (tmp_path / "config.toml").write_text('draft-history = "off"\n')
    monkeypatch.setenv("SWIFTSPEC_CONFIG", str(tmp_path / "config.toml"))
    assert invoke(["chat", "-p", "hi"]).exit_code == 0 and not fake[-1].draft_history
    result = invoke(["chat", "-p", "hi", "--draft-history", "maybe"])
    assert result.exit_code == 2 and "on or off" in result.output


def test_a_conversation_keeps_its_answers_tokens(tmp_path):
    """Each finished answer's token ids go into the store with the engine's tokenizer; a continued answer
    adds to them, a retried one replaces them, a cleared conversation takes them along."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, vocab=VOCAB)
    conversation = Conversation(store, Settings(params=SamplingParams(max_new_tokens=5)))
    seen: list[int] = []

    def ask(kind, text=None):
        reply = Reply(conversation.plan(kind, window.Context.of(engine), text))
        return conversation.run(reply, engine, on_event=lambda e: seen.extend(e.token_ids))

    reply = ask("ask", "hello")
    tokens = history_corpus.AnswerReader(store.path, VOCAB)
    assert tokens.tokens([reply.answer.id])[reply.answer.id].tolist() == seen
    ask("continue")
    assert tokens.tokens([reply.answer.id])[reply.answer.id].tolist() == seen
    seen.clear()
    retried = ask("retry")
    assert tokens.tokens([reply.answer.id]) == {} and tokens.tokens([retried.answer.id])[retried.answer.id].tolist() == seen
    conversation.clear()
    assert tokens.listing() == []
    store.close()


# --- the real engine, on a tiny random model ---------------------------------------------------------

@pytest.mark.slow
def test_every_mode_is_exact_with_history_drafting_on(tmp_path):
    """The target's own answers, once in the history, draft its next ones (more tokens accepted than
    before they were there), and sync and async still give ar's tokens."""
    from helpers.engines import N_TOKENS, PROMPTS, answer, no_processes_left, start

    target = tiny_model_dir(seed=0, layers=2)
    store = HistoryStore(tmp_path / "history.sqlite3")
    lines: list[str] = []

    def accepted(eng, messages, mode, ref) -> int:
        tokens, _, events = answer(eng, messages, mode=mode, max_new_tokens=N_TOKENS, ignore_eos=True)
        assert tokens == ref, mode
        return sum(e.stats.accepted for e in events)

    def accepted_in(eng, mode) -> int:
        return sum(accepted(eng, m, mode, ref) for m, ref in zip(PROMPTS, references, strict=True))

    # d given and no cost cut: every round expands alike, so what is accepted depends on the drafter alone
    fixed = dict(draft_corpus="none", history_db=str(store.path), tree=TreeParams(d=3), verify_cost=False)
    with start(target, "suffix", progress=lines.append, **fixed) as eng:
        references = [answer(eng, m, mode="ar", max_new_tokens=N_TOKENS, ignore_eos=True)[0] for m in PROMPTS]
        before = {mode: accepted_in(eng, mode) for mode in ("sync", "async")}
        for ref in references:  # as a chat saves them, with the engine's own fingerprint
            save(store, ref, eng.info.vocab)
        save(store, [1, 2, 3], vocab="another")
        after = {mode: accepted_in(eng, mode) for mode in ("sync", "async")}
        assert after["sync"] > before["sync"] and after["async"] > before["async"], (before, after)
    assert no_processes_left(eng)
    assert eng.info.vocab == tokenizer_fingerprint(target)
    assert any("drafting also from 0 earlier answers" in line for line in lines)
    with start(target, "suffix", progress=lines.append, **fixed) as eng:
        assert accepted_in(eng, "async") == after["async"]  # the next start drafts from the same answers
    assert any("from 3 earlier answers" in line and "1 answers by another tokenizer" in line for line in lines)
    store.close()


def test_a_history_match_is_sized_by_its_length_and_support(tmp_path):
    """p = c / (t + h / n): one sighting gives n / (n + h), a context seen often its frequencies."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    for tail in ([7], [7], [7], [8]):
        save(store, [1, 2, 3] + tail)
    save(store, [4, 5, 6])
    sd = SuffixDrafter(max_order=4, history_tokens=0, stored=StoredHistory(store.path, VOCAB))
    sd.prefill([9], 0)
    h = sd.history_unseen
    assert sd.lookup([9, 4, 5]) == ({6: 1}, 1 / (1 + h / 2))
    assert sd.lookup([9, 2, 3]) == ({7: 3, 8: 1}, 4 / (4 + h / 2))
    state = DraftState(sd, TreeParams(bs=4, w=4))
    state.prefill([9, 2])
    state.start(3)
    state.expand()
    assert state.tree.token[1:] == [7, 8]  # both continuations, the frequent one first
    assert [round(math.exp(v), 6) for v in state.tree.value[1:]] == [round(3 / (4 + h / 2), 6), round(1 / (4 + h / 2), 6)]
    store.close()



def test_a_new_database_in_the_same_place_does_not_get_the_old_table(tmp_path):
    """A history started afresh (moved aside when damaged, or removed) reuses the ids: the cached table
    is told apart by its answers' digest, never served for other answers."""
    store = HistoryStore(tmp_path / "history.sqlite3")
    save(store, [1, 2, 3])
    StoredHistory(store.path, VOCAB)
    store.close()
    store.path.unlink()
    store = HistoryStore(tmp_path / "history.sqlite3")
    save(store, [1, 2, 4])
    assert StoredHistory(store.path, VOCAB).lookup([1, 2]) == ({4: 1}, 2)
    store.close()
