"""Bench `edgekv compress` on the default pair: bytes vs attention error over λ × quantization, one run.

    python bench/compress.py [--tokens 1024] [--mapping runs/align-default/mapping.json] [--map-on cloud]

The system prompt is XSum articles (data/xsum, held out from the ShareGPT calibration texts) cut to exactly
--tokens tokens. The cloud KV and the maps are computed once; every (λ, quant) cell re-encodes them through the
same `encode_layer` the command uses. Errors are means over the exported layers on held-out queries.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edgekv.align.mapping import layer_pairs
from edgekv.kv.cloud_kv import calibration, get_translator, heterogeneous_layers
from edgekv.kv.compress_job import CompressConfig
from edgekv.kv.encode import encode_layer, raw_fp16_bytes
from edgekv.models.loading import load_model
from edgekv.models.structure import attn_shape
from edgekv.progress import Tasks

ROOT = Path(__file__).resolve().parents[1]


def xsum_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """Concatenated XSum documents, exactly `tokens` tokens."""
    ids: list[int] = []
    for line in (ROOT / "data/xsum/xsum_sample.jsonl").read_text().splitlines():
        ids += tokenizer(json.loads(line)["document"] + "\n\n")["input_ids"]
        if len(ids) >= tokens:
            return torch.tensor(ids[:tokens])
    raise SystemExit("not enough XSum text")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--mapping", default=None)
    ap.add_argument("--map-on", default="cloud", choices=["cloud", "edge"])
    ap.add_argument("--translator", default="ridge", choices=["ridge", "hidden"])
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75")
    ap.add_argument("--quants", default="fp16,int8,int4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = CompressConfig(out="unused", system_prompt="unused", mapping=args.mapping, map_on=args.map_on,
                         translator=args.translator)
    cloud, edge = load_model(cfg.cloud), load_model(cfg.edge)
    ids = xsum_prompt(edge.tokenizer, args.tokens)
    pairs, source = layer_pairs(cfg.mapping, cfg.start_layer, cloud.num_layers, edge.num_layers)
    timings: dict = {}
    start = time.perf_counter()
    translator, edge_cal = get_translator(cfg, cloud, edge, pairs, calibration(cfg, edge.tokenizer), Tasks())
    timings["calibration_s"] = time.perf_counter() - start
    layers = heterogeneous_layers(cloud, edge, ids, translator, edge_cal, cfg)
    print(f"system prompt: {ids.numel()} XSum tokens; mapping: {source}; map on {args.map_on}; "
          f"calibration + cloud KV {time.perf_counter() - start:.1f} s")
    print("held-out R² per edge layer ← cloud layer:")
    for kv in layers:
        print(f"  {kv.edge_layer:2d} ← {kv.cloud_layer:2d}: K {kv.map_info['r2_k']:.3f}  V {kv.map_info['r2_v']:.3f}")
    _, c_kv, c_hd = attn_shape(cloud.model)
    raw_cloud = len(layers) * raw_fp16_bytes(ids.numel(), c_kv, c_hd)
    raw_shipped = sum(raw_fp16_bytes(ids.numel(), kv.keys.shape[0], kv.keys.shape[2]) for kv in layers)
    rows = []
    print(f"{'λ':>5} {'quant':>5} {'bytes':>10} {'× cloud fp16':>13} {'× shipped fp16':>15} "
          f"{'attn err prune':>15} {'attn err total':>15} {'V err':>7}")
    for quant in args.quants.split(","):
        for ratio in [float(r) for r in args.ratios.split(",")]:
            enc = [encode_layer(kv, ratio, quant, 0)[2] for kv in layers]
            nbytes = sum(r["bytes"] for r in enc)
            row = {"ratio": ratio, "quant": quant, "bytes": nbytes, "x_cloud": raw_cloud / nbytes,
                   "x_shipped": raw_shipped / nbytes,
                   "attn_prune": sum(r["attn_error_prune"] for r in enc) / len(enc),
                   "attn_total": sum(r["attn_error_total"] for r in enc) / len(enc),
                   "value_error": sum(r["value_error"] for r in enc) / len(enc)}
            rows.append(row)
            print(f"{ratio:>5.2f} {quant:>5} {nbytes:>10,} {row['x_cloud']:>13.2f} {row['x_shipped']:>15.2f} "
                  f"{row['attn_prune']:>15.4f} {row['attn_total']:>15.4f} {row['value_error']:>7.4f}")
    print("(bytes = tensor payload of the exported layers; each layer file adds a safetensors header of ~0.2-0.3 KB)")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": int(ids.numel()), "mapping": source, "rows": rows,
                                               "r2": [kv.map_info for kv in layers]}, indent=1))


if __name__ == "__main__":
    main()
