"""Single ONNX operators on every device, against ONNX Runtime: the convolution, pooling,
resampling, indexing and attention cases where backends differ most, and a few cases ONNX's
node tests leave out (Unique along an inner axis, integer Resize)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import anygpu.onnx as agx  # noqa: E402

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(0)


def _value(name: str, array: np.ndarray) -> Any:
    elem = int(helper.np_dtype_to_tensor_dtype(array.dtype))
    return helper.make_tensor_value_info(name, elem, array.shape)


def single(op: str, inputs: dict[str, np.ndarray | None], outputs: list[str], opset: int = 21,
           **attrs: Any) -> onnx.ModelProto:
    """A model of one node whose inputs are graph inputs (None: an optional input left out);
    output types from shape inference."""
    node = helper.make_node(op, [n if a is not None else "" for n, a in inputs.items()],
                            outputs, **attrs)
    graph = helper.make_graph([node], op, [_value(n, a) for n, a in inputs.items()
                                           if a is not None],
                              [onnx.ValueInfoProto(name=o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=10)
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in inferred.graph.value_info}
    first = next(a for a in inputs.values() if a is not None)
    for out in model.graph.output:
        if out.name in known:
            out.CopyFrom(known[out.name])
        else:  # sizes computed from data: the first input's type and rank
            out.CopyFrom(helper.make_tensor_value_info(
                out.name, int(helper.np_dtype_to_tensor_dtype(first.dtype)),
                [f"d{k}" for k in range(first.ndim)]))
    return model


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


CASES: dict[str, tuple[Any, ...]] = {
    "conv_asymmetric_pads_groups_dilation": (
        "Conv", {"x": f32(1, 4, 9, 8), "w": f32(6, 2, 3, 2), "b": f32(6)}, ["y"],
        {"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [1, 2], "group": 2}),
    "conv_1d_same_upper": (
        "Conv", {"x": f32(2, 3, 10), "w": f32(4, 3, 4)}, ["y"],
        {"auto_pad": "SAME_UPPER", "strides": [3]}),
    "conv_3d": ("Conv", {"x": f32(1, 2, 5, 4, 6), "w": f32(3, 2, 2, 3, 2)}, ["y"],
                {"pads": [0, 1, 1, 1, 0, 0]}),
    "conv_transpose_output_shape": (
        "ConvTranspose", {"x": f32(1, 4, 5, 5), "w": f32(4, 3, 3, 3)}, ["y"],
        {"strides": [2, 2], "output_shape": [11, 12], "group": 1}),
    "average_pool_ceil_no_pads_counted": (
        "AveragePool", {"x": f32(1, 2, 7, 6)}, ["y"],
        {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}),
    "max_pool_indices": (
        "MaxPool", {"x": f32(2, 2, 6, 5)}, ["y", "i"],
        {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [0, 1, 1, 1]}),
    "resize_cubic_sizes": (
        "Resize", {"x": f32(1, 2, 4, 5), "roi": None, "scales": None,
                   "sizes": np.array([1, 2, 7, 3])}, ["y"],
        {"mode": "cubic", "coordinate_transformation_mode": "half_pixel"}),
    "resize_nearest_uint8": (
        "Resize", {"x": RNG.integers(0, 255, (1, 1, 3, 4)).astype(np.uint8),
                   "roi": np.zeros(0, np.float32),
                   "scales": np.array([1, 1, 2.0, 1.5], np.float32)}, ["y"],
        {"mode": "nearest", "nearest_mode": "round_prefer_ceil"}),
    "einsum_batch_contraction": (
        "Einsum", {"a": f32(2, 3, 4), "b": f32(2, 4, 5)}, ["y"], {"equation": "bij,bjk->bik"}),
    "topk_smallest": (
        "TopK", {"x": f32(3, 7), "k": np.array([3])}, ["v", "i"], {"axis": 1, "largest": 0}),
    "scatter_nd_add": (
        "ScatterND", {"x": f32(4, 3), "i": np.array([[1], [3], [1]]), "u": f32(3, 3)}, ["y"],
        {"reduction": "add"}),
    "gather_nd_batch": (
        "GatherND", {"x": f32(2, 3, 4), "i": np.array([[[1, 2]], [[0, 3]]])}, ["y"],
        {"batch_dims": 1}),
    "cumsum_reverse_exclusive": (
        "CumSum", {"x": f32(3, 5), "a": np.array(1)}, ["y"], {"reverse": 1, "exclusive": 1}),
    "layer_norm_axis_1": (
        "LayerNormalization", {"x": f32(2, 3, 4), "s": f32(3, 4), "b": f32(3, 4)}, ["y"],
        {"axis": 1}),
    "attention_causal_gqa": (
        "Attention", {"q": f32(1, 4, 5, 8), "k": f32(1, 2, 5, 8), "v": f32(1, 2, 5, 8)}, ["y"],
        {"is_causal": 1}, 23),
    "unique_inner_axis": (
        "Unique", {"x": RNG.integers(0, 2, (2, 3, 4)).astype(np.float32)},
        ["y", "i", "inv", "c"], {"axis": 2}),
    "unique_inner_axis_unsorted": (
        "Unique", {"x": RNG.integers(0, 2, (2, 3, 4)).astype(np.float32)},
        ["y", "i", "inv", "c"], {"axis": 1, "sorted": 0}),
    # (samples inside the grid: beyond it ONNX Runtime's bicubic border padding departs from
    # ONNX's reference, which anygpu follows)
    "grid_sample_bicubic_border": (
        "GridSample", {"x": f32(1, 2, 4, 5), "g": RNG.uniform(-0.95, 0.95, (1, 3, 2, 2))
                       .astype(np.float32)}, ["y"],
        {"mode": "cubic", "padding_mode": "border", "align_corners": 0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_matches_onnxruntime(case: str, device: str) -> None:
    op, inputs, outputs, attrs, *rest = CASES[case]
    model = single(op, inputs, outputs, *(rest or [21]), **attrs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {n: a for n, a in inputs.items() if a is not None}
    want = session.run(None, feed)
    got = agx.load(model, device=device).run(None, feed)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
