"""Shared fixtures (pytest finds them here): tiny models on disk, calibration texts, a tiny edge and its export.
The helpers they are built from live in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import byte_tokenizer, make_export, save_model, tiny_opt, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Directories of tiny models: a Qwen2 cloud (4 layers, head_dim 16), a Qwen2 edge (3 layers, head_dim 8),
    an OPT model, and an edge twin whose tokenizer has other ids."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "cloud": save_model(tiny_qwen2(4, 64, 4, 2, seed=1), byte_tokenizer(), root / "cloud"),
        "edge": save_model(tiny_qwen2(3, 32, 4, 2, seed=2), byte_tokenizer(), root / "edge"),
        "opt": save_model(tiny_opt(2, 32, 4, seed=3), byte_tokenizer(), root / "opt"),
        "edge_other_tokenizer": save_model(tiny_qwen2(3, 32, 4, 2, seed=2), byte_tokenizer(permute=True),
                                      root / "edge_other"),
    }


@pytest.fixture()
def calib_file(tmp_path) -> Path:
    """A small .jsonl of calibration texts."""
    import json

    texts = [f"Text number {i}: the cloud computes the system prompt once and edges reuse its cache. " * 2
             for i in range(6)]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return path


@pytest.fixture(scope="module")
def edge_dir(tmp_path_factory):
    """A tiny Qwen2 edge (3 layers); initializer_range 0.2 makes its greedy path depend strongly on its cache."""
    model = tiny_qwen2(3, 32, 4, 2, seed=7, init=0.2)
    return save_model(model, byte_tokenizer(), tmp_path_factory.mktemp("e") / "edge")


@pytest.fixture(scope="module")
def edge(edge_dir):
    """The tiny edge, loaded in float32."""
    from edgekv.models.loading import load_model

    return load_model(edge_dir, "float32")


@pytest.fixture(scope="module")
def export(edge_dir, tmp_path_factory):
    """make_export at its defaults (layers 1.. shipped)."""
    return make_export(edge_dir, tmp_path_factory.mktemp("kv") / "kv")
