import pytest

from swiftspec.engine.host.detok import IncrementalDetokenizer

TEXTS = [
    "Hello 👋🏽 world 🎉!",
    "中文分词测试：你好，世界。日本語も。",
    "mixed: naïve café — 🧑‍🚀 in 東京 😀😀",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_final_text(embedded_tokenizer, text):
    ids = embedded_tokenizer.encode(text, add_special_tokens=False)
    # the byte-level BPE really splits these characters across tokens: some single tokens decode to U+FFFD
    assert any("\ufffd" in embedded_tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(embedded_tokenizer)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == embedded_tokenizer.decode(ids) == text


def test_multi_token_pushes_and_held_back_tail(embedded_tokenizer):
    ids = embedded_tokenizer.encode("ok 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(embedded_tokenizer)
    out = detok.push(ids[:-1])  # the emoji's last byte is missing: held back
    assert "\ufffd" not in out and out + detok.push(ids[-1:]) + detok.flush() == "ok 🎉"
