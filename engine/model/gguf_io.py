"""GGUF files: the quantised block types (their layout, their dequantisation as gguf-py computes it) and
the one conversion of a GGUF, through transformers' GGUF loader, into a Hugging Face directory (safetensors,
config, tokenizer) in the user's cache, which later loads read. The safetensors keep the GGUF's quantised
blocks (the loader dequantises them): about the GGUF's size, where dequantised fp32 would be 4-6 times
larger and a 16-bit copy would change the model.

torch, gguf-py and transformers are imported inside the functions that use them: ``model_dir`` reads this
module's names in the Engine's own process, which never imports torch (a slow import at start).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from swiftspec.engine.config import Dtype
from swiftspec.engine.paths import cache_dir

if TYPE_CHECKING:
    import torch

class GGUFError(ValueError):
    """A GGUF file that cannot be converted: not GGUF, cut short, or an architecture transformers lacks."""


def _gguf_problem(gguf: Path, error: Exception) -> str:
    """Why reading a GGUF failed, in words: the reader's own message ("unpack_from requires a buffer of
    8 bytes") only means something to its author."""
    with gguf.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return "not a GGUF file (it does not start with the GGUF signature)"
    if isinstance(error, (struct.error, EOFError, IndexError)) or any(
            word in str(error) for word in ("buffer", "mmap", "cannot reshape")):  # data shorter than its header says
        return f"the file is truncated or corrupt ({gguf.stat().st_size:,} bytes); copy or download it again"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")  # the GGUF types the gguf CPU backend runs from their blocks
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q8_0": (32, 34)}  # values, bytes a block


def q4_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks [n, 144] (fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
    32, 128 bytes of nibbles) as fp32 d * scale and dmin * min [n, 8] and the values [n, 8, 32] uint8:
    w = (d * scale) q - dmin * min, as gguf-py computes it (both products are exact in fp32)."""
    import torch

    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    lo, hi, mixed = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    scale = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], 1).float()
    mins = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], 1).float()
    qs = b[:, 16:].reshape(-1, 4, 1, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    q = torch.cat([qs & 0x0F, qs >> 4], 2).reshape(-1, 8, 32)
    return d * scale, dmin * mins, q


def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF blocks ([rows, bytes per row], uint8) as fp32 [rows, columns], computed as gguf-py computes them
    for transformers (fp16 scales to fp32, then d*q + m in two roundings): the very same model bit for bit.
    This runs on every start, over every weight: one uint8 to fp32 pass, the rest in place (mixed-dtype
    torch ops take a slow path)."""
    import torch

    values, size = GGUF_BLOCKS[kind]
    b = blocks.reshape(-1, size)
    if kind == "Q4_K":
        scale, offset, q = q4_k_parts(b)
        return (q.float() * scale[..., None] - offset[..., None]).reshape(blocks.shape[0], -1)
    d = b[:, :2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        return b[:, 2:].view(torch.int8).float().mul_(d).reshape(blocks.shape[0], -1)
    qs = b[:, -values // 2:]
    q = torch.empty(len(b), 2, values // 2, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=q[:, 0])
    torch.bitwise_right_shift(qs, 4, out=q[:, 1])
    y = q.view(len(b), values).float()
    if kind == "Q4_0":
        return y.sub_(8).mul_(d).reshape(blocks.shape[0], -1)
    return y.mul_(d).add_(b[:, 2:4].contiguous().view(torch.float16).float()).reshape(blocks.shape[0], -1)


LOCK_FILE = ".lock"  # held by the process converting into a .tmp-* directory
MAX_SAFETENSORS_HEADER = 100 << 20
CONVERSION_FORMAT = 3  # bump when the converted files change, so older ones are not reused (1: fp32, 2: bf16)
FORMAT_METADATA = "swiftspec.conversion"  # safetensors metadata: the CONVERSION_FORMAT that wrote it
SOURCE_METADATA = "swiftspec.gguf_type"  # safetensors metadata: the GGUF's main tensor type, e.g. Q4_1
GGUF_METADATA = "swiftspec.gguf_blocks"  # safetensors metadata: {tensor name: block type} of kept blocks


def converted_dir(gguf: Path, conversion_format: int = CONVERSION_FORMAT) -> Path:
    """Where the conversion of this GGUF lives: keyed by its content (size, first and last MiB: the header
    with every tensor's name, shape and offset, and the last tensors' data), not its path, so each venv that
    installs the same file shares one conversion instead of leaving a 540 MB copy per install behind."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{conversion_format}:{size}:".encode())
    with gguf.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return cache_dir() / "converted" / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def _narrowest(t):
    """``t`` in the narrowest float dtype that holds every value exactly (F16 and BF16 tensors, norms)."""
    import torch

    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(t.to(dtype).float(), t):
            return t.to(dtype)
    return t


def _save_weights(model, gguf: Path, out: Path) -> None:
    """Writes each of ``model``'s weights (transformers' fp32 dequantisation of ``gguf``) in the least space
    that gives it back bit for bit: the GGUF's own blocks, where the loader's dequantisation of them equals
    transformers' (checked here, tensor by tensor), else the narrowest exact float dtype. A 16-bit copy of
    dequantised blocks is not exact: d*q + m of Q4_1 is no fp16 number for ~32 % of SmolLM2's weights and no
    bf16 number for ~75 %. transformers refuses save_pretrained on a GGUF-loaded model, so the weights and
    config are written directly."""
    from collections import Counter

    import numpy as np
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )


    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    reader = GGUFReader(gguf)
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    kinds: dict[str, str] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in GGUF_BLOCKS:
            continue
        try:  # the row permutations transformers applies to q and k apply to rows of blocks as well
            result = processor.process(weights=np.asarray(t.data), name=t.name, tensor_key_mapping=names,
                                       parsed_parameters={"config": config, "tensors": {}})
            name, blocks = names.get(result.name), torch.from_numpy(np.array(result.weights))
            exact = name in state and torch.equal(dequantize(blocks, kind), state[name])
        except (ValueError, RuntimeError):  # a processor that reshapes by columns: stored dequantised
            exact = False
        if exact:
            state[name], kinds[name] = blocks, kind
    state = {k: v if k in kinds else _narrowest(v) for k, v in state.items()}
    main = Counter()
    for t in reader.tensors:
        main[t.tensor_type.name] += int(t.n_elements)
    save_file(state, str(out / "model.safetensors"), metadata={
        "format": "pt", GGUF_METADATA: json.dumps(kinds), FORMAT_METADATA: str(CONVERSION_FORMAT),
        SOURCE_METADATA: main.most_common(1)[0][0]})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def precision_label(model_dir: Path, dtype: Dtype) -> str:
    """How the title bar says what the target runs at: ``dtype`` ("fp32"), and for a converted GGUF the
    type its blocks came in, which is not what runs (they are dequantised at load): "fp32 (from Q4_1 GGUF)"."""
    short = {Dtype.FLOAT32: "fp32", Dtype.BFLOAT16: "bf16", Dtype.FLOAT16: "fp16"}.get(dtype, dtype.value)
    try:
        with (model_dir / "model.safetensors").open("rb") as f:
            source = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"][SOURCE_METADATA]
    except (OSError, ValueError, KeyError, TypeError):  # not a conversion (or sharded): plain weights
        return short
    return f"{short} (from {source} GGUF)"


def damage(out: Path) -> str | None:
    """Why the converted directory ``out`` cannot be used (a file missing, model.safetensors shorter or
    longer than its own header says), or None. Reads only the safetensors header: cheap on every start."""
    for name in ("config.json", "model.safetensors"):
        if not (out / name).is_file():
            return f"{name} is missing"
    weights = out / "model.safetensors"
    try:
        with weights.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n <= MAX_SAFETENSORS_HEADER else None
    except (OSError, struct.error, ValueError) as e:
        return f"model.safetensors has no readable header ({e})"
    if not isinstance(header, dict):
        return "model.safetensors has no readable header"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    size = weights.stat().st_size
    if size != 8 + n + end:
        return f"model.safetensors is {size} bytes, its header says {8 + n + end}"
    return None


def _remove_stale_temp_dirs(parent: Path) -> None:
    """Removes what conversions killed half-way left behind (their lock is free); a conversion that is
    still running holds its lock and is left alone."""
    for tmp in parent.glob(".tmp-*"):
        lock = tmp / LOCK_FILE
        try:
            if not lock.exists():  # just created (the lock comes next), or not ours: only when old
                if time.time() - tmp.stat().st_mtime > 3600:
                    shutil.rmtree(tmp, ignore_errors=True)
                continue
            with lock.open("a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(tmp, ignore_errors=True)
        except (BlockingIOError, FileNotFoundError):
            continue


def _convert(gguf: Path, out: Path, say: Callable[[str], None]) -> None:
    """Dequantises ``gguf`` through transformers into ``out``: safetensors, config and tokenizer."""
    from unittest import mock

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, modeling_gguf_pytorch_utils

    transformers.utils.logging.disable_progress_bar()
    say(f"converting {gguf.name} (once, step 1/3): reading and dequantising the GGUF")
    try:
        # The GGUF reader draws its own tqdm bar on stderr, past transformers' switch; our stages say enough.
        with mock.patch.object(modeling_gguf_pytorch_utils, "tqdm", lambda items, **_: items):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        say(f"converting {gguf.name} (once, step 2/3): reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # the gguf reader fails with struct, value and index errors alike
        raise GGUFError(f"cannot convert {gguf}: {_gguf_problem(gguf, e)}") from None
    say(f"converting {gguf.name} (once, step 3/3): writing safetensors")
    _save_weights(model, gguf, out)
    tokenizer.save_pretrained(out)


def ensure_converted(gguf: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Returns a Hugging Face directory for ``gguf``, converting it first if needed.

    The conversion writes into a locked temporary directory beside the target and renames it into place,
    so a conversion killed half-way leaves no broken cache entry, and the next start removes its leftovers.
    A converted copy that was damaged since (truncated, a file deleted) is converted again; one in an older
    format (another key) is converted again and then removed. ``progress`` gets one line per stage (the CLI
    shows them; the library prints nothing).
    """
    say = progress or (lambda _text: None)
    out = converted_dir(gguf)
    _remove_stale_temp_dirs(out.parent)
    if out.exists():
        why = damage(out)
        if why is None:
            return out
        say(f"the converted copy {out} is damaged ({why}): converting {gguf.name} again")
        aside = Path(tempfile.mkdtemp(prefix=".tmp-damaged-", dir=out.parent))
        try:
            out.rename(aside / out.name)
        except OSError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        with (tmp / LOCK_FILE).open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _convert(gguf, tmp, say)
            (tmp / LOCK_FILE).unlink()
            try:
                tmp.rename(out)
            except OSError:  # another process finished first
                if damage(out) is not None:
                    raise
        say(f"converted {gguf.name} -> {out}")
        for older in range(1, CONVERSION_FORMAT):  # what older versions converted the same file into
            stale = converted_dir(gguf, older)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
                say(f"removed {stale}, its conversion in an older format")
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
