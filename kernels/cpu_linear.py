"""The row-invariant CPU kernels of ``cpu/`` (linears over packed weights, tree attention, decoder-block
glue), built with the host's C compiler for the machine at hand and loaded through ctypes.

The library holds one path per ISA family (portable C, AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI, AVX-512 BF16,
AMX), each file compiled with its own target flags, so every path is built on every x86 machine, whether it can run
there or not; ``cpu/dispatch.c`` runs the one chosen. Every path computes the same bits (cpu/kernels.h says
how), so the choice is one of speed alone: on first use each path this CPU runs is timed on a few linears,
and the fastest for one row (a decode step), for several (a verification) and for many (a prefill) are
kept. The library and that choice are built once per machine and source (several seconds) into the build directory the caller names, under a name made of the sources' hash, the compiler's version
and the CPU's flags, so a copied cache or an upgraded compiler never loads a library built for another
machine. Without a C compiler the kernels are unavailable (``load`` says why) and the CPU falls back to
torch's own ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

SOURCES = Path(__file__).with_name("cpu")
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl"]
# Each path's object: its source and target flags (a file built twice differs by -DSS_VNNI). The rest of
# the library (dispatch, pool, blocks) is built for the machine at hand (-march=native).
PATH_OBJECTS = {
    "portable": ("portable.c", []),
    **({
        "avx2": ("avx2.c", _AVX2),
        "avx_vnni": ("avx2.c", [*_AVX2, "-mavxvnni", "-DSS_VNNI"]),
        "avx512": ("avx512.c", _AVX512),
        "avx512_vnni": ("avx512.c", [*_AVX512, "-mavx512vnni", "-DSS_VNNI"]),
        "avx512_bf16": ("avx512.c", [*_AVX512, "-mavx512vnni", "-mavx512bf16", "-DSS_VNNI", "-DSS_BF16"]),
        "amx": ("amx.c", [*_AVX512, "-mavx512vnni", "-mamx-tile", "-mamx-int8"]),
    } if X86 else {}),
}
# For the tests of machines without them: the AMX path's logic with its tile instructions in plain C, the
# AVX-VNNI path's with its fused multiply-adds as AVX2's, the AVX-512 VNNI path's int8 tile in plain C.
EMULATED_AMX = ("amx.c", ["-DSS_AMX_EMULATE", "-Wno-psabi"])
EMULATED_AVX_VNNI = ("avx2.c", [*_AVX2, "-DSS_VNNI", "-DSS_VNNI_EMULATE"])
EMULATED_AVX512_VNNI = ("vnni512_emulated.c", ["-Wno-psabi"])
HOST_OBJECTS = ("dispatch.c", "pool.c", "blocks.c", "sample.c")
# -ffp-contract=off: no multiply and add fused where the canonical order keeps them apart (cpu/kernels.h)
CFLAGS = ["-O3", "-std=gnu11", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]


class Format(IntEnum):
    """A packed weight's format, as the kernels number them (cpu/kernels.h)."""

    Q4 = 0  # GGUF Q4_0 / Q4_1 blocks: 16 bytes of nibbles, d and m per 32 weights; int16 or int8 activations
    Q8 = 1  # GGUF Q8_0 blocks: 32 int8, d per 32 weights; int16 or int8 activations
    F16 = 2
    BF16 = 3
    F32 = 4


HALF_SCALES = 8  # a flag of the format (cpu/kernels.h): the integer formats' d and m are float16


class KernelsUnavailable(RuntimeError):
    """The C kernels cannot be built here; the message says why."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelsUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return cc


def _sources() -> list[Path]:
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".h"))


@functools.cache
def source_digest() -> str:
    """The kernels' sources and how they are built (the objects, their flags), as an identity: what was
    built or measured with other kernels is not reused."""
    h = hashlib.sha256(repr((PATH_OBJECTS, HOST_OBJECTS, CFLAGS)).encode())
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def compile_object(cc: str, source: str, flags: list[str], out: Path) -> subprocess.Popen:
    """Starts compiling one of the sources into an object file; the caller waits on it."""
    cmd = [cc, *CFLAGS, *flags, "-c", "-o", str(out), str(SOURCES / source)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _build(cc: str, lib: Path, paths: dict[str, tuple[str, list[str]]], host_flags: list[str]) -> None:
    """Compiles every object (at once) and links the library into ``lib``, atomically. A path's object that
    this compiler cannot build is left out (dispatch.c finds it absent); any other failure raises."""
    recipes = paths | {Path(src).stem: (src, (["-march=native"] if X86 else []) + host_flags) for src in HOST_OBJECTS}
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        outs = {name: Path(tmp) / f"{name}.o" for name in recipes}
        jobs = {name: compile_object(cc, src, flags, outs[name]) for name, (src, flags) in recipes.items()}
        objects = []
        for name, job in jobs.items():
            _, err = job.communicate(timeout=300)
            if job.returncode == 0:
                objects.append(str(outs[name]))
            elif name not in paths or name == "portable":
                raise KernelsUnavailable(f"compiling {recipes[name][0]} failed: {err.strip()[-2000:]}")
        so = Path(tmp) / lib.name
        done = subprocess.run([cc, "-shared", "-o", str(so), *objects, "-lpthread", "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise KernelsUnavailable(f"linking the CPU kernels failed: {done.stderr.strip()[-2000:]}")
        os.replace(so, lib)  # atomic: ranks that build at once each install a whole library


@functools.cache
def _built(build_dir: Path, host_flags: tuple[str, ...]) -> tuple[ctypes.CDLL, Path]:
    """The compiled library and its file, built into ``build_dir`` on first use."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"the C compiler {cc} does not run: {e}") from None
    key = hashlib.sha256(f"{source_digest()} {version} {_cpu_flags()} {platform.machine()} {host_flags}".encode())
    lib = Path(build_dir) / f"cpu_linear-{key.hexdigest()[:16]}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        build(lib, host_flags=list(host_flags))
    return bind(ctypes.CDLL(str(lib))), lib


_PATHS_CHOSEN_FOR: dict[Path, tuple[int, int]] = {}  # a library file -> the activations its paths in use suit


def load(build_dir: Path, activation_bits: int | None = None, host_flags: tuple[str, ...] = (),
         bf16_activations: bool | None = None) -> ctypes.CDLL:
    """The compiled library, built into ``build_dir`` on first use and running the fastest paths here for
    its activations: ``activation_bits`` (16 or 8) and ``bf16_activations`` from now on where given, else
    what it has (int16 and fp32 at first); ``host_flags``: a build of its own with more flags for the host
    objects (see ``build``). KernelsUnavailable when it cannot be built."""
    dll, lib = _built(Path(build_dir), tuple(host_flags))
    if activation_bits is not None:
        set_activation_bits(dll, activation_bits)
    if bf16_activations is not None and bf16_activations != bool(dll.ss_bf16_activations()):
        set_bf16_activations(dll, bf16_activations)
    activations = (dll.ss_activation_bits(), dll.ss_bf16_activations())
    if _PATHS_CHOSEN_FOR.get(lib) != activations:
        use_paths(dll, fastest_paths(dll, lib.with_suffix(path_record(dll))))
        _PATHS_CHOSEN_FOR[lib] = activations
    return dll


def path_record(dll: ctypes.CDLL) -> str:
    """The suffix of the record of the fastest paths for the library's activations (each has its own)."""
    if dll.ss_bf16_activations():
        return ".path-bf16.json"
    return ".path.json" if dll.ss_activation_bits() == 16 else ".path-int8.json"


def build(lib: Path, paths: dict[str, tuple[str, list[str]]] = PATH_OBJECTS, host_flags: list[str] | None = None
          ) -> None:
    """Builds the library of ``paths`` (each path's source and flags) into ``lib``; ``host_flags``: more flags
    for the host objects (``-DSS_STEP_PROFILE``: the blocks time their parts)."""
    try:
        _build(_compiler(), lib, paths, host_flags or [])
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"compiling the CPU kernels failed: {e}") from None


def bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """The library with its entry points' argument types declared."""
    dll.ss_linear.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 6
    dll.ss_linear.restype = ctypes.c_int
    dll.ss_set_activation_bits.argtypes = [ctypes.c_int]
    dll.ss_set_activation_bits.restype = ctypes.c_int
    dll.ss_set_bf16_activations.argtypes = [ctypes.c_int]
    dll.ss_set_bf16_activations.restype = None
    dll.ss_set_threads.argtypes = [ctypes.c_int]
    dll.ss_set_threads.restype = ctypes.c_int
    dll.ss_attention.argtypes = [ctypes.c_int] * 7 + [ctypes.c_float] + [ctypes.c_void_p] * 5
    dll.ss_attention.restype = ctypes.c_int
    dll.ss_path_name.argtypes = [ctypes.c_int]
    dll.ss_path_name.restype = ctypes.c_char_p
    dll.ss_path_runs.argtypes = [ctypes.c_int]
    dll.ss_path_min_rows.argtypes = [ctypes.c_int]
    dll.ss_use_path.argtypes = [ctypes.c_int]
    dll.ss_use_path_for.argtypes = [ctypes.c_int, ctypes.c_int]
    dll.ss_path_for.argtypes = [ctypes.c_int]
    dll.ss_attention_block.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] \
        + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dll.ss_attention_block.restype = ctypes.c_int
    dll.ss_mlp_block.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
    dll.ss_mlp_block.restype = ctypes.c_int
    dll.ss_forward.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    dll.ss_forward.restype = ctypes.c_int
    dll.ss_add_rms_norm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 5
    dll.ss_add_rms_norm.restype = None
    dll.ss_choose.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 \
        + [ctypes.c_float] * 5 + [ctypes.c_void_p] * 2
    dll.ss_choose.restype = ctypes.c_int
    dll.ss_step_profile.argtypes = [ctypes.c_void_p]
    dll.ss_step_profile.restype = ctypes.c_int
    return dll


@dataclass(frozen=True)
class KernelPath:
    """One of the library's paths: its index in dispatch.c's table, its name, whether this CPU runs it, and
    the fewest rows of the calls it is chosen for."""

    index: int
    name: str
    runs: bool
    min_rows: int


def paths(dll: ctypes.CDLL) -> list[KernelPath]:
    """The paths compiled into the library, widest first."""
    found = []
    for i in range(dll.ss_path_count()):
        name = dll.ss_path_name(i)
        if name is not None:
            found.append(KernelPath(i, name.decode(), bool(dll.ss_path_runs(i)), dll.ss_path_min_rows(i)))
    return found


@dataclass(frozen=True)
class PathChoice:
    """The paths in use, by name, one a class of calls by their rows (cpu/dispatch.c): several rows (a
    verification), one row (a decode step), many rows (a prefill; dispatch.c's ss_many_rows() and more).
    Every path gives the same bits, so each class may take the path that runs it fastest."""

    rows: str
    one_row: str
    many_rows: str


# The rows of a call of each PathChoice class: what it is measured at and how dispatch.c is told its class.
CLASS_ROWS = {"rows": 8, "one_row": 1, "many_rows": 32}


def _index(dll: ctypes.CDLL, name: str) -> int:
    for p in paths(dll):
        if p.name == name and p.runs:
            return p.index
    raise ValueError(f"the CPU kernels have no path {name!r} that runs here")


def use_path(dll: ctypes.CDLL, name: str) -> None:
    """Runs the path called ``name`` from now on, for every call."""
    dll.ss_use_path(_index(dll, name))


def use_paths(dll: ctypes.CDLL, choice: PathChoice) -> None:
    """Runs each class's path of ``choice`` for its calls."""
    indices = {cls: _index(dll, name) for cls, name in asdict(choice).items()}
    for cls, i in indices.items():
        dll.ss_use_path_for(CLASS_ROWS[cls], i)


def paths_in_use(dll: ctypes.CDLL) -> PathChoice:
    return PathChoice(**{cls: dll.ss_path_name(dll.ss_path_for(rows)).decode() for cls, rows in CLASS_ROWS.items()})


def isa(dll: ctypes.CDLL) -> str:
    """The paths in use, as the precision label shows them: "AVX-512 VNNI", and where another path runs one
    row or many, "AVX-512 VNNI, one row AVX-VNNI, 16+ rows AMX"."""
    choice = paths_in_use(dll)
    label = [choice.rows]
    if choice.one_row != choice.rows:
        label.append(f"one row {choice.one_row}")
    if choice.many_rows != choice.rows:
        label.append(f"{dll.ss_many_rows()}+ rows {choice.many_rows}")
    return ", ".join(label)


PATH_ROUNDS = 7  # rounds of the paths' measurement (_path_seconds)


def _path_seconds(dll: ctypes.CDLL, candidates: list[KernelPath]) -> dict[str, dict[str, float]]:
    """Each path's time on the linears a decode step, a verification and a prefill are made of (Q4 and Q8
    weights of the embedded model's shapes, BF16 ones with bf16 activations; one thread), for each
    PathChoice class it is meant for (its min_rows) at the class's CLASS_ROWS. Round by round, every path
    in turn, so that a machine whose speed drifts while it measures (a busy neighbour, a VM's host) weighs
    on every path alike; a round's time is the sum of each linear's best of two calls, a path's the median
    of its rounds. A path over twice the fastest in every class it serves after the first round (the
    portable one) is not measured again."""
    g = torch.Generator().manual_seed(0)
    linears = []  # the embedded model's MLP (gate and up as one linear, down) and a Q8 weight as wide
    bf16 = bool(dll.ss_bf16_activations())
    for fmt, n, k in ((Format.Q4, 3072, 576), (Format.Q4, 576, 1536), (Format.Q8, 4096, 576)):
        nb = k // 32
        if bf16:
            fmt, d, m = Format.BF16, None, None
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        else:
            w = torch.randint(-100, 100, (n, nb * (16 if fmt == Format.Q4 else 32)), generator=g, dtype=torch.int8)
            d, m = torch.rand(n, nb, generator=g), torch.rand(n, nb, generator=g)
        linears.append((fmt, n, w, d, m, {rows: torch.randn(rows, k, generator=g) for rows in CLASS_ROWS.values()}))
    times = {p.name: {cls: [] for cls, rows in CLASS_ROWS.items() if rows >= p.min_rows} for p in candidates}
    measured = list(times)
    for r in range(PATH_ROUNDS):
        for name in measured:
            use_path(dll, name)
            for cls in times[name]:
                total = 0.0
                for fmt, n, w, d, m, xs in linears:
                    best = float("inf")
                    for _ in range(2):
                        t0 = time.perf_counter()
                        linear(dll, fmt, xs[CLASS_ROWS[cls]], n, w, d, m)
                        best = min(best, time.perf_counter() - t0)
                    total += best
                times[name][cls].append(total)
        if r == 0:
            fastest = {cls: min(t[cls][0] for t in times.values() if cls in t) for cls in CLASS_ROWS}
            measured = [name for name in measured if any(t[0] <= 2 * fastest[cls] for cls, t in times[name].items())]
    return {name: {cls: statistics.median(t) for cls, t in classes.items()} for name, classes in times.items()}


def fastest_paths(dll: ctypes.CDLL, record: Path) -> PathChoice:
    """The fastest paths this CPU runs, for each class of calls among the paths meant for it, measured once
    and kept in ``record`` beside the library."""
    runs = {p.name for p in paths(dll) if p.runs}
    try:
        kept = json.loads(record.read_text())
        choice = PathChoice(**{cls: kept[cls] for cls in CLASS_ROWS})
        if set(asdict(choice).values()) <= runs:
            return choice
    except (OSError, ValueError, KeyError, TypeError):
        pass
    previous = dll.ss_threads()
    set_threads(dll, 1)
    try:
        seconds = _path_seconds(dll, [p for p in paths(dll) if p.runs])
    finally:
        set_threads(dll, previous)
    choice = PathChoice(**{cls: min((name for name in seconds if cls in seconds[name]),
                                    key=lambda name, cls=cls: seconds[name][cls]) for cls in CLASS_ROWS})
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=record.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({**asdict(choice), "seconds": seconds}, f)
    os.replace(tmp, record)
    return choice


def set_activation_bits(dll: ctypes.CDLL, bits: int) -> None:
    """Quantises the integer formats' activations to ``bits`` (16, or llama.cpp's 8) from now on."""
    if dll.ss_set_activation_bits(bits) != 0:
        raise ValueError(f"the CPU kernels quantise activations to 16 or 8 bits, not {bits}")


def set_bf16_activations(dll: ctypes.CDLL, on: bool) -> None:
    """BF16 weights multiply bf16 activations from now on (vdpbf16ps where the CPU has it), or fp32 ones;
    either way the paths in use are the widest that run until ``use_paths`` says otherwise."""
    dll.ss_set_bf16_activations(int(on))


def set_threads(dll: ctypes.CDLL, n: int) -> int:
    """The kernels' own thread count (their pool is separate from torch's); returns the count in force."""
    return dll.ss_set_threads(n)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(dll: ctypes.CDLL, fmt: Format, x: Tensor, n: int, w: Tensor, d: Tensor | None = None,
           m: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """x [..., K] fp32 times the packed weight of ``n`` output features -> [..., n] fp32; the integer
    formats' ``d`` and ``m`` are float32 or float16."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if dll.ss_linear(scales_format(fmt, d), x2.shape[0], x2.shape[1], n, x2.data_ptr(), w.data_ptr(), _ptr(d), _ptr(m),
                     _ptr(bias), out.data_ptr()) != 0:
        raise MemoryError("cpu_linear: out of memory for the activations' integer copy")
    return out.view(*shape[:-1], n)


def scales_format(fmt: Format, d: Tensor | None) -> int:
    """The format as the kernels take it: with HALF_SCALES where the scales are float16."""
    return int(fmt) | (HALF_SCALES if d is not None and d.dtype == torch.float16 else 0)


class Penalties(NamedTuple):
    """What ``choose`` penalises the logits of a tree's nodes by (``tokens``, ``parents`` as a verification
    has them), as Sampler.penalise does: each node's tokens in the last ``last_n`` of its context (``history``,
    the tokens before the root, then the node's path), each seen c times: divided by ``repeat`` (multiplied
    where negative), then less ``frequency`` c and ``presence``. A tuple: made right after a forward, when
    every Python object is slow to make (kernels/cpu/sample.c)."""

    history: list[int]
    tokens: list[int]
    parents: list[int]
    last_n: int
    repeat: float
    frequency: float
    presence: float


def choose(dll: ctypes.CDLL, logits: Tensor, temperature: float, min_p: float = 0.0, uniforms: Tensor | None = None,
           penalties: Penalties | None = None) -> Tensor:
    """One token per row of logits [n, V] (fp32, contiguous; penalties change them in place): with
    ``penalties``, each row's first; then the first of its largest logits when ``temperature`` is 0, else a
    draw at its uniform in [0, 1) (``uniforms`` [n] float64) from softmax(logits / temperature) with min-p
    (0: off), the inverse of the cumulative distribution, never a token of mass 0 (a -inf logit, or one min-p
    removes). [n] int64."""
    n, vocab = logits.shape
    out = np.empty(n, dtype=np.int64)
    tree: tuple = (None, None, None, 0, 0, 1.0, 0.0, 0.0)
    if penalties is not None:
        tail = penalties.history[-penalties.last_n:]
        ints = np.array(penalties.tokens + penalties.parents + tail, dtype=np.int64)  # one array: one object
        at = ints.ctypes.data
        tree = (at, at + 8 * n, at + 16 * n, len(tail), penalties.last_n, penalties.repeat, penalties.frequency,
                penalties.presence)
    if dll.ss_choose(n, vocab, logits.data_ptr(), *tree, temperature, min_p,
                     None if uniforms is None else uniforms.data_ptr(), out.ctypes.data) != 0:
        raise MemoryError("cpu_linear: out of memory for the sampler's row")
    return torch.from_numpy(out)


def kv_half(k_cache: Tensor) -> int:
    """How the kernels are told a KV cache's elements: 1 for float16, 0 for float32 (the two they read)."""
    if k_cache.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"the CPU kernels read a KV cache of float16 or float32, not {k_cache.dtype}")
    return int(k_cache.dtype == torch.float16)


def attention(dll: ctypes.CDLL, q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Tree attention of q [T, H, D] over k/v [Hkv, S_max, D] (float32, or float16 read as their exact fp32
    values) under ``mask`` [T, S] bool (S <= S_max): one fixed order over the keys per row, so a row's result
    does not depend on the other rows."""
    T, H, D = q.shape
    Hkv, s_max, _ = k_cache.shape
    q = q.contiguous()
    mask = mask.contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32)
    if dll.ss_attention(T, H, Hkv, D, mask.shape[1], s_max, kv_half(k_cache), scale, q.data_ptr(), k_cache.data_ptr(),
                        v_cache.data_ptr(), mask.data_ptr(), out.data_ptr()) != 0:
        raise MemoryError("cpu_linear: out of memory for the attention scores")
    return out
