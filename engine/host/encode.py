"""Token ids of what the Engine is asked: a raw prompt, or a conversation through the tokenizer's chat
template."""

from __future__ import annotations

from swiftspec.engine.host.failures import EngineError


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a raw prompt, with the tokenizer's own special tokens (a BOS where the model has one)."""
    if not isinstance(text, str) or not text:
        raise EngineError("a prompt must be a non-empty string")
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the answer
    (``add_generation_prompt=True``), or, when the last message is the assistant's, ready to continue
    that answer where it stops (``/continue``). A tokenizer without a template gets plain "role: content"
    lines."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise EngineError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    continuing = messages[-1]["role"] == "assistant"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not continuing,
                                             continue_final_message=continuing)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    text = text[:-1] if continuing else text + "assistant:"
    return list(tokenizer(text)["input_ids"])

