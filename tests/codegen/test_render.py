"""Rendered kernel source for every dialect, against golden files in ``snapshots/``.

Run with ``ANYGPU_UPDATE_SNAPSHOTS=1`` to rewrite the golden files after an intended change to
the generated code, and review the diff. No device runs anything here: the graphs' inputs live
on the cpu device, and lowering and rendering need no compiler.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import anygpu as ag
from anygpu.codegen import ir, lower
from anygpu.codegen.render.cstyle import render
from anygpu.codegen.render.wgsl import MAX_GROUPS_X, launch_groups

SNAPSHOTS = Path(__file__).parent / "snapshots"
DIALECTS = ["c", "opencl", "cuda", "wgsl"]
MAX_LOCAL = {"c": 1, "opencl": 256, "cuda": 1024, "wgsl": 256}


def t(shape: tuple[int, ...], dtype: ag.DType = ag.float32, start: int = 0) -> ag.Tensor:
    data = (np.arange(int(np.prod(shape))) % 7 + start).reshape(shape)
    return ag.tensor(data, dtype=dtype)


def _elementwise() -> ag.Tensor:
    return (t((3, 4)) * t((3, 4), start=1) + 1).relu()


def _broadcast_where() -> ag.Tensor:
    x, y = t((2, 3, 5)), t((3, 1), start=2)
    return ag.where(x > y, x - y, (x * 0.5).exp())


def _row_sum() -> ag.Tensor:
    return t((4, 33)).sum(1)


def _softmax() -> ag.Tensor:
    return t((3, 5)).softmax(-1)


def _column_sum() -> ag.Tensor:
    return t((8, 4096)).sum(0)  # many outputs, reduce axis outer: one thread per output


def _int8_pad_argmax() -> ag.Tensor:
    x = t((3, 6), ag.int8)
    return (x * 100).pad((1, 2), value=-1).argmax(1)


def _half() -> ag.Tensor:
    return (t((16,), ag.float16) * 1.5).sqrt().half()


def _bfloat16() -> ag.Tensor:
    return (t((16,), ag.bfloat16) + t((16,), ag.float32)).bfloat16()


def _gather() -> ag.Tensor:
    x = t((5, 4)).contiguous().realize()
    return x.gather(0, ag.tensor([[4, 0, 1, 3], [2, 2, 2, 2]], dtype=ag.int32))


def _negative_constants() -> ag.Tensor:
    # x - (-4) negates a negative literal: it must not render as "--4"
    return (t((6,), ag.int32) - (-4)) * 3 + (t((6,)) - (-0.5)).clamp(max=-0.5).cast(ag.int32)


def _int_division() -> ag.Tensor:
    # by a tensor (zero and MIN / -1 guarded), by a constant (plain) and a float remainder
    x, y = t((6,), ag.int32), t((6,), ag.int32, start=-3)
    return x // y + x % 3 + (x.float().fmod(y.float())).cast(ag.int32)


GRAPHS: dict[str, Callable[[], ag.Tensor]] = {
    "elementwise": _elementwise, "broadcast_where": _broadcast_where, "row_sum": _row_sum,
    "softmax": _softmax, "column_sum": _column_sum, "int8_pad_argmax": _int8_pad_argmax,
    "half": _half, "bfloat16": _bfloat16, "gather": _gather,
    "negative_constants": _negative_constants, "int_division": _int_division,
}


def kernel_for(graph: str, dialect: str, features: dict | None = None) -> ir.Kernel:
    """The last kernel of the graph (the one producing the output), lowered for ``dialect``."""
    out = GRAPHS[graph]()
    from anygpu.graph.schedule import KernelItem, schedule

    items = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
    ast = lower.build_kernel(lower.choose_spec(items[-1].output))
    return lower.to_ir(ast, dialect, MAX_LOCAL.get(dialect, 1024), features)


def source(graph: str, dialect: str, features: dict | None = None) -> str:
    return render(kernel_for(graph, dialect, features), dialect)


def assert_snapshot(name: str, text: str) -> None:
    """``text`` equals the golden file ``snapshots/<name>.txt`` (rewritten when
    ANYGPU_UPDATE_SNAPSHOTS=1)."""
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("ANYGPU_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no snapshot {path}; run with ANYGPU_UPDATE_SNAPSHOTS=1 to write it")
    want = path.read_text()
    assert text == want, f"{name} differs from {path} (ANYGPU_UPDATE_SNAPSHOTS=1 rewrites it)"


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_snapshot(graph: str, dialect: str) -> None:
    if graph == "bfloat16" and dialect == "wgsl":
        with pytest.raises(TypeError, match="bfloat16"):
            source(graph, dialect)
        return
    assert_snapshot(f"{graph}_{dialect}", source(graph, dialect))


# the "subgroup" feature each dialect's devices report: a warp's lanes, or a size the device picks
SUBGROUPS: dict[str, int | str] = {"cuda": 32, "hip": 64, "opencl": "varying", "wgsl": "varying"}


@pytest.mark.parametrize("dialect", list(SUBGROUPS))
@pytest.mark.parametrize("graph", ["row_sum", "softmax"])
def test_subgroup_snapshot(graph: str, dialect: str) -> None:
    # row_sum: 64 threads (two warps of 32, one wavefront of 64); softmax: 8 threads, a max then
    # a sum
    text = source(graph, dialect, {"subgroup": SUBGROUPS[dialect]})
    assert_snapshot(f"{graph}_{dialect}_subgroups", text)


def test_subgroup_facts() -> None:
    cuda = source("row_sum", "cuda", {"subgroup": 32})
    assert "__shfl_xor_sync(0xffffffffu, " in cuda and cuda.count("__syncthreads();") == 1
    assert "lmem0[2]" in cuda  # one value per warp
    small = source("softmax", "cuda", {"subgroup": 32})  # 8 threads: one partly filled warp
    assert "__shfl_xor_sync(0xffu, " in small and "__syncthreads" not in small
    assert "((w3 > w5 || w3 != w3) ? w3 : w5)" in small  # max keeps NaN, as the other paths
    hip = source("row_sum", "hip", {"subgroup": 64})
    assert "__shfl_xor(" in hip and "__syncthreads" not in hip
    opencl = source("softmax", "opencl", {"subgroup": "varying"})
    assert opencl.startswith("#pragma OPENCL EXTENSION cl_khr_subgroups : enable")
    assert "sub_group_any(isnan(" in opencl and "sub_group_reduce_add(" in opencl
    wgsl = source("softmax", "wgsl", {"subgroup": "varying"})
    assert "@builtin(subgroup_invocation_id)" in wgsl and "subgroupAdd(" in wgsl
    assert "subgroupAny((bitcast<u32>(" in wgsl
    # without the feature, today's local-memory combine (the snapshots above)
    assert source("row_sum", "cuda", {}) == source("row_sum", "cuda")
    assert "__shfl" not in source("row_sum", "hip") and "subgroup" not in source("row_sum", "wgsl")


def _kernel_of(out: ag.Tensor, dialect: str, features: dict) -> str:
    from anygpu.graph.schedule import KernelItem, schedule

    items = [i for i in schedule([out.lazy]) if isinstance(i, KernelItem)]
    ast = lower.build_kernel(lower.choose_spec(items[-1].output))
    return render(lower.to_ir(ast, dialect, 256, features), dialect)


def test_subgroup_fallbacks() -> None:
    """Reductions a dialect's subgroup operations lack combine through local memory."""
    x = t((4, 300), ag.int32)
    # WGSL's subgroupAdd takes no i64 (integer sums are int64)
    wgsl = _kernel_of(x.sum(1), "wgsl", {"subgroup": "varying"})
    assert "subgroupAdd" not in wgsl and "lmem0[(i32(lidv.x) + 128i)]" in wgsl
    assert "subgroupAdd(" in _kernel_of(x.sum(1, dtype=ag.int32), "wgsl", {"subgroup": "varying"})
    # OpenCL has no subgroup product; shuffles combine anything
    assert "sub_group" not in _kernel_of(t((4, 300)).prod(1), "opencl", {"subgroup": "varying"})
    assert "__shfl_xor_sync" in _kernel_of(t((4, 300)).prod(1), "cuda", {"subgroup": 32})
    assert "subgroupMul(" in _kernel_of(t((4, 300)).prod(1), "wgsl", {"subgroup": "varying"})
    # 8-bit values go through int, and sums of them wrap
    i8 = _kernel_of(t((4, 300), ag.int8).sum(1, dtype=ag.int8), "opencl", {"subgroup": "varying"})
    assert "((char)sub_group_reduce_add((int)(" in i8
    assert "(int)w" in _kernel_of(t((4, 300), ag.uint8).amax(1), "cuda", {"subgroup": 32})


def test_subgroup_reduce_substitutes() -> None:
    x = ir.var("x", ag.float32)
    e = ir.subgroup_reduce("max", ir.alu("add", x, ir.var("y", ag.float32)), 32)
    out = ir.substitute(e, {"y": ir.const(1.0, ag.float32)})
    assert out.op == "subgroup_reduce" and out.arg == ("max", 32)
    assert out.srcs[0] is ir.alu("add", x, ir.const(1.0, ag.float32))


def test_rendering_is_deterministic() -> None:
    for dialect in DIALECTS:
        assert source("softmax", dialect) == source("softmax", dialect)


def test_c_facts() -> None:
    text = source("elementwise", "c")
    assert text.startswith("#include <math.h>")
    assert "void e_12(float* restrict b0, const float* restrict b1" in text
    assert "#pragma omp parallel" not in text  # too small to be worth threads
    big = source("column_sum", "c")
    assert "#pragma omp parallel for schedule(static)" in big
    assert "bf16_to_f32" in source("bfloat16", "c")
    assert "_Float16" in source("half", "c")


def test_opencl_facts() -> None:
    text = source("row_sum", "opencl")
    assert "__kernel __attribute__((reqd_work_group_size(" in text
    assert "__global float* restrict b0, __global const float* restrict b1" in text
    assert "__local float lmem0[" in text and "barrier(CLK_LOCAL_MEM_FENCE);" in text
    assert "get_group_id(0)" in text and "get_local_id(0)" in text
    half = source("half", "opencl")
    assert "vload_half(" in half and "vstore_half_rte(" in half
    assert "bf16_to_f32" in source("bfloat16", "opencl")


def test_cuda_facts() -> None:
    text = source("row_sum", "cuda")
    assert 'extern "C" __global__ void __launch_bounds__(' in text
    assert "__shared__ __align__(16) float lmem0[" in text and "__syncthreads();" in text
    assert "blockIdx.x" in text and "threadIdx.x" in text
    assert "float* __restrict__ b0" in text
    half = source("half", "cuda")
    assert half.startswith("#include <cuda_fp16.h>") and "__half2float(" in half
    assert "#include <cuda_bf16.h>" in source("bfloat16", "cuda")
    assert "#include" not in text
    hip = render(kernel_for("half", "cuda"), "hip")
    assert hip.startswith("#include <hip/hip_fp16.h>")


def test_wgsl_facts() -> None:
    text = source("row_sum", "wgsl")
    assert "@compute @workgroup_size(" in text
    assert "@group(0) @binding(0) var<storage, read_write> b0: array<f32>;" in text
    assert "@group(0) @binding(1) var<storage, read> b1: array<f32>;" in text
    assert "var<workgroup> lmem0: array<f32, " in text and "workgroupBarrier();" in text
    assert text.count("fn ") == 1
    half = source("half", "wgsl")
    assert half.startswith("enable f16;") and "array<f16>" in half
    i8 = source("int8_pad_argmax", "wgsl")
    assert "array<i32>" in i8  # 8-bit values live in 32-bit words
    assert "<< 24u) >> 24u)" in i8  # and wrap explicitly


def test_wgsl_folds_large_launches() -> None:
    assert launch_groups(10) == (10, 1)
    assert launch_groups(MAX_GROUPS_X) == (MAX_GROUPS_X, 1)
    assert launch_groups(MAX_GROUPS_X + 1) == (MAX_GROUPS_X, 2)
    store = ir.Store("b0", ir.special("gid"), ir.const(1.0, ag.float32))
    big = ir.Kernel("k", [ir.Param("b0", ag.float32, True)], [store], MAX_GROUPS_X + 7, 1)
    assert f"if (gidx >= {MAX_GROUPS_X + 7}i) {{ return; }}" in render(big, "wgsl")
    assert "if (gidx" not in render(kernel_for("elementwise", "wgsl"), "wgsl")


def test_int64_indices_widen_the_thread_ids() -> None:
    """A kernel indexed in int64 (past 2**31 elements) computes its flat index from the
    int32 work-group and thread ids widened first: WGSL has no implicit conversion, and C's
    int would truncate the index."""
    flat = ir.alu("add", ir.alu("mul", ir.special("gid"), ir.const(256, ag.int64)),
                  ir.special("lid"))
    assert flat.dtype == ag.int64
    store = ir.Store("b0", flat, ir.const(1.0, ag.float32))
    kernel = ir.Kernel("k", [ir.Param("b0", ag.float32, True)],
                       [ir.Decl("t", ag.int64, flat), store], 4, 256)
    wgsl = render(kernel, "wgsl")
    assert "i64(gidx)" in wgsl and ": i32 = ((gidx * 256li)" not in wgsl
    assert "((long long)(((int)blockIdx.x))) * 256LL)" in render(kernel, "cuda")
    assert "((long)(((int)get_group_id(0)))) * 256L)" in render(kernel, "opencl")


def test_unknown_dialect() -> None:
    kernel = kernel_for("elementwise", "c")
    with pytest.raises(ValueError, match="no renderer for dialect 'metal'"):
        render(kernel, "metal")


def test_c_logic_evaluates_both_sides_unless_the_right_reads_memory() -> None:
    """Boolean and/or render as ``&``/``|`` (no branch, so loops vectorize) where the right
    side reads nothing new; a right side that loads keeps ``&&``, so a left side that guards
    its index (``i < n && b[i] > 0``) still does."""
    from anygpu.codegen import ir
    from anygpu.codegen.render.cstyle import render
    from anygpu.dtype import bool_, float32, int32

    i, n = ir.var("o0", int32), ir.var("n", int32)
    guarded = ir.alu("and", ir.alu("lt", i, n),
                     ir.alu("lt", ir.const(0.0, float32), ir.load("b1", float32, i)))
    plain = ir.alu("or", ir.alu("lt", i, n), ir.alu("lt", n, i))
    params = [ir.Param("b0", bool_, True), ir.Param("b1", float32, False)]
    loop = ir.For("o0", ir.const(0, int32), ir.const(64, int32), ir.const(1, int32),
                  [ir.Store("b0", i, ir.alu("and", guarded, plain))])
    text = render(ir.Kernel("logic", params, [loop]), "c")
    assert "const unsigned char t1 = (o0 < n);" in text
    assert "(t1 && (0.0f < b1[o0]))" in text and "(t1 | (n < o0))" in text
