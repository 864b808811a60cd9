"""Write deterministic, realistic-looking safetensors models (one file, or sharded with an index) for tests.

Same arguments, same bytes, on any machine; it must never need a network, torch, or a Python loop per element.

The layout imitates a llama-style checkpoint: `model.embed_tokens.weight`, per layer
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (grouped-query k/v), `mlp.{gate,up,down}_proj.weight`,
two RMS norms, then `model.norm.weight` and `lm_head.weight`, plus a small int64 buffer and a 0-d scalar,
so tests meet 0-d, 1-d and 2-d tensors and several dtypes. numpy has no bfloat16, so "bfloat16" tensors
are stored with their raw bits as `U16` (what `safetensors.numpy` can load back). Values are random bits
with one exponent bit cleared, so every float is finite (|x| < 2) and `np.array_equal` works without NaNs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

#: Matrix dtypes used round-robin per layer unless the caller says otherwise.
DEFAULT_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
#: dtype name -> (numpy storage dtype, uint64 mask clearing the top exponent bit of every element).
_STORAGE: dict[str, tuple[np.dtype, int]] = {
    "bfloat16": (np.dtype(np.uint16), 0xBFFF_BFFF_BFFF_BFFF),
    "float16": (np.dtype(np.float16), 0xBFFF_BFFF_BFFF_BFFF),
    "float32": (np.dtype(np.float32), 0xBFFF_FFFF_BFFF_FFFF),
    "float64": (np.dtype(np.float64), 0xBFFF_FFFF_FFFF_FFFF),
    "int8": (np.dtype(np.int8), 0xFFFF_FFFF_FFFF_FFFF),
    "uint8": (np.dtype(np.uint8), 0xFFFF_FFFF_FFFF_FFFF),
    "int32": (np.dtype(np.int32), 0xFFFF_FFFF_FFFF_FFFF),
    "int64": (np.dtype(np.int64), 0xFFFF_FFFF_FFFF_FFFF),
}
#: Shape rules, as in llama-like models: hidden a multiple of 64, MLP 8/3 x hidden rounded up to 256,
#: 4 query heads per k/v head.
HIDDEN_MULTIPLE = 64
MLP_MULTIPLE = 256
GQA_GROUPS = 4
#: Aim for about this many layers, so a 1.6 GB model has hundreds of tensors of a few to tens of MB.
TARGET_LAYERS = 24
MIN_HIDDEN = 64
#: The tail (embeddings + lm_head) absorbs what the layers leave; keep at least this many rows each.
MIN_VOCAB = 16
#: Small fixed extras: an int64 position buffer and a 0-d float32 scalar.
POSITION_IDS_LEN = 2048
SAFETENSORS_METADATA = {"format": "pt"}
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the layout: `dtype` is the logical name (`bfloat16`), stored per `_STORAGE`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    seed_index: int

    @property
    def storage_dtype(self) -> np.dtype:
        return _STORAGE[self.dtype][0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.storage_dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratedModel:
    """What was written: the files (in shard order), tensor -> file name, and the tensor data bytes."""

    files: list[Path]
    weight_map: dict[str, str]
    data_bytes: int

    @property
    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def model_layout(total_bytes: int, dtypes: Sequence[str] = DEFAULT_DTYPES) -> list[TensorSpec]:
    """The tensors of a model whose data comes to ~`total_bytes` (within one embedding row of it)."""
    for dtype in dtypes:
        if dtype not in _STORAGE:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_STORAGE)}")
    if not dtypes:
        raise ValueError("need at least one dtype")
    mean_itemsize = sum(_STORAGE[d][0].itemsize for d in dtypes) / len(dtypes)
    # Per layer ~ (2 + 2/GQA) h^2 attention + 3 * (8/3) h^2 MLP = 10.5 h^2 elements; layers get 2/3 of
    # the budget, embeddings + lm_head the rest. Solve for h, then let the vocabulary soak up the remainder.
    per_layer_elems = 2 + 2 / GQA_GROUPS + 3 * 8 / 3
    hidden_estimate = math.sqrt(total_bytes / (mean_itemsize * per_layer_elems * TARGET_LAYERS * 1.5))
    hidden = max(MIN_HIDDEN, int(hidden_estimate) // HIDDEN_MULTIPLE * HIDDEN_MULTIPLE)
    mlp = -(-hidden * 8 // 3 // MLP_MULTIPLE) * MLP_MULTIPLE
    kv = max(HIDDEN_MULTIPLE, hidden // GQA_GROUPS)
    head_dtype = dtypes[0]
    head_itemsize = _STORAGE[head_dtype][0].itemsize

    def size(entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
        return sum(math.prod(shape) * _STORAGE[dtype][0].itemsize for _, dtype, shape in entries)

    extras = [
        ("model.rotary_emb.position_ids", "int64", (1, POSITION_IDS_LEN)),
        ("model.rotary_emb.attention_scaling", "float32", ()),
        ("model.norm.weight", "float32", (hidden,)),
    ]
    budget = total_bytes - size(extras) - 2 * MIN_VOCAB * hidden * head_itemsize
    layers: list[tuple[str, str, tuple[int, ...]]] = []
    layer = 0
    while True:
        dtype = dtypes[layer % len(dtypes)]
        prefix = f"model.layers.{layer}"
        one_layer = [
            (f"{prefix}.input_layernorm.weight", "float32", (hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", dtype, (hidden, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", dtype, (kv, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", dtype, (kv, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", dtype, (hidden, hidden)),
            (f"{prefix}.post_attention_layernorm.weight", "float32", (hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", dtype, (mlp, hidden)),
            (f"{prefix}.mlp.up_proj.weight", dtype, (mlp, hidden)),
            (f"{prefix}.mlp.down_proj.weight", dtype, (hidden, mlp)),
        ]
        # Stop before the layers eat the third of the budget kept for the embeddings.
        if layer > 0 and size(layers) + size(one_layer) > budget * 2 / 3:
            break
        layers += one_layer
        layer += 1
    remaining = total_bytes - size(extras) - size(layers)
    vocab = max(MIN_VOCAB, remaining // (2 * hidden * head_itemsize))
    head = ("model.embed_tokens.weight", head_dtype, (vocab, hidden))
    entries = [head, *extras[:2], *layers, extras[2], ("lm_head.weight", head_dtype, (vocab, hidden))]
    return [TensorSpec(name, dtype, shape, i) for i, (name, dtype, shape) in enumerate(entries)]


def tensor_data(spec: TensorSpec, seed: int = 0) -> np.ndarray:
    """The tensor's values: a pure function of (seed, spec), generated 8 bytes at a time."""
    storage, mask = _STORAGE[spec.dtype]
    rng = np.random.default_rng([seed, spec.seed_index])
    words = -(-spec.nbytes // 8)
    raw = rng.integers(0, 2**64, size=words, dtype=np.uint64, endpoint=False)
    raw &= np.uint64(mask)
    return raw.view(np.uint8)[: spec.nbytes].view(storage).reshape(spec.shape)


def _tensors(specs: Sequence[TensorSpec], seed: int) -> Iterator[tuple[str, np.ndarray]]:
    for spec in specs:
        yield spec.name, tensor_data(spec, seed)


def write_model(
    path: str | os.PathLike[str],
    total_bytes: int,
    seed: int = 0,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
) -> GeneratedModel:
    """Write one safetensors file of ~`total_bytes` (header adds a few KB) and describe it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = model_layout(total_bytes, dtypes)
    save_file(dict(_tensors(specs, seed)), path, metadata=SAFETENSORS_METADATA)
    return GeneratedModel(
        files=[path],
        weight_map={s.name: path.name for s in specs},
        data_bytes=sum(s.nbytes for s in specs),
    )


def shard_name(index: int, count: int) -> str:
    """Hugging Face's shard naming: `model-00001-of-00004.safetensors` (1-based)."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_sharded_model(
    directory: str | os.PathLike[str],
    total_bytes: int,
    shards: int = 4,
    seed: int = 0,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
) -> GeneratedModel:
    """Write `shards` files splitting the same layout in order by bytes, plus `model.safetensors.index.json`.

    Shards are written one at a time, so memory peaks at about one shard, not the whole model.
    """
    if shards < 1:
        raise ValueError("shards must be >= 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specs = model_layout(total_bytes, dtypes)
    if shards > len(specs):
        raise ValueError(f"{shards} shards for only {len(specs)} tensors")
    total = sum(s.nbytes for s in specs)
    # Cut where the running byte count crosses k/shards of the total, keeping every shard non-empty.
    starts = [0]
    running = 0
    cumulative_before = []
    for spec in specs:
        cumulative_before.append(running)
        running += spec.nbytes
    for k in range(1, shards):
        target = k * total / shards
        cut = next((i for i, before in enumerate(cumulative_before) if before >= target), len(specs))
        starts.append(min(max(cut, starts[-1] + 1), len(specs) - (shards - k)))
    starts.append(len(specs))
    groups = [specs[starts[k] : starts[k + 1]] for k in range(shards)]
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for index, group in enumerate(groups):
        name = shard_name(index, shards)
        save_file(dict(_tensors(group, seed)), directory / name, metadata=SAFETENSORS_METADATA)
        files.append(directory / name)
        weight_map.update((s.name, name) for s in group)
    index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
    return GeneratedModel(files=files, weight_map=weight_map, data_bytes=total)
