"""Reading checkpoints: one tensor at a time, in its stored dtype, from the right shard; bad files are one-line errors."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specbuild.compile.load import eos_token_ids, load_checkpoint
from specbuild.errors import CheckpointError


@pytest.fixture
def sharded(checkpoints, tmp_path):
    """The tiny Llama re-saved as bf16 in two shards with an index, as large checkpoints come."""
    source = checkpoints("llama")
    folder = tmp_path / "sharded"
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(source / "model.safetensors").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, folder / file)
    weight_map = {n: file for file, members in shards.items() for n in members}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, tensors


def test_tensors_come_from_the_shard_the_index_names_in_their_stored_dtype(sharded):
    folder, expected = sharded
    ckpt = load_checkpoint(folder, "target")
    assert sorted(ckpt.tensor_names()) == sorted(expected)
    for name, tensor in expected.items():
        array = ckpt.tensor(name)
        assert array.dtype == ml_dtypes.bfloat16 and array.shape == tuple(tensor.shape)
        assert np.array_equal(array.view(np.uint16), tensor.view(torch.int16).numpy().view(np.uint16))


def test_a_shard_the_index_does_not_name_is_not_read(sharded):
    folder, _ = sharded
    save_file({"stray": torch.zeros(2)}, folder / "stray.safetensors")
    assert "stray" not in load_checkpoint(folder, "target").tensor_names()


def one_line_checkpoint_error(folder, *fragments):
    with pytest.raises(CheckpointError) as caught:
        ckpt = load_checkpoint(folder, "target")
        for name in ckpt.tensor_names():
            ckpt.tensor(name)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_a_truncated_shard_is_a_one_line_error_naming_it(sharded):
    folder, _ = sharded
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    one_line_checkpoint_error(folder, str(shard), "truncated")


@pytest.mark.parametrize("garbage", [b"", b"\x01\x02", b"\xff" * 8 + b"{}", b"\x08\0\0\0\0\0\0\0not json"])
def test_a_corrupt_header_is_a_one_line_error_naming_the_file(sharded, garbage):
    folder, _ = sharded
    shard = folder / "model-00001-of-00002.safetensors"
    shard.write_bytes(garbage)
    one_line_checkpoint_error(folder, str(shard))


def test_a_tensor_missing_from_the_checkpoint_is_a_one_line_error(sharded):
    folder, _ = sharded
    ckpt = load_checkpoint(folder, "target")
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight"):
        del ckpt.entries["model.layers.0.mlp.up_proj.weight"]
        ckpt.tensor("model.layers.0.mlp.up_proj.weight")


def test_an_index_naming_a_missing_shard_is_a_one_line_error(sharded):
    folder, _ = sharded
    (folder / "model-00002-of-00002.safetensors").unlink()
    one_line_checkpoint_error(folder, "model-00002-of-00002.safetensors", "incomplete")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"eos_token_id": "two"}'])
def test_a_malformed_generation_config_is_a_one_line_error(checkpoints, tmp_path, text):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("llama"), folder)
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json|eos_token_id") as caught:
        eos_token_ids(load_checkpoint(folder, "target"))
    assert "\n" not in str(caught.value)
