"""A shared prefix (issue 37): K edge-shaped KV tokens of every layer, trained once per (edge, teacher) pair
(`edgekv distill --train-shared`), that sit before every system prompt. The prefix takes positions 0..K−1 (its
first token is the attention sink) and the system prompt is read after it from position K, so a system prompt's
KV *under* the prefix is the edge's prefill of the prompt with the prefix as its cache.

It ships as an ordinary KV export (manifest + one safetensors file per layer, sha256-verified, refused for another
edge or tokenizer) of regime `shared-prefix`, whose manifest says K, the teacher's fingerprint, the training
prompts' hash and the steps. Its `fingerprint` (the manifest's own sha256) is what anything made under it records.
With K = 0 every path is EdgePrompt's exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import PrefixKV
from edgekv.kv.codecs import quantize
from edgekv.kv.export import Expect, KVExport, KVStoreError, export_manifest, tokenizer_fingerprint, write_export
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.loading import LoadedModel

REGIME = "shared-prefix"


def write_shared_prefix(out: str | Path, edge: LoadedModel, layers: list[tuple[torch.Tensor, torch.Tensor]],
                        init_ids: torch.Tensor, info: dict, quant: str = "fp32") -> Path:
    """Write the prefix's per-layer (kv_heads, K, d) keys and values as a `shared-prefix` export (atomically);
    `info` (K, teacher, prompts' hash, steps, …) goes into the manifest as `shared_prefix`."""
    tensors, entries = {}, []
    for i, (k, v) in enumerate(layers):
        kq, vq = quantize(k.float(), quant, axis="channel"), quantize(v.float(), quant, axis="token")
        tensors[i] = {"key.data": kq.data, "value.data": vq.data}
        entries.append({"edge_layer": i, "cloud_layer": i, "space": "edge",
                        "key": {**kq.params(), "head_dim": int(k.shape[-1]),
                                "kept_channels": [list(range(k.shape[-1]))] * k.shape[0], "recent": 0},
                        "value": vq.params()})
    manifest = export_manifest({}, edge, init_ids, entries, regime=REGIME, splice="prefix", start_layer=0,
                               mapping="none", map_location="none", local_sink_tokens=0, prune={}, quant=quant,
                               kv_tokens=int(layers[0][0].shape[1]) if layers else 0,
                               shared_prefix={**info, "tokens": int(layers[0][0].shape[1]) if layers else 0})
    return write_export(out, manifest, tensors)


class SharedPrefix:
    """A loaded, verified shared prefix for one edge model: `prefix`, a K-token `PrefixKV` (a system prompt under it
    is `prefix_kv.read_after(model, prefix, ids)`)."""

    def __init__(self, path: str | Path, edge: LoadedModel):
        export = KVExport(path, Expect(edge_fingerprint=edge.fingerprint,
                                       tokenizer_fingerprint=tokenizer_fingerprint(edge.tokenizer)))
        m = export.manifest
        if m.get("regime") != REGIME:
            raise KVStoreError(f"{path}: not a shared prefix (regime {m.get('regime')!r}); make one with "
                               "`edgekv distill --train-shared`")
        if export.layer_indices != list(range(edge.num_layers)):
            raise KVStoreError(f"{path}: a shared prefix needs every layer 0..{edge.num_layers - 1} of the edge")
        self.path, self.manifest, self.info = str(path), m, m["shared_prefix"]
        self.tokens = int(self.info["tokens"])
        self.fingerprint = m["manifest_sha256"]
        dtype = next(edge.model.parameters()).dtype
        layers = []
        for i in export.layer_indices:
            k, v = edge_kv(decode_layer(export, i), edge.model)
            layers.append((k[None].to(dtype), v[None].to(dtype)))
        self.prefix = PrefixKV(layers, self.tokens)
        self.nbytes = sum(e.get("bytes", 0) for e in m["layers"])

    def describe(self) -> dict:
        """What a manifest or report records of the prefix it was made under."""
        return {"path": self.path, "fingerprint": self.fingerprint, "tokens": self.tokens}



def check_made_under(shared: SharedPrefix | None, recorded: dict | None, what: str) -> None:
    """Refuse `what`, made under the prefix `recorded` (None: under none), unless it is read under that same
    prefix (`shared`, None: none)."""
    have = (recorded or {}).get("fingerprint")
    if shared is None:
        if recorded:
            raise EdgeKVError(f"{what} was made under shared prefix {(have or '?')[:12]}…; give it with --shared")
    elif have != shared.fingerprint:
        made = f"under shared prefix {have[:12]}…" if have else "without a shared prefix"
        raise EdgeKVError(f"{what} was made {made}; it cannot be read under shared prefix "
                          f"{shared.fingerprint[:12]}… ({shared.path})")

