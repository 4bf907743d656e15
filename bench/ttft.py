"""Bench time to first token on the default edge model, every condition side by side in one run (medians).

    python -m bench.ttft [--system 1024] [--user 64] [--reps 9] [--weights W] [--het-kv runs/kv-ttft-het] [--json OUT]

Conditions (S system + U user tokens, the edge on `--weights`, serve-edge's default, one request at a time):
- full prefill: `model(system+user)` as a user would write it (all logits), and with only the last logits;
- deep-copy baseline: prefill the system prompt once, `copy.deepcopy` its DynamicCache per request, forward U;
- spliced same-model: an `EdgeSession` on a same-model export (split m), warm (all layers in);
- spliced heterogeneous: an `EdgeSession` on a cloud export (the compress defaults), warm;
- engine same-model: the serving engine (relay attention through the CPU flash kernel) on the same session,
  driven inline (`background=False`): every condition computes on the main thread, one OpenMP pool;
- cold start with the shallow layers from a peer edge's same-model export vs the local shallow prefill;
- cold pipelined: a fresh session per request with the link emulator set so that transfer ≈ compute; per-layer
  compute and transfer are measured and the pipeline model's predicted TTFT is compared with the measured one.
Also: same-model bf16 exactness (first-step logit difference, greedy token agreement vs full prefill).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from bench.compress import xsum_prompt
from edgekv.eval.network import layer_times
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.models.loading import load_model
from edgekv.models.prepack import prepack_linears
from edgekv.models.structure import decoder_layers
from edgekv.serve.pipeline import Link, overlap_efficiency, predict_ttft
from edgekv.serve.requests import GenRequest
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.serve_job import ServeConfig
from edgekv.serve.session import EdgeSession
from edgekv.texts import sharegpt_texts

ROOT = Path(__file__).resolve().parents[1]


def flops(model, q_tokens: int, kv_tokens: int, logits: int) -> float:
    """Forward FLOPs: 2·params per token through the blocks, causal attention scores/values, the LM head."""
    cfg = model.config
    layers = decoder_layers(model)  # weights held as buffers (gguf blocks, int4 packs) count by their shape
    blocks = sum(p.numel() for p in layers.parameters()) + sum(
        m.in_features * m.out_features for m in layers.modules()
        if hasattr(m, "in_features") and not isinstance(getattr(m, "weight", None), torch.nn.Parameter))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # query t (0-based within the q block) attends to kv_tokens − q_tokens + t + 1 keys
    attended = q_tokens * (kv_tokens - q_tokens) + q_tokens * (q_tokens + 1) / 2
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * attended
    return 2 * blocks * q_tokens + attention + 2 * cfg.hidden_size * cfg.vocab_size * logits


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def user_layer_times(session: EdgeSession, user: torch.Tensor) -> tuple[list[float], float]:
    """Per-layer compute (s) of one warm user forward, and the rest (embedding, norm, head)."""
    per, total = layer_times(session.model, lambda: session.complete(user, SamplingParams(max_new_tokens=1)))
    return per, total - sum(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--split", type=int, default=12, help="m for the same-model splice")
    ap.add_argument("--het-kv", default="runs/kv-ttft-het", help="heterogeneous export (made if missing)")
    ap.add_argument("--work", default="runs/bench-ttft")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-prepack", action="store_true", help="keep nn.Linear (serve-edge prepacks by default)")
    ap.add_argument("--weights", default=ServeConfig().weights, help="the edge's linears (serve-edge's default)")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    edge = load_model("default-edge", "bfloat16", weights=args.weights)
    model, tok = edge.model, edge.tokenizer
    sys_ids = xsum_prompt(tok, args.system)
    system = tok.decode(sys_ids)
    sys_ids = torch.tensor(tok(system)["input_ids"])  # what a session will use: the text re-encoded
    users = []
    for text in sharegpt_texts(200, offset=3000).texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= args.user:
            users.append(torch.tensor(ids[: args.user]))
        if len(users) == 3:
            break
    S, U = sys_ids.numel(), args.user
    bound = flops(model, S + U, S + U, S + U) / flops(model, U, S + U, 1)  # counts parameters: before prepacking
    packed = 0 if args.no_prepack else prepack_linears(model)  # every condition runs on the same model
    print(f"S = {S} system tokens (XSum), U = {U} user tokens (ShareGPT); --weights {args.weights}; "
          f"{torch.get_num_threads()} threads; "
          f"{packed} linear layers prepacked")

    same_kv = work / "kv-same"
    run_compress(CompressConfig(out=str(same_kv), cloud="default-edge", edge="default-edge", system_prompt=system,
                                quant="bf16", start_layer=args.split))
    het_kv = Path(args.het_kv)
    if not (het_kv / "manifest.json").exists():
        run_compress(CompressConfig(out=str(het_kv), system_prompt=system, translator="hidden", quant="int8",
                                    prune_ratio=0.5, mapping=str(ROOT / "runs/align-default/mapping.json")
                                    if (ROOT / "runs/align-default/mapping.json").exists() else None))
    same = EdgeSession(edge, str(same_kv), cache_dir=work / "cache")
    het = EdgeSession(edge, str(het_kv), cache_dir=work / "cache")
    same.wait_loaded()
    het.wait_loaded()
    if het.prefix_len != S:
        raise SystemExit(f"the heterogeneous export {het_kv} was made for another system prompt; delete it")

    with torch.no_grad():
        base_cache = model(sys_ids[None], use_cache=True).cache
    full_ids = [torch.cat([sys_ids, u])[None] for u in users]
    positions = torch.arange(S, S + U)[None]

    def full_prefill(n=[0]):
        with torch.no_grad():
            model(full_ids[n[0] % 3]).logits
        n[0] += 1

    def full_last(n=[0]):
        with torch.no_grad():
            model(full_ids[n[0] % 3], logits_to_keep=1).logits
        n[0] += 1

    def deep_copy(n=[0]):
        with torch.no_grad():
            model(users[n[0] % 3][None], cache=copy.deepcopy(base_cache), position_ids=positions).logits
        n[0] += 1

    def spliced(session):
        def run(n=[0]):
            session.complete(users[n[0] % 3], SamplingParams(max_new_tokens=1))
            n[0] += 1
        return run

    engine = same.engine(max_batch=1, background=False)  # every condition computes on this one thread

    def engine_run(n=[0]):
        engine.generate(GenRequest(users[n[0] % 3], SamplingParams(max_new_tokens=1)))
        n[0] += 1

    conditions = {"full prefill (all logits)": full_prefill, "full prefill (last logits)": full_last,
                  "deep-copy DynamicCache": deep_copy, "spliced same-model": spliced(same),
                  "spliced heterogeneous": spliced(het), "engine same-model (relay)": engine_run}
    for fn in conditions.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {k: [] for k in conditions}
    for _ in range(args.reps):  # interleaved rounds: drift hits every condition alike
        for name, fn in conditions.items():
            samples[name] += timed(fn, 1)
    engine.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["full prefill (all logits)"]
    # the machine's speed drifts over minutes (±15 %); each round's conditions run back to back, so the ratio
    # within a round cancels the drift: its median over rounds is the paired speed-up
    paired = {k: statistics.median(f / x for f, x in zip(samples["full prefill (all logits)"], v))
              for k, v in samples.items()}
    print(f"\nTTFT, median of {args.reps} (FLOP bound of a splice vs full prefill: {bound:.1f}×)")
    print(f"{'condition':<28}{'median ms':>11}{'speedup':>10}{'paired':>9}")
    for k, v in med.items():
        print(f"{k:<28}{v * 1e3:>11.1f}{base / v:>9.1f}×{paired[k]:>8.1f}×")

    # ---- cold, pipelined, link emulator set so that transfer ≈ compute
    per_layer, head = user_layer_times(same, users[0])
    shallow = statistics.median([EdgeSession(edge, str(same_kv), cache_dir=work / "cache").system.timings[
        "shallow_prefill_s"] for _ in range(3)])
    deep_bytes = [e.bytes for e in same.system.loader.events]
    compute = shallow + sum(per_layer) + head
    bandwidth = sum(deep_bytes) * 8 / compute / 1e6
    link = Link(bandwidth_mbps=bandwidth, latency_ms=0.0)
    measured, predicted, serial, bounds = [], [], [], []
    for rep in range(args.reps):
        start = time.perf_counter()
        session = EdgeSession(edge, str(same_kv), link=link, cache_dir=work / "cache")
        built = time.perf_counter() - start
        done = session.complete(users[rep % 3], SamplingParams(max_new_tokens=1))
        ttft = built + done.ttft_s  # to the first token's logits; not the bookkeeping after it
        session.wait_loaded()
        transfer = [link.seconds(e.bytes) + e.decode_s for e in session.system.loader.events]
        model_ = predict_ttft(session.system.timings["shallow_prefill_s"], per_layer, transfer,
                              session.system.start_layer, head)
        measured.append(ttft)
        predicted.append(model_["predicted_s"])
        serial.append(model_["serial_s"])
        bounds.append(model_["bound_s"])
        del done
    m, p = statistics.median(measured), statistics.median(predicted)
    s, b = statistics.median(serial), statistics.median(bounds)
    eff = overlap_efficiency(m, s, b)
    print(f"\ncold start, same-model m={args.split}, link {bandwidth:.1f} Mbit/s ({sum(deep_bytes):,} deep bytes):")
    wire = sum(link.seconds(x) for x in deep_bytes)
    print(f"  compute {compute * 1e3:.1f} ms (shallow system prefill {shallow * 1e3:.1f} + user layers "
          f"{sum(per_layer) * 1e3:.1f} + head {head * 1e3:.1f}); transfer {wire * 1e3:.1f} ms")
    print(f"  measured TTFT {m * 1e3:.1f} ms, predicted {p * 1e3:.1f} ms ({(m - p) / p * 100:+.1f} %); serial "
          f"{s * 1e3:.1f} ms, perfect-overlap bound {b * 1e3:.1f} ms; overlap efficiency {eff * 100:.0f} %")

    # ---- cold start with the shallow layers from a peer edge's same-model export (no link emulation)
    peer_kv = work / "kv-peer"
    run_compress(CompressConfig(out=str(peer_kv), cloud="default-edge", edge="default-edge", system_prompt=system,
                                quant="bf16", start_layer=0))
    cold = {"local shallow prefill": [], "shallow layers from a peer": []}
    for rep in range(args.reps):
        for name, peer in (("local shallow prefill", None), ("shallow layers from a peer", str(peer_kv))):
            start = time.perf_counter()
            session = EdgeSession(edge, str(same_kv), cache_dir=work / "cache", peer_kv=peer)
            built = time.perf_counter() - start
            cold[name].append(built + session.complete(users[rep % 3], SamplingParams(max_new_tokens=1)).ttft_s)
    cold_med = {k: statistics.median(v) for k, v in cold.items()}
    print(f"\ncold TTFT, m={args.split}, deep layers from disk: local shallow prefill "
          f"{cold_med['local shallow prefill'] * 1e3:.1f} ms, shallow layers from a peer "
          f"{cold_med['shallow layers from a peer'] * 1e3:.1f} ms (saves "
          f"{(cold_med['local shallow prefill'] - cold_med['shallow layers from a peer']) * 1e3:.1f} ms)")

    # ---- bf16 exactness of the same-model splice
    agree, diffs = [], []
    same.eos_ids.clear()
    for u in users:
        full = torch.cat([sys_ids, u])[None]
        with torch.no_grad():
            want_logits = model(full, logits_to_keep=1).logits[0, -1].float()
            want = model.generate(full, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, full.shape[1]:].tolist()
            got_logits = model(u[None], cache=same.system.request_cache(), position_ids=positions,
                               logits_to_keep=1).logits[0, -1].float()
        got = same.complete(u, SamplingParams(max_new_tokens=32)).token_ids
        diffs.append(float((got_logits - want_logits).abs().max()))
        same_prefix = next((k for k, (a, b_) in enumerate(zip(got, want)) if a != b_), 32)
        agree.append(same_prefix)
    print(f"\nbf16 same-model splice vs full prefill: first-step max |Δlogit| {', '.join(f'{d:.3f}' for d in diffs)}; "
          f"greedy tokens identical for the first {', '.join(map(str, agree))} of 32")
    if args.json:
        Path(args.json).write_text(json.dumps({"S": S, "U": U, "reps": args.reps, "weights": args.weights,
                                               "prepacked_linears": packed, "samples": samples, "median": med,
                                               "paired_speedup": paired,
                                               "flop_bound": bound, "cold": {
                                                   "bandwidth_mbps": bandwidth, "measured": measured,
                                                   "predicted": predicted, "serial": serial, "bound": bounds,
                                                   "per_layer_s": per_layer, "head_s": head, "shallow_s": shallow,
                                                   "overlap_efficiency": eff},
                                               "bf16": {"max_abs_logit_diff": diffs, "agree_prefix": agree},
                                               "cold_peer": cold},
                                              indent=1))


if __name__ == "__main__":
    main()
