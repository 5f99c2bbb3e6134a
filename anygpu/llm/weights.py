"""A model folder's weights: ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists, checked against the configuration's shapes.

Every tensor the model needs must be present with its expected shape; anything else raises
``ModelFolderError`` naming the file and the tensor. Values are uploaded in the compute dtype
(float32, float16 or bfloat16), which defaults to the files' own floating dtype where the device
supports it, else float32; or, asked for, the projections quantized (``anygpu.llm.quant``).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from anygpu import dtype as dt
from anygpu.llm.config import ModelConfig, ModelFolderError, read_json
from anygpu.llm.quant import check_quant, quantize
from anygpu.nn import state
from anygpu.tensor import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPUTE_DTYPES = {"float32": dt.float32, "float16": dt.float16, "bfloat16": dt.bfloat16}
# the weights ``quant`` quantizes: the linear projections (and the output projection when it is
# not the embedding table); embeddings and norms stay in the compute dtype
PROJECTIONS = ("_proj.weight", "lm_head.weight")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor the model reads (Hugging Face's names)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inner = cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, h)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for name, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)),
                            ("down_proj", (h, inner))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
    return shapes


def weight_files(folder: str) -> dict[str, str]:
    """{tensor name: safetensors file holding it}; from the index when there is one, else every
    tensor of ``model.safetensors`` (names filled in when it is read)."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        index = read_json(index_path, "the index of the weight shards")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFolderError(f"{index_path}: no 'weight_map' of tensor names to files")
        out = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or os.path.basename(file) != file:
                raise ModelFolderError(f"{index_path}: tensor {name!r} maps to {file!r}, "
                                       "not a file name in the folder")
            path = os.path.join(folder, file)
            if not os.path.isfile(path):
                raise ModelFolderError(f"{index_path}: tensor {name!r} is in {file}, which "
                                       "is not in the folder")
            out[name] = path
        return out
    path = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(path):
        raise ModelFolderError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} is there "
                               "(only safetensors weights can be read)")
    return {"*": path}


def _arrays(files: dict[str, str]) -> Iterator[tuple[str, str, np.ndarray, dt.DType]]:
    """(file, name, host array, stored dtype) of every tensor in the files, one file at a
    time."""
    for path in dict.fromkeys(files.values()):
        try:
            arrays, _ = state._read(path)
        except ValueError as err:
            raise ModelFolderError(str(err)) from err
        for name, (arr, stored) in arrays.items():
            yield path, name, arr, stored


def compute_dtype(requested: Any, stored: dt.DType | None, device: Any) -> dt.DType:
    """The dtype the model computes in: ``requested`` (a name or an anygpu dtype), else the
    stored floating dtype where the device has it, else float32."""
    if requested is not None:
        d = COMPUTE_DTYPES.get(requested) if isinstance(requested, str) else requested
        if d is None or d not in COMPUTE_DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got "
                             f"{requested!r}")
        if not device.supports(d):
            raise ValueError(f"{device.name} does not support {d.name}")
        return d
    if stored is not None and stored in COMPUTE_DTYPES.values() and device.supports(stored):
        return stored
    return dt.float32


def load_weights(folder: str, cfg: ModelConfig, device: Any, dtype: Any = None,
                 quant_kind: str | None = None, group_size: int = 32
                 ) -> tuple[dict[str, Any], dt.DType]:
    """The model's tensors on ``device`` and the compute dtype they are in; with
    ``quant_kind`` ("q8" or "q4") the projections are ``QuantizedWeight``s, quantized on the
    host one tensor at a time."""
    check_quant(quant_kind, group_size)
    files = weight_files(folder)
    want = expected_shapes(cfg)
    host: dict[str, tuple[np.ndarray, dt.DType]] = {}
    where: dict[str, str] = {}
    for path, name, arr, stored in _arrays(files):
        if name in want:
            host[name], where[name] = (arr, stored), path
    for name, shape in want.items():
        origin = files.get(name, files.get("*", folder))
        if name not in host:
            raise ModelFolderError(f"{origin}: the tensor {name!r} is missing")
        if tuple(host[name][0].shape) != shape:
            raise ModelFolderError(f"{where[name]}: the tensor {name!r} has shape "
                                   f"{list(host[name][0].shape)}, expected {list(shape)} "
                                   "from config.json")
        if quant_kind is not None and name.endswith(PROJECTIONS) and shape[1] % group_size:
            raise ValueError(f"{where[name]}: the tensor {name!r} has {shape[1]} inputs, "
                             f"which do not split into groups of {group_size}")
    compute = compute_dtype(dtype, next((d for _, d in host.values() if d.is_float), None),
                            device)
    out: dict[str, Any] = {}
    for name in want:
        arr, _ = host.pop(name)
        if quant_kind is not None and name.endswith(PROJECTIONS):
            out[name] = quantize(arr, quant_kind, group_size, device.name, compute)
            continue
        # norms' weights too: Hugging Face multiplies them in the compute dtype
        out[name] = Tensor(np.ascontiguousarray(arr), device=device.name, dtype=compute)
        out[name].realize()
    return out, compute
