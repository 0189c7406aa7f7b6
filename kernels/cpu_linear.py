"""The row-invariant CPU kernels of ``cpu_linear.c`` (linears over packed weights, tree attention), built
with the host's C compiler for the machine at hand and loaded through ctypes.

The library is compiled once per machine and source (``-O3 -march=native``, about a second) into the
build directory the caller names, under a name made of the source's hash, the compiler's version and
the CPU's flags, so a copied cache or an upgraded compiler never loads a library built for another
machine. Without a C compiler the kernels are unavailable (``load`` says why) and the CPU falls back to
torch's own ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from enum import IntEnum
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_linear.c")


class Format(IntEnum):
    """A packed weight's format, as cpu_linear.c numbers them."""

    Q4 = 0  # GGUF Q4_0 / Q4_1 blocks: 16 bytes of nibbles, fp32 d and m per 32 weights; int16 activations
    Q8 = 1  # GGUF Q8_0 blocks: 32 int8, fp32 d per 32 weights; int16 activations
    F16 = 2
    BF16 = 3
    F32 = 4


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


@functools.cache
def source_digest() -> str:
    """The kernels' source, as an identity: what was measured with other kernels is not reused."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


@functools.cache
def load(build_dir: Path) -> ctypes.CDLL:
    """The compiled library, built into ``build_dir`` on first use; KernelsUnavailable when it cannot be."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelsUnavailable(f"the C compiler {cc} does not run: {e}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode() + platform.machine().encode())
    lib = Path(build_dir) / f"cpu_linear-{key.hexdigest()[:16]}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lpthread", "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, lib)  # atomic: ranks that build at once each install a whole library
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {e}") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
    dll = ctypes.CDLL(str(lib))
    dll.ss_linear.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 6
    dll.ss_linear.restype = ctypes.c_int
    dll.ss_set_threads.argtypes = [ctypes.c_int]
    dll.ss_set_threads.restype = ctypes.c_int
    dll.ss_attention.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 5
    dll.ss_attention.restype = ctypes.c_int
    dll.ss_avx2.restype = ctypes.c_int
    dll.ss_attention_block.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] \
        + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dll.ss_attention_block.restype = ctypes.c_int
    dll.ss_mlp_block.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
    dll.ss_mlp_block.restype = ctypes.c_int
    return dll


def isa(dll: ctypes.CDLL) -> str:
    """The instruction set the library was built for: what the precision label shows."""
    return "AVX2" if dll.ss_avx2() else "portable C"


def set_threads(dll: ctypes.CDLL, n: int) -> int:
    """The kernels' own thread count (their pool is separate from torch's); returns the count in force."""
    return dll.ss_set_threads(n)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(dll: ctypes.CDLL, fmt: Format, x: Tensor, n: int, w: Tensor, d: Tensor | None = None,
           m: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """x [..., K] fp32 times the packed weight of ``n`` output features -> [..., n] fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if dll.ss_linear(int(fmt), x2.shape[0], x2.shape[1], n, x2.data_ptr(), w.data_ptr(), _ptr(d), _ptr(m),
                     _ptr(bias), out.data_ptr()) != 0:
        raise MemoryError("cpu_linear: out of memory for the activations' int16 copy")
    return out.view(*shape[:-1], n)


def attention(dll: ctypes.CDLL, q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Tree attention of q [T, H, D] over k/v [Hkv, S_max, D] (fp32) under ``mask`` [T, S] bool (S <= S_max):
    one fixed order over the keys per row, so a row's result does not depend on the other rows."""
    T, H, D = q.shape
    Hkv, s_max, _ = k_cache.shape
    q = q.contiguous()
    mask = mask.contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32)
    if dll.ss_attention(T, H, Hkv, D, mask.shape[1], s_max, scale, q.data_ptr(), k_cache.data_ptr(),
                        v_cache.data_ptr(), mask.data_ptr(), out.data_ptr()) != 0:
        raise MemoryError("cpu_linear: out of memory for the attention scores")
    return out
