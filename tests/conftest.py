import os

import pytest


@pytest.fixture(autouse=True)
def no_user_settings(tmp_path_factory, monkeypatch):
    """No test reads the developer's config file or SWIFTSPEC_<FLAG> environment variables."""
    from swiftspec.settings import ENV_PREFIX

    monkeypatch.setenv("SWIFTSPEC_CONFIG", str(tmp_path_factory.getbasetemp() / "no-config.toml"))
    for name in os.environ:
        if name.startswith(ENV_PREFIX) and name not in ("SWIFTSPEC_CACHE", "SWIFTSPEC_CONFIG", "SWIFTSPEC_DATA_DIR"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2 as a Hugging Face directory (converted once into the user cache)."""
    from swiftspec.engine.model_dir import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_dir):
    from swiftspec.engine.model_dir import load_tokenizer

    return load_tokenizer(embedded_dir)
