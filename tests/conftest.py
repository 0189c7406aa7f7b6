import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The checkout's top-level folders are packages only as parts of swiftspec (pyproject's package-dir).
# `python -m pytest` puts the checkout itself first on sys.path, where kernels/ hides the Hugging Face
# package `kernels` that transformers imports; the test session and every process it starts leave it out.
CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != CHECKOUT]
os.environ["PYTHONSAFEPATH"] = "1"

# Set at import, before any test module reads them (and inherited by every subprocess a test starts): the
# whole session writes its converted models, profiles, worker logs and history into one temporary
# directory, never into the user's ~/.cache or ~/.local, and reads no user config file. The embedded
# model is converted once into it, by the first test that needs it.
SESSION_DIR = Path(tempfile.mkdtemp(prefix="swiftspec-tests-"))
os.environ["SWIFTSPEC_CACHE"] = str(SESSION_DIR / "cache")
os.environ["SWIFTSPEC_DATA_DIR"] = str(SESSION_DIR / "data")
os.environ["SWIFTSPEC_CONFIG"] = str(SESSION_DIR / "no-config.toml")
# What the libraries write for themselves goes there too: matplotlib's font cache (the bench's plot tests)
# and Triton's kernel cache (the kernels run under TRITON_INTERPRET) land in ~/.cache and ~/.triton otherwise.
os.environ["MPLCONFIGDIR"] = str(SESSION_DIR / "matplotlib")
os.environ["TRITON_CACHE_DIR"] = str(SESSION_DIR / "triton" / "cache")
os.environ["TRITON_HOME"] = str(SESSION_DIR / "triton")
SESSION_ENV = {name: os.environ[name] for name in ("SWIFTSPEC_CACHE", "SWIFTSPEC_DATA_DIR", "SWIFTSPEC_CONFIG",
                                                   "MPLCONFIGDIR", "TRITON_CACHE_DIR", "TRITON_HOME")}


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_user_settings(monkeypatch):
    """No test reads the developer's SWIFTSPEC_<FLAG> environment variables, and each starts from the
    session's own directories (a test that moved them has them back)."""
    from swiftspec.settings import ENV_PREFIX

    for name in os.environ:
        if name.startswith(ENV_PREFIX) and name not in SESSION_ENV:
            monkeypatch.delenv(name)
    for name, value in SESSION_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2 as a Hugging Face directory (converted once per session, into its cache)."""
    from swiftspec.engine.model.model_dir import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_dir):
    from swiftspec.engine.model.model_dir import load_tokenizer

    return load_tokenizer(embedded_dir)


@pytest.fixture(scope="session")
def target_dir():
    """The tiny target that the engine, launcher and failure tests start worker groups on."""
    from tiny_models import tiny_model_dir

    return tiny_model_dir(seed=0, layers=2)


@pytest.fixture
def store(tmp_path):
    """A history store of the test's own, closed after it."""
    from swiftspec.history import HistoryStore

    s = HistoryStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A scratch data directory (the history store) for one test."""
    monkeypatch.setenv("SWIFTSPEC_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def fake(monkeypatch):
    """Routes the CLI's engine start to the FakeEngine and records the configs it was given."""
    from fake_engine import FakeEngine

    from swiftspec.cli import chat as cli_chat

    configs = []

    def start(config, progress):
        configs.append(config)
        return FakeEngine.start(config, progress)

    monkeypatch.setattr(cli_chat, "_start_engine", start)
    return configs


@pytest.fixture(scope="module")
def tiny():
    """The bench tests' tiny target model directory."""
    from tiny_models import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture
def tokenizer(target_dir):
    """The tiny target's tokenizer."""
    from swiftspec.engine.model.model_dir import load_tokenizer

    return load_tokenizer(target_dir)


@pytest.fixture
def served(tokenizer, request):
    """A server on a GatedEngine (tests/helpers/gated.py): its host, its engines, its base URL. A test's
    ``settings`` mark gives more ServerSettings."""
    from helpers.gated import gated_server

    mark = request.node.get_closest_marker("settings")
    with gated_server(tokenizer, **(mark.kwargs if mark else {})) as server:
        yield server
