"""A shared prefix (issue 37): K edge-shaped KV tokens of every layer, trained once per (edge, teacher) pair
(`edgekv distill --train-shared`), that sit before every system prompt. The prefix takes positions 0..K−1 (its
first token is the attention sink) and the system prompt is read after it from position K, so a system prompt's
KV *under* the prefix is the edge's prefill of the prompt with the prefix as its cache.

It ships as an ordinary KV export (manifest + one safetensors file per layer, sha256-verified, refused for another
edge or tokenizer) of regime `shared-prefix`, whose manifest says K, the teacher's fingerprint, the training
prompts' hash and the steps. Its `fingerprint` (the manifest's own sha256) is what anything made under it records.
With K = 0 every path is EdgePrompt's exactly.

The gate (`compress --shared-gate TEACHER`): a prefix trained once is not good for every prompt (on MMLU's 5-shot
prompts it is worse than none), so the cloud side may check it on each system prompt before it ships: the export
is made under the prefix only when the prefix brings the edge's next-token distribution on the prompt's own second
half closer to the teacher's (KL, the quantity the prefix was trained to lower); otherwise it is a plain export
that records the prefix it declined, and an edge holding that prefix reads it without. The check reads the system
prompt only, never a request.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import PrefixKV, continuation_logits
from edgekv.kv.codecs import quantize
from edgekv.kv.export import Expect, KVExport, KVStoreError, export_manifest, tokenizer_fingerprint, write_export
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.loading import LoadedModel
from edgekv.models.mixed import float32_scoring
from edgekv.models.structure import model_device
from edgekv.models.targets import mean_kl

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

    def trained_on(self) -> list[str]:
        """The names of the prompts its training read, the held-out ones included (early stopping read them)."""
        return [*self.info.get("train_prompts", []), *self.info.get("held_out_prompts", [])]

    def describe(self) -> dict:
        """What a manifest or report records of the prefix it was made under."""
        return {"path": self.path, "fingerprint": self.fingerprint, "tokens": self.tokens}


@torch.no_grad()
def gate(shared: SharedPrefix, edge: LoadedModel, teacher: LoadedModel, ids: torch.Tensor) -> dict:
    """Whether a system prompt (`ids`) is read under the prefix: KL(teacher ‖ edge) on the prompt's second half
    (the positions that have read at least half of it, as requests read all of it), the edge reading the prompt
    after the prefix and alone, the teacher reading it alone as in training. Reads the prefix only when that
    lowers the KL (ties, K = 0 included, read none)."""
    last = max(1, ids.numel() // 2)

    def logits(m: LoadedModel) -> torch.Tensor:
        return m.model(input_ids=ids[None].to(model_device(m.model)), logits_to_keep=last).logits[0]

    with float32_scoring():  # a KL is a score: under mixed its heads (16 rows at a 32-token prompt) stay float32
        target, alone = logits(teacher), logits(edge)
        without = mean_kl(target, alone)
        under = mean_kl(target, continuation_logits(edge.model, shared.prefix, ids, last)) if shared.tokens else without
    return {"teacher": teacher.fingerprint, "tokens": last, "kl_without": without, "kl_with": under,
            "reads_prefix": under < without}


def read_under(shared: SharedPrefix | None, manifest: dict, what: str) -> SharedPrefix | None:
    """The prefix `what` (an export, by its `manifest`) is read under, given the prefix the edge holds (`shared`,
    None: none): the one it was made under, refused unless that is `shared`; none when its gate declined exactly
    `shared` (or when the edge holds none)."""
    declined = (manifest.get("shared_declined") or {}).get("fingerprint")
    if declined is not None:
        if shared is not None and shared.fingerprint != declined:
            raise EdgeKVError(f"{what} was gated against shared prefix {declined[:12]}…, not "
                              f"{shared.fingerprint[:12]}… ({shared.path})")
        return None
    have = (manifest.get("under_shared") or {}).get("fingerprint")
    if shared is None:
        if manifest.get("under_shared"):
            raise EdgeKVError(f"{what} was made under shared prefix {(have or '?')[:12]}…; give it with --shared")
    elif have != shared.fingerprint:
        made = f"under shared prefix {have[:12]}…" if have else "without a shared prefix"
        raise EdgeKVError(f"{what} was made {made}; it cannot be read under shared prefix "
                          f"{shared.fingerprint[:12]}… ({shared.path})")
    return shared
