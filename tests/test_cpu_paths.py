"""The CPU kernels' ISA paths (kernels/cpu/): every path this machine runs computes what the portable path
computes, bit for bit, on random shapes (partial panels, odd block counts), every format and row count,
one thread or two, with int16 or int8 activations, and BF16 weights on bf16 ones; every path, whether it
runs here or not, compiles; the library names the path it runs and keeps the one it measured fastest."""

import ctypes
import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from swiftspec.engine.config import Activations
from swiftspec.engine.model import cpu_backends, cpu_blocks
from swiftspec.kernels import cpu_linear
from swiftspec.kernels.cpu_linear import Format

PORTABLE = "portable C"
FLOAT_DTYPES = {Format.F32: torch.float32, Format.F16: torch.float16, Format.BF16: torch.bfloat16}


@pytest.fixture(scope="module")
def dll():
    lib = cpu_backends.library(Activations.INT16)
    chosen = cpu_linear.paths_in_use(lib)
    yield lib
    cpu_linear.use_paths(lib, chosen)
    cpu_linear.set_threads(lib, 1)


def running(dll) -> list[str]:
    return [p.name for p in cpu_linear.paths(dll) if p.runs]


def in_use(dll) -> set[str]:
    """The paths in use, every class of calls."""
    return set(asdict(cpu_linear.paths_in_use(dll)).values())


def on_every_path(dll, fn) -> dict[str, torch.Tensor]:
    out = {}
    for name in running(dll):
        cpu_linear.use_path(dll, name)
        out[name] = fn()
    return out


@pytest.fixture(params=[16, 8], ids=["int16", "int8"])
def bits(request, dll):
    """The activations' width the library quantises to during the test (both, in turn), then int16 again."""
    cpu_linear.set_activation_bits(dll, request.param)
    yield request.param
    cpu_linear.set_activation_bits(dll, 16)


def weights(g: torch.Generator, fmt: Format, n: int, k: int):
    """Random packed weights, in panels: any bytes are valid blocks (Q4: 16 nibble pairs, Q8: 32 int8 a
    block), and the padding columns of the last panel hold random values too (the kernels must not store
    them)."""
    nb = k // 32
    if fmt in (Format.Q4, Format.Q8):
        panels = -(-n // cpu_blocks.PANEL)
        qs = torch.randint(-128, 128, (panels, nb, cpu_blocks.PANEL * (16 if fmt == Format.Q4 else 32)), generator=g,
                           dtype=torch.int8)
        scales = (panels, nb, cpu_blocks.PANEL)
        return qs, torch.rand(*scales, generator=g) * 0.02, torch.randn(*scales, generator=g) * 0.02
    return (torch.randn(n, k, generator=g) * 0.1).to(FLOAT_DTYPES[fmt]), None, None


def test_the_portable_path_and_a_vector_one_run_on_x86(dll):
    names = {p.name for p in cpu_linear.paths(dll)}
    assert PORTABLE in names
    if cpu_linear.X86:  # compiled, whether they run here or not
        assert {"AVX2", "AVX-VNNI", "AVX-512", "AVX-512 VNNI", "AVX-512 BF16", "AMX"} <= names
        assert in_use(dll) <= set(running(dll))


@pytest.mark.parametrize("fmt", list(Format))
@pytest.mark.parametrize("blocks", [1, 7, 8, 9, 15, 18, 31, 48])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_path_computes_the_portable_bits(dll, fmt, blocks, threads):
    g = torch.Generator().manual_seed(blocks * 10 + int(fmt))
    # 7 panels, the last partial (tiles of 4, 2 and 1 panels): 9 columns reach both 8-lane halves of the
    # last panel, 4 its first half only
    k, n = 32 * blocks, 105 if blocks % 2 else 100
    w, d, m = weights(g, fmt, n, k)
    bias = torch.randn(n, generator=g)
    x = torch.randn(11, k, generator=g)
    x[3, 5] = 60.0  # a block with one large activation
    x[7, :32] = 0.0  # a block of zeros: scale 0
    cpu_linear.set_threads(dll, threads)
    outs = on_every_path(dll, lambda: cpu_linear.linear(dll, fmt, x, n, w, d, m, bias))
    rows = on_every_path(dll, lambda: torch.cat([cpu_linear.linear(dll, fmt, x[i:i + 1], n, w, d, m, bias)
                                                  for i in range(len(x))]))
    cpu_linear.set_threads(dll, 1)
    for name in outs:
        assert torch.equal(outs[name], outs[PORTABLE]), name
        assert torch.equal(rows[name], outs[PORTABLE]), name  # row invariance on every path


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("blocks", [1, 7, 18, 31])
@pytest.mark.parametrize("threads", [1, 2])
def test_with_int8_activations_every_path_computes_the_portable_bits(dll, fmt, blocks, threads):
    """The int8 tiles (byte multiply-adds, their columns in another order) and every other path's int16
    ones on the same int8 values: one answer, row by row too."""
    g = torch.Generator().manual_seed(blocks * 10 + int(fmt) + 1)
    k, n = 32 * blocks, 105 if blocks % 2 else 100
    w, d, m = weights(g, fmt, n, k)
    bias = torch.randn(n, generator=g)
    x = torch.randn(11, k, generator=g)
    x[3, 5] = 60.0
    x[7, :32] = 0.0
    cpu_linear.set_threads(dll, threads)
    cpu_linear.set_activation_bits(dll, 8)
    try:
        outs = on_every_path(dll, lambda: cpu_linear.linear(dll, fmt, x, n, w, d, m, bias))
        rows = on_every_path(dll, lambda: torch.cat([cpu_linear.linear(dll, fmt, x[i:i + 1], n, w, d, m, bias)
                                                      for i in range(len(x))]))
    finally:
        cpu_linear.set_activation_bits(dll, 16)
        cpu_linear.set_threads(dll, 1)
    for name in outs:
        assert torch.equal(outs[name], outs[PORTABLE]), name
        assert torch.equal(rows[name], outs[PORTABLE]), name
    assert not torch.equal(outs[PORTABLE], cpu_linear.linear(dll, fmt, x, n, w, d, m, bias))  # int16's differ


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
def test_every_row_tile_computes_the_portable_bits(dll, fmt, bits):
    """Every count of rows a verification sends (each tile size, and counts split into several tiles)."""
    g = torch.Generator().manual_seed(int(fmt))
    k, n = 32 * 18, 105
    w, d, m = weights(g, fmt, n, k)
    x = torch.randn(17, k, generator=g)
    alone = on_every_path(dll, lambda: torch.cat([cpu_linear.linear(dll, fmt, x[i:i + 1], n, w, d, m)
                                                   for i in range(len(x))]))
    for rows in range(2, len(x) + 1):
        outs = on_every_path(dll, lambda rows=rows: cpu_linear.linear(dll, fmt, x[:rows], n, w, d, m))
        for name in outs:
            assert torch.equal(outs[name], alone[PORTABLE][:rows]), (name, rows)
            assert torch.equal(alone[name], alone[PORTABLE]), name


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("blocks", [7, 18, 31])
def test_half_scales_give_the_bits_of_their_float_values(dll, fmt, blocks):
    """A GGUF's scales are float16: read as halves, they give on every path what their float32 values give."""
    g = torch.Generator().manual_seed(blocks)
    k, n = 32 * blocks, 37
    w, d, m = weights(g, fmt, n, k)
    d, m = d.half(), m.half()
    x = torch.randn(9, k, generator=g)
    halves = on_every_path(dll, lambda: cpu_linear.linear(dll, fmt, x, n, w, d, m))
    floats = on_every_path(dll, lambda: cpu_linear.linear(dll, fmt, x, n, w, d.float(), m.float()))
    for name in halves:
        assert torch.equal(halves[name], floats[PORTABLE]), name


def test_a_gguf_weight_keeps_its_scales_in_half(dll):
    blocks = cpu_blocks.Blocks.quantize(torch.randn(8, 64), Format.Q4)
    assert cpu_backends.PackedLinear(dll, blocks, Format.Q4).d.dtype == torch.float32  # fp32 range / 15
    half = cpu_blocks.Blocks(Format.Q4, "Q4_1", blocks.qs, blocks.d.half().float(), blocks.m.half().float())
    packed = cpu_backends.PackedLinear(dll, half, Format.Q4)
    assert packed.d.dtype == packed.m.dtype == torch.float16
    assert torch.equal(packed.weight, half.dequantize())


def test_the_paths_compute_the_format(dll):
    """The common answer is the right one: Q4 weights as d q + m against fp32 math, within int16's error."""
    g = torch.Generator().manual_seed(1)
    w, d, m = weights(g, Format.Q4, 64, 32 * 19)
    blocks = cpu_blocks.Blocks(Format.Q4, "int4", w.view(torch.uint8), d, m, panels=True, n=64)
    x = torch.randn(5, 32 * 19, generator=g)
    want = x @ blocks.dequantize().T
    out = cpu_linear.linear(dll, Format.Q4, x, 64, w, d, m)
    assert (out - want).abs().max() <= 2e-4 * want.abs().max()
    cpu_linear.set_activation_bits(dll, 8)
    try:
        out = cpu_linear.linear(dll, Format.Q4, x, 64, w, d, m)
    finally:
        cpu_linear.set_activation_bits(dll, 16)
    assert (out - want).abs().max() <= 2e-2 * want.abs().max()  # int8's error: 1/254 of a block's max


@pytest.fixture
def bf16_activations(dll):
    """BF16 weights on bf16 activations during the test, then on fp32 ones and the paths in use before."""
    chosen = cpu_linear.paths_in_use(dll)
    cpu_linear.set_bf16_activations(dll, True)
    yield
    cpu_linear.set_bf16_activations(dll, False)
    cpu_linear.use_paths(dll, chosen)


def bf16_case(g: torch.Generator, rows: int, k: int, n: int):
    """BF16 weights, fp32 rows and a bias, with values small enough that products and sums fall below 2^-126
    (which vdpbf16ps flushes to zero; row 1 and column 1 are small throughout, and column 1 has no bias, so
    that what is flushed there is the answer), a subnormal weight (read as zero), a subnormal activation
    (rounded to zero) and a block of zeros."""
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    w[:, ::3] = (torch.randn(n, len(range(0, k, 3)), generator=g) * 1e-19).to(torch.bfloat16)
    x[:, ::3] = torch.randn(rows, len(range(0, k, 3)), generator=g) * 1e-19
    w[1] = (torch.randn(k, generator=g) * 2e-19).to(torch.bfloat16)
    x[1] = torch.randn(k, generator=g) * 2e-19
    w[0, 4] = torch.tensor(1e-39).to(torch.bfloat16)
    x[-1, 7] = 1e-39
    x[0, :32] = 0.0
    bias = torch.randn(n, generator=g)
    bias[1] = 0.0
    return w, x, bias


@pytest.mark.parametrize("blocks", [1, 7, 18, 48])
@pytest.mark.parametrize("threads", [1, 2])
def test_with_bf16_activations_every_path_computes_the_portable_bits(dll, bf16_activations, blocks, threads):
    """vdpbf16ps where the CPU has it (the AVX-512 BF16 path) and two fmas under DAZ and FTZ on the others:
    one answer, for every count of rows a verification sends and row by row, the rounding to bf16 and the
    flushes included; and the answer is what fp32 math gives on the bf16-rounded rows, within fp32's error."""
    g = torch.Generator().manual_seed(blocks + 100)
    k, n = 32 * blocks, 105 if blocks % 2 else 100
    w, x, bias = bf16_case(g, 11, k, n)
    names = running(dll)
    assert ("AVX-512 BF16" in names) == ("avx512_bf16" in cpu_linear._cpu_flags().split() and "AVX-512 VNNI" in names)
    cpu_linear.set_threads(dll, threads)
    try:
        alone = on_every_path(dll, lambda: torch.cat([cpu_linear.linear(dll, Format.BF16, x[i:i + 1], n, w, bias=bias)
                                                      for i in range(len(x))]))
        for rows in (2, 3, 4, 5, 8, 11):
            outs = on_every_path(dll, lambda rows=rows: cpu_linear.linear(dll, Format.BF16, x[:rows], n, w, bias=bias))
            for name in outs:
                assert torch.equal(outs[name], alone[PORTABLE][:rows]), (name, rows)
    finally:
        cpu_linear.set_threads(dll, 1)
    for name in alone:
        assert torch.equal(alone[name], alone[PORTABLE]), name
    want = x.to(torch.bfloat16).float() @ w.float().T + bias
    torch.testing.assert_close(alone[PORTABLE], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    cpu_linear.set_bf16_activations(dll, False)
    assert not torch.equal(cpu_linear.linear(dll, Format.BF16, x, n, w, bias=bias), alone[PORTABLE])  # fp32 rows differ


def test_bf16_activations_flush_what_is_tiny_after_rounding(dll, bf16_activations):
    """A sum just below 2^-126 that rounds up to it on fp32's subnormal grid is tiny to an x86, which rounds to
    24 bits with an unbounded exponent before it decides: vdpbf16ps flushes it, and so must every path. A
    column gets 2^-126 from its first product, then adds -1.5 * 2^-151 (in that band: 0) or -2^-151 (the
    tie, which rounds to 2^-126 and stays)."""
    w = torch.zeros(2, 32, dtype=torch.bfloat16)
    x = torch.zeros(1, 32)
    x[0, 1], x[0, 0] = 2.0 ** -63, -(2.0 ** -75)
    w[:, 1] = 2.0 ** -63
    w[0, 0], w[1, 0] = 1.5 * 2.0 ** -76, 2.0 ** -76
    outs = on_every_path(dll, lambda: cpu_linear.linear(dll, Format.BF16, x, 2, w))
    for name, out in outs.items():
        assert out.tolist() == [[0.0, 2.0 ** -126]], name


def test_the_bf16_path_runs_with_bf16_activations_alone(dll):
    """It is the AVX-512 VNNI path but for the BF16 linear on bf16 activations: with fp32 ones it never runs,
    and the library keeps a record of the fastest paths for each setting."""
    assert "AVX-512 BF16" not in running(dll) and cpu_linear.path_record(dll) == ".path.json"
    if cpu_linear.X86:
        assert "AVX-512 BF16" in {p.name for p in cpu_linear.paths(dll)}  # compiled
    chosen = cpu_linear.paths_in_use(dll)
    cpu_linear.set_bf16_activations(dll, True)
    try:
        assert cpu_linear.path_record(dll) == ".path-bf16.json"
        assert in_use(dll) == {running(dll)[0]}  # the widest that runs, until told otherwise
    finally:
        cpu_linear.set_bf16_activations(dll, False)
        cpu_linear.use_paths(dll, chosen)
    cpu_linear.set_activation_bits(dll, 8)
    try:
        assert cpu_linear.path_record(dll) == ".path-int8.json"
    finally:
        cpu_linear.set_activation_bits(dll, 16)


def test_the_fastest_paths_for_bf16_activations_are_measured_on_bf16_weights(dll, bf16_activations, tmp_path):
    record = tmp_path / "path-bf16.json"
    chosen = cpu_linear.fastest_paths(dll, record)
    seconds = json.loads(record.read_text())["seconds"]
    assert set(seconds) == set(running(dll)) and set(asdict(chosen).values()) <= set(running(dll))


def test_the_library_takes_the_activations_at_every_call_that_names_them(dll):
    """Built and loaded once, it is set to the activations each call asks for, with their own measured paths:
    int16 again after int8 and bf16, not whatever the last model loaded left."""
    for activations in (Activations.INT8, Activations.BF16, Activations.INT16):
        lib = cpu_backends.library(activations)
        assert lib.ss_activation_bits() == activations.bits
        assert lib.ss_bf16_activations() == (activations is Activations.BF16)
        assert in_use(lib) <= set(running(lib))
    assert cpu_backends.library() is lib and lib.ss_activation_bits() == 16  # no activations named: as it is


def test_the_activations_are_16_or_8_bits(dll):
    with pytest.raises(ValueError, match="16 or 8 bits"):
        cpu_linear.set_activation_bits(dll, 4)
    assert dll.ss_activation_bits() == 16


def emulated(tmp_path_factory, path: str, recipe: tuple[str, list[str]], name: str):
    """A library of the portable path and ``path`` built from ``recipe`` (an emulation), which runs as ``name``."""
    lib = tmp_path_factory.mktemp(path) / "cpu_linear.so"
    cpu_linear.build(lib, {"portable": cpu_linear.PATH_OBJECTS["portable"], path: recipe})
    dll = cpu_linear.bind(ctypes.CDLL(str(lib)))
    assert running(dll) == [name, PORTABLE]
    return dll


@pytest.fixture(scope="module")
def emulated_amx(tmp_path_factory):
    """The AMX path with its tile instructions in C: its layouts and arithmetic, checked on any machine."""
    return emulated(tmp_path_factory, "amx", cpu_linear.EMULATED_AMX, "AMX (emulated)")


def test_the_amx_path_is_chosen_for_many_rows_alone(emulated_amx, tmp_path):
    """Its fixed cost a block (two tile instructions and a round trip through memory, whatever the rows)
    outweighs what it saves on a verification's few rows: it is timed and chosen for prefills alone."""
    amx = next(p for p in cpu_linear.paths(emulated_amx) if p.name == "AMX (emulated)")
    assert amx.min_rows == emulated_amx.ss_many_rows() > cpu_linear.CLASS_ROWS["rows"]
    record = tmp_path / "path.json"
    chosen = cpu_linear.fastest_paths(emulated_amx, record)
    assert set(json.loads(record.read_text())["seconds"][amx.name]) == {"many_rows"}
    assert chosen.rows == chosen.one_row == PORTABLE


def matches_portable(dll, path: str, fmt: Format, blocks: int, n: int, half: bool, bits: int, counts) -> None:
    """Path ``path`` of ``dll`` computes the portable bits for each row count of ``counts``: a partial last
    panel, a bias, a block with one large activation and one of zeros, half or float scales, two threads,
    the activations quantised to ``bits``."""
    g = torch.Generator().manual_seed(blocks + 100 * half + bits)
    k = 32 * blocks
    w, d, m = weights(g, fmt, n, k)
    if half:
        d, m = d.half(), m.half()
    bias = torch.randn(n, generator=g)
    x = torch.randn(max(counts), k, generator=g)
    x[3, 5] = 60.0
    x[7, :32] = 0.0
    cpu_linear.set_threads(dll, 2)
    cpu_linear.set_activation_bits(dll, bits)
    cpu_linear.use_path(dll, PORTABLE)
    want = cpu_linear.linear(dll, fmt, x, n, w, d, m, bias)
    cpu_linear.use_path(dll, path)
    for rows in counts:
        assert torch.equal(cpu_linear.linear(dll, fmt, x[:rows], n, w, d, m, bias), want[:rows]), rows


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("blocks, n", [(1, 105), (7, 300), (18, 105)])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("bits", [16, 8])
def test_the_amx_path_computes_the_portable_bits(emulated_amx, fmt, blocks, n, half, bits):
    """Every size of tile of rows (1 to 16, and 17 split in two), an odd number of panels in a pass, several
    passes."""
    matches_portable(emulated_amx, "AMX (emulated)", fmt, blocks, n, half, bits, (1, 2, 3, 5, 8, 9, 16, 17))


@pytest.fixture(scope="module")
def emulated_avx_vnni(tmp_path_factory):
    """The AVX-VNNI path with its fused multiply-adds as AVX2's: the int8 tiles' vpdpbusd layout (a column's
    4 bytes a lane), checked on any AVX2 machine."""
    if not cpu_linear.X86 or "AVX2" not in running(cpu_backends.library()):
        pytest.skip("the emulation needs AVX2")
    return emulated(tmp_path_factory, "avx_vnni", cpu_linear.EMULATED_AVX_VNNI, "AVX-VNNI (emulated)")


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("blocks, n", [(1, 105), (7, 300), (18, 100)])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("bits", [16, 8])
def test_the_avx_vnni_path_computes_the_portable_bits(emulated_avx_vnni, fmt, blocks, n, half, bits):
    """Tiles of 2 rows and the last one alone."""
    matches_portable(emulated_avx_vnni, "AVX-VNNI (emulated)", fmt, blocks, n, half, bits, (1, 2, 3, 4, 5, 11))


@pytest.fixture(scope="module")
def emulated_avx512_vnni(tmp_path_factory):
    """The AVX-512 VNNI path's int8 tiles in plain C (vec512.h), the portable path for the rest."""
    return emulated(tmp_path_factory, "avx512_vnni", cpu_linear.EMULATED_AVX512_VNNI, "AVX-512 VNNI (emulated)")


@pytest.mark.parametrize("fmt", [Format.Q4, Format.Q8])
@pytest.mark.parametrize("blocks, n", [(1, 105), (7, 300), (18, 100)])
@pytest.mark.parametrize("half", [False, True])
def test_the_avx512_vnni_int8_tiles_compute_the_portable_bits(emulated_avx512_vnni, fmt, blocks, n, half):
    """With int8 activations: tiles of 1 to 8 rows, 11 split in 6 + 5, 17 in three."""
    matches_portable(emulated_avx512_vnni, "AVX-512 VNNI (emulated)", fmt, blocks, n, half, 8,
                     (1, 2, 3, 4, 5, 6, 7, 8, 11, 17))


@pytest.mark.parametrize("head_dim", [64, 128, 32, 40, 36, 256])  # constant-D copies, general, no 8, wide
@pytest.mark.parametrize("h, hkv", [(6, 2), (4, 1), (2, 2), (10, 2), (9, 1)])  # groups of 3, 4, 1, 5 and 9 heads
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_every_path_attends_as_the_portable_one(dll, head_dim, h, hkv, kv_dtype):
    """A cache of halves gives, on every path, what its values as floats give: they are read exactly."""
    g = torch.Generator().manual_seed(head_dim)
    t, s, s_max = 6, 77, 90
    q = torch.randn(t, h, head_dim, generator=g)
    k, v = torch.randn(hkv, s_max, head_dim, generator=g), torch.randn(hkv, s_max, head_dim, generator=g)
    k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
    mask = torch.rand(t, s, generator=g) < 0.5
    mask[:, 0] = True
    mask[1, 1:] = False  # one key alone
    outs = on_every_path(dll, lambda: cpu_linear.attention(dll, q, k.to(kv_dtype), v.to(kv_dtype), mask,
                                                           head_dim ** -0.5))
    as_floats = cpu_linear.attention(dll, q, k, v, mask, head_dim ** -0.5)
    for name, out in outs.items():
        assert torch.equal(out, outs[PORTABLE]), name
    assert torch.equal(outs[PORTABLE], as_floats)
    scores = torch.einsum("thd,hsd->ths", q, k.repeat_interleave(h // hkv, 0)[:, :s]) * head_dim ** -0.5
    p = torch.softmax(scores.masked_fill(~mask[:, None, :], -torch.inf), -1)
    want = torch.einsum("ths,hsd->thd", p, v.repeat_interleave(h // hkv, 0)[:, :s])
    torch.testing.assert_close(outs[PORTABLE], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(cpu_linear.PATH_OBJECTS))
def test_every_path_compiles(name, tmp_path):
    """Compile only: a path this CPU cannot run is still built, so it never rots; with every warning, which
    finds a tile indexing past its accumulators in a path no test here can run."""
    source, flags = cpu_linear.PATH_OBJECTS[name]
    job = cpu_linear.compile_object(cpu_linear._compiler(), source, [*flags, "-Wall", "-Wextra", "-Werror"],
                                     tmp_path / "path.o")
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err


def test_the_fastest_paths_are_measured_once_and_kept(dll, tmp_path):
    record = tmp_path / "path.json"
    chosen = cpu_linear.fastest_paths(dll, record)
    kept = json.loads(record.read_text())
    seconds = kept["seconds"]
    assert set(seconds) == set(running(dll))
    for cls in cpu_linear.CLASS_ROWS:
        assert kept[cls] == getattr(chosen, cls) == min((name for name in seconds if cls in seconds[name]),
                                                        key=lambda name, cls=cls: seconds[name][cls])
    vector = running(dll)[0]
    record.write_text(json.dumps({"rows": PORTABLE, "one_row": vector, "many_rows": PORTABLE, "seconds": {}}))
    assert cpu_linear.fastest_paths(dll, record) == cpu_linear.PathChoice(PORTABLE, vector, PORTABLE)  # read
    record.write_text(json.dumps({"rows": "a path of another machine", "one_row": PORTABLE, "many_rows": PORTABLE}))
    assert cpu_linear.fastest_paths(dll, record).rows in running(dll)
    record.write_text(json.dumps({"rows": PORTABLE, "one_row": PORTABLE}))  # a record of fewer classes
    cpu_linear.fastest_paths(dll, record)
    assert set(cpu_linear.CLASS_ROWS) <= set(json.loads(record.read_text()))  # measured again


def test_each_class_of_rows_takes_its_own_path(dll):
    """A decode step's one-row calls run the one-row path, a prefill's many rows the many-rows path and every
    other call the rows path, each with its own activations: mixed every way, linears and attention give
    the portable bits."""
    g = torch.Generator().manual_seed(5)
    vector = running(dll)[0]
    many = dll.ss_many_rows()
    w, d, m = weights(g, Format.Q4, 40, 96)
    x = torch.randn(many + 3, 96, generator=g)
    q = torch.randn(many + 1, 4, 32, generator=g)
    k, v = torch.randn(2, 20, 32, generator=g), torch.randn(2, 20, 32, generator=g)
    mask = torch.rand(many + 1, 20, generator=g) > 0.3
    mask[:, 0] = True
    counts = (1, 5, many, many + 3)

    def outputs():
        return ([cpu_linear.linear(dll, Format.Q4, x[:rows], 40, w, d, m) for rows in counts]
                + [cpu_linear.attention(dll, q[:rows], k, v, mask[:rows], 0.2) for rows in (1, 3, many + 1)])

    cpu_linear.use_path(dll, PORTABLE)
    want = outputs()
    for choice in (cpu_linear.PathChoice(vector, PORTABLE, PORTABLE), cpu_linear.PathChoice(PORTABLE, vector, PORTABLE),
                   cpu_linear.PathChoice(PORTABLE, PORTABLE, vector), cpu_linear.PathChoice(vector, PORTABLE, vector)):
        cpu_linear.use_paths(dll, choice)
        assert cpu_linear.paths_in_use(dll) == choice
        assert [dll.ss_path_name(dll.ss_path_for(n)).decode() for n in (1, 2, many - 1, many, 256)] \
            == [choice.one_row, choice.rows, choice.rows, choice.many_rows, choice.many_rows]
        for got, expected in zip(outputs(), want, strict=True):
            assert torch.equal(got, expected)
    if vector != PORTABLE:
        cpu_linear.use_paths(dll, cpu_linear.PathChoice(PORTABLE, vector, vector))
        assert cpu_linear.isa(dll) == f"{PORTABLE}, one row {vector}, {many}+ rows {vector}"
        cpu_linear.use_paths(dll, cpu_linear.PathChoice(PORTABLE, PORTABLE, vector))
        assert cpu_linear.isa(dll) == f"{PORTABLE}, {many}+ rows {vector}"
    cpu_linear.use_path(dll, vector)
    assert cpu_linear.isa(dll) == vector


def test_a_path_that_cannot_run_is_refused(dll):
    with pytest.raises(ValueError, match="no path"):
        cpu_linear.use_path(dll, "AVX-1024")
    assert in_use(dll) <= set(running(dll))


def test_the_kernel_benchmark_checks_the_bits_and_times_every_row_count(dll, tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_kernels.py"
    out = tmp_path / "kernels.json"
    vector = running(dll)[0]
    proc = subprocess.run([sys.executable, str(script), "--check", "--paths", vector, "--reps", "2", "--json",
                           str(out), "--activations", "int16,int8,bf16", "--attention", "--contexts", "40"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(running(dll)) <= set(result["paths"]) and set(result["activations"]) == {"int16", "int8", "bf16"}
    for name, width in result["activations"].items():
        assert width["differ"] == [] and set(width["chosen"].values()) <= set(result["paths"])
        formats = {"Q4", "Q8"} if name != "bf16" else {"BF16"}
        assert {(r["format"], r["path"]) for r in width["linears"]} == {(f, vector) for f in formats}
        if name == "bf16":
            assert {(r["format"], r["path"]) for r in width["fp32_linears"]} == {("BF16 fp32", vector)}
        assert all(set(r["us"]) == {"1", "2", "4", "8", "32"} and min(r["us"].values()) > 0 for r in width["linears"])
    [attention] = result["attention"]
    assert attention["context"] == 40 and len(attention["ms"]) == 6 and min(attention["ms"].values()) > 0
    for wrong, says in ((["--paths", "AVX-1024"], "no path AVX-1024 runs here"), (["--activations", "int4"], "int16 or int8")):
        refused = subprocess.run([sys.executable, str(script), *wrong], capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and says in refused.stderr


WIDTH_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "activation_width.py"


@pytest.fixture(scope="module")
def width_bench():
    """benchmarks/activation_width.py as a module."""
    spec = importlib.util.spec_from_file_location("activation_width", WIDTH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [16, 8])
def test_the_width_benchmark_quantises_as_the_kernels_do(dll, width_bench, bits):
    """A Q8 identity weight (d = 1) returns, exactly, the values the kernels' integer activations stand for:
    what benchmarks/activation_width.py gives the reference model at the same width."""
    k = 96
    ident = torch.eye(k, dtype=torch.int8).reshape(k, k // 32, 32)
    w = cpu_blocks.Blocks(Format.Q8, "int8", ident, torch.ones(k, k // 32)).in_panels()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(bits)) * 3
    x[1, 40] = 90.0  # a block with one large activation
    x[2, 64:] = 0.0  # a block of zeros
    cpu_linear.set_activation_bits(dll, bits)
    try:
        seen = cpu_linear.linear(dll, Format.Q8, x, k, w.qs, w.d, None)
    finally:
        cpu_linear.set_activation_bits(dll, 16)
    assert torch.equal(seen, width_bench.quantise(x, width_bench.Width(32767 if bits == 16 else 127)))
    assert not torch.equal(seen, x)  # quantised: the test can tell the widths from fp32


def test_the_width_benchmark_counts_the_answers_each_width_keeps(width_bench, target_dir, tmp_path):
    split = width_bench.quantise(torch.tensor([[50.0] + [0.3] * 31]), width_bench.Width(3, exact=1))
    assert split[0, 0] == 50.0 and torch.allclose(split[0, 1:], torch.full((31,), 0.3))  # 0.3 is 3 levels
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "count to five"}\n')
    out = tmp_path / "widths.json"
    proc = subprocess.run([sys.executable, str(WIDTH_SCRIPT), "--target", str(target_dir), "--prompts", str(prompts),
                           "--tokens", "6", "--widths", "32767,1,1+4", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["prompts"] == 2 and [(w["levels"], w["exact"]) for w in result["widths"]] == [(32767, 0), (1, 0), (1, 4)]
    assert all(w["same"] + len(w["first_differences"]) == 2 for w in result["widths"])
    assert result["widths"][1]["same"] < 2  # one level a side moves the random model's answers
    refused = subprocess.run([sys.executable, str(WIDTH_SCRIPT), "--widths", "127+40"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "0 <= K < 32" in refused.stderr
