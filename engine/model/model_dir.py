"""Finding and reading a model directory: a Hugging Face directory or a GGUF file (converted once into
a directory in the cache, engine/model/gguf_io.py), its config, its tokenizer and its EOS ids. No path is
ever resolved against a hub, and remote code is never trusted unless the user asks.

No torch here (engine/model/loader.py reads the weights): the Engine resolves and checks the models before it
starts any worker, and importing torch would slow its start.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from swiftspec.engine.config import FLOAT_DTYPES, Dtype
from swiftspec.engine.model import embedded, gguf_io
from swiftspec.engine.model.gguf_io import GGUF_METADATA
from swiftspec.engine.model.model_args import ModelArgs, ModelConfigError


class LoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names what is wrong."""


def resolve_model_dir(spec: str | None, progress: Callable[[str], None] | None = None, role: str = "model") -> Path:
    """None → the embedded default; a .gguf file → its converted directory (converted once, stages
    reported to ``progress``); a directory → itself. A refusal names the ``role`` ("model", "draft")."""
    if spec is None:
        return gguf_io.ensure_converted(embedded.embedded_gguf_path(), progress=progress)
    path = Path(spec).expanduser()
    if path.is_symlink() and not path.exists():
        try:
            path.resolve(strict=True)
        except (OSError, RuntimeError) as e:  # a loop (RuntimeError before Python 3.13) or a dangling link
            raise LoadError(f"{role} path {spec!r} is a symbolic link that cannot be followed: {e}") from None
    if not path.exists():
        raise LoadError(f"{role} path {spec!r} does not exist (expected a Hugging Face model directory or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise LoadError(f"{role} {spec!r} is a file but not a .gguf file; pass a model directory or a GGUF file")
        return gguf_io.ensure_converted(path, progress=progress)
    if not (path / "config.json").is_file():
        raise LoadError(f"{role} {spec!r} has no config.json: not a Hugging Face model directory")
    read_args(path)
    for f in weight_files(path):
        check_safetensors(f)
    return path


def check_safetensors(path: Path) -> dict:
    """A LoadError naming the file when it is not safetensors or is cut short: found here, before any
    worker starts, rather than as a worker's traceback. Reads the header only, and returns it."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 2 <= n <= size - 8 else None
    except (OSError, ValueError) as e:  # unreadable, or a header that is not JSON
        raise LoadError(f"{path} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path} is not a safetensors file (no valid header)")
    try:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError):
        raise LoadError(f"{path} is not a safetensors file (a tensor entry lacks data_offsets)") from None
    if 8 + n + end > size:
        raise LoadError(f"{path} is truncated: its header describes {8 + n + end:,} bytes, the file has "
                        f"{size:,} (copy or download it again)")
    return header


def read_args(model_dir: Path) -> ModelArgs:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {model_dir / 'config.json'}: {e}") from None
    try:
        return ModelArgs.from_hf_config(cfg)
    except ModelConfigError as e:
        raise LoadError(f"{model_dir}: {e}") from None
    except KeyError as e:
        raise LoadError(f"{model_dir / 'config.json'} lacks the field {e.args[0]!r}") from None


def stored_float_dtype(model_dir: Path) -> Dtype:
    """The float width a checkpoint's weights are stored at (config.json's torch_dtype / dtype; fp32 for a
    converted GGUF, whose dequantised values fp32 holds exactly): what the CPU runs them at unless asked,
    since a narrower width would be another model."""
    if gguf_block_kinds(model_dir):
        return Dtype.FLOAT32
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return Dtype.FLOAT32
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    return Dtype(name) if name in FLOAT_DTYPES else Dtype.FLOAT32


def gguf_block_kinds(model_dir: Path) -> set[str]:
    """The GGUF block types a converted GGUF kept as blocks (from the safetensors headers only)."""
    kinds: set[str] = set()
    for f in weight_files(model_dir):
        meta = check_safetensors(f).get("__metadata__") or {}
        try:
            kinds |= set(json.loads(meta.get(GGUF_METADATA, "{}")).values())
        except (ValueError, AttributeError):
            pass
    return kinds


# transformers' GenerationConfig defaults for the sampling fields we read, and their SamplingParams names
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": 0.0, "repetition_penalty": 1.0}
GENERATION_NAMES = {"repetition_penalty": "repeat_penalty"}


def generation_defaults(model_dir: Path) -> dict | None:
    """A model directory's sampling defaults from its generation_config.json, read as transformers reads
    them: greedy unless do_sample, transformers' own defaults for what the file leaves out, and the
    repetition penalty in greedy mode too. None without the file."""
    path = model_dir / "generation_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoadError(f"{path} is not a JSON object")
    out = {GENERATION_NAMES.get(k, k): v if cfg.get(k) is None else cfg[k] for k, v in GENERATION_DEFAULTS.items()}
    if not cfg.get("do_sample"):
        out["temperature"] = 0.0
    return out


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LoadError(f"cannot read {index}: {e!r}") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise LoadError(f"{index} names weight files that are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise LoadError(f"{model_dir} has no model.safetensors or model.safetensors.index.json "
                    "(only safetensors weights are read; convert .bin checkpoints first)")


# The tokenizer classes by which AutoTokenizer means transformers' generic fast tokenizer (5.x:
# TokenizersBackend, which 4.x called PreTrainedTokenizerFast): that class is loaded directly, which is the
# same tokenizer without AutoTokenizer's model-config machinery and its import of torch (seconds of CPU in
# the chat's process, while torchrun imports torch beside it).
GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    try:
        settings = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        settings = {}
    try:
        if isinstance(settings, dict) and settings.get("tokenizer_class") in GENERIC_TOKENIZERS and "auto_map" not in settings:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise LoadError(f"cannot load the tokenizer from {model_dir}: {e}") from None


def eos_token_ids(model_dir: Path, trust_remote_code: bool = False) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS and the model's config and generation config
    (each an int or a list). Read from the files, so that the workers need no tokenizer."""
    model_dir = Path(model_dir)
    try:
        tok_eos = tokenizer_eos_id(model_dir)
    except LookupError:  # no tokenizer.json to look the token up in (a sentencepiece-only tokenizer)
        tok_eos = load_tokenizer(model_dir, trust_remote_code).eos_token_id
    ids = set() if tok_eos is None else {tok_eos}
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return sorted(ids)


def tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of the tokenizer's EOS token as transformers gives it (``eos_token`` of
    tokenizer_config.json, else of special_tokens_map.json, looked up in tokenizer.json's added tokens,
    then its vocabulary); None without an EOS token. LookupError when the files cannot tell."""
    def read(name: str) -> dict:
        path = model_dir / name
        try:
            return json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, json.JSONDecodeError) as e:
            raise LoadError(f"cannot read {path}: {e}") from None

    token = read("tokenizer_config.json").get("eos_token") or read("special_tokens_map.json").get("eos_token")
    if isinstance(token, dict):  # a serialised AddedToken
        token = token.get("content")
    if token is None:
        return None
    tok = read("tokenizer.json")
    for added in tok.get("added_tokens", []):
        if added.get("content") == token:
            return added["id"]
    vocab = tok.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return vocab[token]
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the index
        for i, (piece, _) in enumerate(vocab):
            if piece == token:
                return i
    raise LookupError(f"{model_dir}: the EOS token {token!r} is not in a tokenizer.json")


def resolved_dtype(cuda: bool, dtype: Dtype = Dtype.AUTO) -> Dtype:
    """The dtype a model runs at: bfloat16 on GPUs, float32 on the CPU, unless asked otherwise."""
    if dtype is not Dtype.AUTO:
        return dtype
    return Dtype.BFLOAT16 if cuda else Dtype.FLOAT32
