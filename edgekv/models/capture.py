"""Per-layer activations of a model on calibration token sequences: hidden states, K, V, un-rotated K; and the
structure check that rebuilds a model's KV from its captured block inputs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from edgekv import EdgeKVError
from edgekv.models.structure import (
    decoder_layers,
    kv_from_hidden,
    merge_heads,
    rotary_cos_sin,
    rotate_keys,
    unrotate_keys,
)

FEATURES = ("hidden", "hidden_in", "k", "v", "k_unrot", "q", "q_unrot")


@dataclass
class Activations:
    """Per-layer `(n, d)` float32 matrices over the same n tokens (rows), plus where each token came from."""

    layers: dict[str, list[torch.Tensor]]
    token_ids: torch.Tensor
    positions: torch.Tensor
    text_index: torch.Tensor
    num_layers: int
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())


def _flatten_heads(t: torch.Tensor) -> torch.Tensor:
    """(1, heads, s, hd) → (s, heads·hd): heads concatenated, float32 on CPU."""
    return t[0].permute(1, 0, 2).reshape(t.shape[2], -1).float().cpu()


@torch.no_grad()
def capture(
    model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    features: Iterable[str] = ("hidden",),
    select: Callable[[int, int], torch.Tensor | None] | None = None,
    on_text: Callable[[int], None] | None = None,
    on_output: Callable[[int, object], None] | None = None,
    after: tuple[Callable[[], object], int] | None = None,
) -> Activations:
    """Run `model` on each 1-D token sequence (one at a time: no padding) and collect per-layer features.

    `select(text_index, length)` may return the positions of that text to keep (seeded subsampling);
    memory stays bounded by what is kept, in float32 on CPU. `on_output(text_index, model_output)` sees each
    forward's output (logits) before it is dropped. `after` = (a function giving a fresh request cache over a
    prefix, the position the sequence starts at): each sequence is read after that prefix, and K, V and the
    rotated queries are the sequence's own, at its positions (a prompt under a shared prefix).
    """
    features = tuple(features)
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown feature(s) {sorted(unknown)}; choose from {FEATURES}")
    num_layers = model.config.num_hidden_layers
    device = next(model.parameters()).device
    chunks: dict[str, list[list[torch.Tensor]]] = {f: [[] for _ in range(num_layers)] for f in features}
    need_cache = any(f in ("k", "v", "k_unrot") for f in features)
    block_out: list[torch.Tensor] = []
    block_in: list[torch.Tensor] = []
    query_out: list[torch.Tensor] = []
    handles = []
    if "hidden" in features:
        # hooks, not output_hidden_states: that tuple's last entry is the final-norm output, not the block's
        handles += [layer.register_forward_hook(lambda m, i, o: block_out.append(o[0] if isinstance(o, tuple) else o))
                    for layer in decoder_layers(model)]
    if "hidden_in" in features:  # the input of block i (embeddings for i = 0), what its K and V are made from
        handles += [layer.register_forward_pre_hook(
            lambda m, args, kwargs: block_in.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
            for layer in decoder_layers(model)]
    if "q" in features or "q_unrot" in features:
        handles += [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: query_out.append(o))
                    for layer in decoder_layers(model)]
    try:
        hooked = (block_out, block_in, query_out)
        return _capture(model, sequences, features, select, on_text, on_output, chunks, hooked, need_cache, device,
                        after)
    finally:
        for h in handles:
            h.remove()


def _queries(model: torch.nn.Module, raw: torch.Tensor, rotate: bool, start: int = 0) -> torch.Tensor:
    """q_proj output (1, s, heads·hd) → (1, heads, s, hd), rotated at positions start..start+s-1 when asked."""
    heads = model.config.num_attention_heads
    q = raw.reshape(1, raw.shape[1], heads, -1).transpose(1, 2).float()
    if rotate:
        cs = rotary_cos_sin(model, torch.arange(start, start + raw.shape[1], device=raw.device)[None], q)
        if cs is not None:
            q = rotate_keys(q, *cs)  # queries rotate exactly as keys do
    return q


def _capture(model, sequences, features, select, on_text, on_output, chunks, hooked, need_cache, device, after):
    block_out, block_in, query_out = hooked
    start = after[1] if after else 0
    num_layers = model.config.num_hidden_layers
    ids_out, pos_out, text_out = [], [], []
    for t, seq in enumerate(sequences):
        seq = seq.reshape(-1)
        keep = select(t, seq.numel()) if select else None
        keep = torch.arange(seq.numel()) if keep is None else keep
        for hooked_list in hooked:
            hooked_list.clear()
        # the head's logits only where a caller reads them: over a 151k vocabulary they are 15-28 % of a prefill
        keep_logits = 0 if on_output else 1
        if after:
            cache = after[0]()
            out = model(input_ids=seq[None].to(device), cache=cache, use_cache=True, logits_to_keep=keep_logits,
                        position_ids=torch.arange(start, start + seq.numel(), device=device)[None])
        else:
            out = model(input_ids=seq[None].to(device), use_cache=need_cache, logits_to_keep=keep_logits)
        for name, seen in (("hidden", block_out), ("hidden_in", block_in)):
            if name in chunks:
                for i in range(num_layers):
                    chunks[name][i].append(seen[i][0, keep].float().cpu())
        if on_output:
            on_output(t, out)
        for name, rotate in (("q", True), ("q_unrot", False)):
            if name in chunks:
                for i in range(num_layers):
                    chunks[name][i].append(_flatten_heads(_queries(model, query_out[i], rotate, start))[keep])
        if need_cache:
            cache = out.cache
            positions = torch.arange(start, start + seq.numel(), device=device)[None]
            for i in range(num_layers):
                keys, values = cache.layers[i].keys, cache.layers[i].values
                if "k" in chunks:
                    chunks["k"][i].append(_flatten_heads(keys)[keep])
                if "v" in chunks:
                    chunks["v"][i].append(_flatten_heads(values)[keep])
                if "k_unrot" in chunks:
                    cs = rotary_cos_sin(model, positions, keys)
                    raw = keys if cs is None else unrotate_keys(keys.float(), *cs)
                    chunks["k_unrot"][i].append(_flatten_heads(raw)[keep])
        ids_out.append(seq[keep].cpu())
        pos_out.append(keep.clone())
        text_out.append(torch.full((keep.numel(),), t, dtype=torch.long))
        del out
        if on_text:
            on_text(t)
    layers = {f: [torch.cat(c) for c in per_layer] for f, per_layer in chunks.items()}
    return Activations(
        layers=layers,
        token_ids=torch.cat(ids_out) if ids_out else torch.zeros(0, dtype=torch.long),
        positions=torch.cat(pos_out) if pos_out else torch.zeros(0, dtype=torch.long),
        text_index=torch.cat(text_out) if text_out else torch.zeros(0, dtype=torch.long),
        num_layers=num_layers,
    )


def kv_reconstruction_error(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    """Per layer, the relative error max|K̂−K|/max|K| (and the same for V, whichever is larger) of the KV that
    `kv_from_hidden` rebuilds from each block's captured input against the model's own cache on `ids`."""
    acts = capture(model, [ids], ("hidden_in", "k", "v"))
    errors = []
    with torch.no_grad():
        for i in range(acts.num_layers):
            keys, values = kv_from_hidden(model, i, acts.layers["hidden_in"][i])
            pairs = ((merge_heads(keys).cpu(), acts.layers["k"][i]), (merge_heads(values).cpu(), acts.layers["v"][i]))
            errors.append(max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs))
    return errors


def check_kv_reconstruction(model: torch.nn.Module, ids: torch.Tensor, tol: float | None = None) -> float:
    """Refuse (one line, naming the block) a model whose KV `kv_from_hidden` cannot rebuild from hidden states;
    returns the worst relative error. `tol` defaults by dtype (float32 1e-4, else 5e-2)."""
    if tol is None:
        tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2
    errors = kv_reconstruction_error(model, ids)
    worst = max(range(len(errors)), key=errors.__getitem__)
    if errors[worst] > tol:
        block = type(decoder_layers(model)[worst]).__name__
        raise EdgeKVError(f"edgekv rebuilds {block} KV wrongly (layer {worst}: relative error {errors[worst]:.2g} > "
                          f"{tol:g}); this block structure is not supported")
    return errors[worst]
