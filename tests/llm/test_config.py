"""Model folders that cannot load raise errors naming the file and what is wrong; the
configuration reads every family's keys (old and new RoPE layouts)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from anygpu import llm
from anygpu.llm.config import ModelConfig, ModelFolderError
from anygpu.nn import state

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture
def folder(tiny, tmp_path):
    """A copy of the tiny Llama folder to break."""
    out = tmp_path / "model"
    shutil.copytree(tiny("llama")[0], out)
    return out


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _load(folder):
    return llm.load(folder, device="cpu", max_seq_len=16)


def test_missing_or_malformed_configuration(folder, tmp_path):
    with pytest.raises(ModelFolderError, match="not a folder"):
        _load(tmp_path / "nowhere")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"config\.json: cannot be read as JSON"):
        _load(folder)
    os.remove(folder / "config.json")
    with pytest.raises(ModelFolderError, match=r"config\.json: not found"):
        _load(folder)


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "'yarn' is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 2.0}), "lacks 'low_freq_factor'"),
])
def test_bad_configuration_values(folder, changes, message):
    _edit_json(folder / "config.json", **changes)
    with pytest.raises(ModelFolderError, match=message) as err:
        _load(folder)
    assert "config.json" in str(err.value)


def test_missing_and_misshapen_tensors(folder):
    path = folder / "model.safetensors"
    tensors = {k: a for k, (a, _) in state._read(path)[0].items()}
    name = "model.layers.1.mlp.up_proj.weight"
    state.save_file({k: v for k, v in tensors.items() if k != name}, path)
    with pytest.raises(ModelFolderError, match=f"model.safetensors: the tensor '{name}' is "
                       "missing"):
        _load(folder)
    state.save_file({**tensors, name: np.ones((3, 64), np.float32)}, path)
    with pytest.raises(ModelFolderError, match=r"has shape \[3, 64\], expected \[128, 64\]"):
        _load(folder)
    path.write_bytes(b"\x01")
    with pytest.raises(ModelFolderError, match="not a safetensors file"):
        _load(folder)
    os.remove(path)
    with pytest.raises(ModelFolderError, match="neither model.safetensors nor"):
        _load(folder)


def test_sharded_weights_and_bad_indexes(folder):
    path = folder / "model.safetensors"
    tensors = {k: a for k, (a, _) in state._read(path)[0].items()}
    os.remove(path)
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        state.save_file({k: tensors[k] for k in part}, folder / file)
    weight_map = {k: f for f, part in halves.items() for k in part}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    lm = _load(folder)
    assert lm.generate([1, 9, 23], max_new_tokens=2, ignore_eos=True)
    index.write_text(json.dumps({"weight_map": {**weight_map, names[0]: "c.safetensors"}}))
    with pytest.raises(ModelFolderError, match="in c.safetensors, which is not in the folder"):
        _load(folder)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelFolderError, match="index.json: no 'weight_map'"):
        _load(folder)


def test_a_folder_without_a_tokenizer_takes_ids(folder):
    os.remove(folder / "tokenizer.json")
    lm = _load(folder)
    assert lm.tokenizer is None and len(lm.generate([1, 9], max_new_tokens=3,
                                                    ignore_eos=True)) == 3
    with pytest.raises(ValueError, match="no tokenizer.json"):
        lm.generate("hello")


def test_old_rope_keys_and_head_dim():
    base = dict(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4)
    old = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "head_dim": 32,
                                 "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (old.rope_type, old.rope_theta, old.head_dim, old.num_kv_heads) == \
        ("linear", 500000.0, 32, 4)
    plain = ModelConfig.from_dict({**base, "head_dim": 32, "rope_theta": 500000.0})
    np.testing.assert_allclose(old.inverse_frequencies(), plain.inverse_frequencies() / 2)
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 4,
                                  "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
