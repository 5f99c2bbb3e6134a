"""Whether this machine's NVIDIA compiler computes kernels with deeply nested conditions right:
a chain of ``depth`` selections, each of a value read only on one side (a residual stream's
gradient under every block's ReLU mask), summed by a warp shuffle or through shared memory, run
on cuda against NumPy at each depth given, as compiled by default and with ``-Xptxas=-O0``.
``schedule._NESTED_CONDITIONS`` keeps anygpu's own kernels to 8: on an H200 (CUDA 13.0's
compiler, driver 580) such chains came out wrong at depths 16, 24 and 40 and right at 2 to 15,
and the ResNet-101 kernel that showed it first was right with ``-Xptxas=-O0``.

    python scripts/nested_conditions.py --depths 8 15 16 24
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GROUPS = 1024  # work-groups of 32 threads, one sum each


def source(depth: int, reduce: str) -> str:
    """A CUDA kernel: out[group] = the sum over its 32 threads of the chain at their element."""
    params = ["float* __restrict__ out"]
    params += [f"const float* __restrict__ m{k}" for k in range(depth)]
    params += [f"const float* __restrict__ a{k}" for k in range(depth + 1)]
    lines = ["  const int i = blockIdx.x * 32 + threadIdx.x;"]
    lines += [f"  const float q{k} = m{k}[i];" for k in range(depth)]
    chain = "a0[i]"
    for k in range(depth):  # the innermost mask first; each level adds the next value
        test = f"((q{k} < 0.0f) || (q{k} == 0.0f))"
        inner = f"({chain} + a{k + 1}[i])" if k < depth - 1 else chain
        chain = f"({test} ? 0.0f : {inner})"
    lines.append(f"  float v = {chain};")
    if reduce == "shuffle":
        lines.append("  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);")
        lines.append("  if (threadIdx.x == 0) out[blockIdx.x] = v;")
    else:
        lines.append("  __shared__ float part[32];")
        lines.append("  part[threadIdx.x] = v;")
        lines.append("  __syncthreads();")
        lines.append("  for (int o = 16; o > 0; o >>= 1) {")
        lines.append("    if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];")
        lines.append("    __syncthreads();")
        lines.append("  }")
        lines.append("  if (threadIdx.x == 0) out[blockIdx.x] = part[0];")
    return ('extern "C" __global__ void __launch_bounds__(32) chain(' + ", ".join(params) +
            ") {\n" + "\n".join(lines) + "\n}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 12, 15, 16, 20, 24])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    from anygpu.runtime.registry import get_device

    device = get_device(args.device)
    rng = np.random.default_rng(0)
    n = GROUPS * 32
    for depth in args.depths:
        masks = [np.where(rng.random(n) < 0.1, 0.0, rng.random(n) + 0.01).astype(np.float32)
                 for _ in range(depth)]
        values = [rng.standard_normal(n).astype(np.float32) for _ in range(depth + 1)]
        chain = values[0].astype(np.float64)
        for k in range(depth):
            chain = np.where(masks[k] <= 0, 0.0, chain + values[k + 1] if k < depth - 1 else chain)
        want = chain.reshape(GROUPS, 32).sum(1)
        buffers = []
        for host in masks + values:
            buffer = device.alloc(host.nbytes)
            buffer.copy_in(host)
            buffers.append(buffer)
        row = []
        for reduce in ("shuffle", "shared"):
            for label, extra in (("default", []), ("-O0", [b"-Xptxas=-O0"])):
                text = source(depth, reduce)
                ok, log, binary = device._run_compiler(
                    text, "chain", device._compile_options(text) + extra)
                if not ok:
                    row.append(f"{reduce}/{label}: compile failed ({log.strip()[:80]})")
                    continue
                program = device.load(binary, "chain", text)
                out = device.alloc(GROUPS * 4)
                program([out, *buffers], (GROUPS,), (32,), wait=True)
                got = np.empty(GROUPS, np.float32)
                out.copy_out(got)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                row.append(f"{reduce}/{label}: {'right' if err < 1e-5 else f'WRONG ({err:.1e})'}")
        print(f"depth {depth:3d}: " + ", ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
