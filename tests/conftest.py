import pytest


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2 as a Hugging Face directory (converted once into the user cache)."""
    from swiftspec.engine.loader import resolve_model_dir

    return resolve_model_dir(None, quiet=True)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_dir):
    from swiftspec.engine.loader import load_tokenizer

    return load_tokenizer(embedded_dir)
