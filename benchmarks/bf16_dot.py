"""Whether this CPU's `vdpbf16ps` (AVX512-BF16) computes what Intel's SDM defines, bit for bit: in each fp32
lane, the odd bfloat16 pair's product added to the accumulator first and then the even pair's, each add
rounded to nearest even, with denormal inputs read as zero and denormal results flushed to zero after each
add. A kernel path on bf16 activations could give the same bits on every x86 machine (and a portable
path could emulate it) only if every CPU with the instruction computes exactly this.

It compiles a small C program with the kernels' compiler and runs it: random lanes with normal values and
with values near the bottom of the exponent range, against that definition and against orders it is not
(even pair first; the two products summed first; one rounding of the whole sum), so that the check can tell
them apart. Exits 1 when the definition does not hold, 2 when the CPU or the compiler has no AVX512-BF16.

    .venv/bin/python benchmarks/bf16_dot.py [--lanes 3200000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from swiftspec.kernels.cpu_linear import _compiler, _cpu_flags

PROGRAM = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static float ftz(float f) { return fabsf(f) < 1.17549435e-38f ? copysignf(0.0f, f) : f; }
static uint64_t state = 1;
static uint32_t next(void) { state = state * 6364136223846793005ULL + 1442695040888963407ULL; return (uint32_t)(state >> 33); }
/* a bfloat16 of random sign and mantissa with its biased exponent in [lo, lo + span) */
static uint16_t bf16(int lo, int span) { return (uint16_t)((next() & 0x8000) | ((lo + next() % span) << 7) | (next() & 0x7F)); }

int main(int argc, char **argv) {
    const long rounds = atol(argv[1]) / 16;
    const char *names[4] = {"SDM: odd pair first, DAZ, FTZ after each add", "even pair first",
                            "the two products summed first", "one rounding of the whole sum"};
    long wrong[2][4] = {{0}}; /* [normal values, values near the bottom][order] */
    for (int low = 0; low < 2; low++)
        for (long it = 0; it < rounds; it++) {
            uint16_t a[32], b[32];
            float acc[16], out[16];
            for (int i = 0; i < 32; i++) {
                a[i] = low ? bf16(0, 70) : bf16(100, 56);
                b[i] = low ? bf16(30, 40) : bf16(120, 14);
            }
            for (int i = 0; i < 16; i++) {
                uint32_t r = (next() << 16 ^ next()) & 0x807FFFFF;
                r |= (uint32_t)(low ? next() % 6 : 110 + next() % 40) << 23;
                memcpy(&acc[i], &r, 4);
            }
            __m512bh va, vb;
            memcpy(&va, a, 64), memcpy(&vb, b, 64);
            _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), va, vb));
            for (int i = 0; i < 16; i++) {
                const float a0 = ftz(f32(a[2 * i])), b0 = ftz(f32(b[2 * i]));
                const float a1 = ftz(f32(a[2 * i + 1])), b1 = ftz(f32(b[2 * i + 1])), c = ftz(acc[i]);
                const float want[4] = {
                    ftz(fmaf(a0, b0, ftz(fmaf(a1, b1, c)))),
                    ftz(fmaf(a1, b1, ftz(fmaf(a0, b0, c)))),
                    ftz(c + (a0 * b0 + a1 * b1)),
                    ftz((float)((double)c + ((double)a0 * b0 + (double)a1 * b1))),
                };
                for (int k = 0; k < 4; k++) wrong[low][k] += bits(want[k]) != bits(out[i]);
            }
        }
    for (int k = 0; k < 4; k++)
        printf("%-46s %9ld %9ld\n", names[k], wrong[0][k], wrong[1][k]);
    return wrong[0][0] || wrong[1][0];
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lanes", type=int, default=3_200_000, help="fp32 lanes checked in each range of values")
    a = p.parse_args()
    if "avx512_bf16" not in _cpu_flags().split():
        print("this CPU has no AVX512-BF16")
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "bf16_dot.c", Path(tmp) / "bf16_dot"
        src.write_text(PROGRAM)
        built = subprocess.run([_compiler(), "-O2", "-mavx512f", "-mavx512bf16", "-ffp-contract=off", "-o", str(exe),
                                str(src), "-lm"], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"the compiler has no AVX512-BF16: {built.stderr.strip()[-500:]}")
            sys.exit(2)
        print(f"{'lanes that differ from':<46} {'normal':>9} {'low':>9}  ({a.lanes} lanes each)")
        ran = subprocess.run([str(exe), str(a.lanes)])
    print("vdpbf16ps computes the SDM's definition here" if ran.returncode == 0
          else "vdpbf16ps does NOT compute the SDM's definition here")
    sys.exit(ran.returncode)


if __name__ == "__main__":
    main()
