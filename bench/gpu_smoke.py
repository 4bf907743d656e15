"""GPU smoke test: align → compress → serve-edge → eval on the default pair with `--device cuda`, and same-model
exactness on CUDA (float32, greedy: the spliced export answers as `generate` on the concatenation).

    python -m bench.gpu_smoke [--out reports/gpu] [--dtype float32] [--pair default|tiny] [--device cuda]

`--pair tiny` runs the same commands on two tiny random Qwen2 models of different widths (saved under runs/, the
tests' byte tokenizer; XSum documents as calibration texts) for a GPU machine the 1.5 GB default pair cannot reach,
and adds per-prompt distillation (batched teacher) and a shared prefix with per-prompt distillation on top of it;
its eval step is left out (the offline BERTScore model is an 88 MB package). Needs a CUDA GPU for `--device cuda`
(it says so in one line and exits 2 without one); `--device cpu` runs the same steps here, to check the script.
CI never runs it. Writes `smoke.json` (each step's exit status, seconds and the checks) into --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CHARS = {True: 1500, False: 300}  # the system prompt's characters: default pair, tiny pair (bytes: 512 positions)


def article(chars: int = 1500) -> str:
    """The first XSum sample document (a system prompt of a few hundred tokens)."""
    first = (ROOT / "data/xsum/xsum_sample.jsonl").read_text(encoding="utf-8").splitlines()[0]
    return json.loads(first)["document"][:chars]


def _step(name: str, args: list[str], log: dict) -> None:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True)
    log[name] = {"rc": done.returncode, "seconds": round(time.perf_counter() - start, 1),
                 "stderr_tail": done.stderr[-800:]}
    print(f"{name}: rc {done.returncode} in {log[name]['seconds']} s", flush=True)


def tiny_pair(root: Path) -> tuple[str, str]:
    """Two tiny random Qwen2 models of different widths and depths (cloud, edge) with the tests' byte tokenizer."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers import byte_tokenizer, save_model, tiny_qwen2

    tok = byte_tokenizer()
    cloud = save_model(tiny_qwen2(4, 64, 4, 2, seed=1), tok, root / "cloud")
    edge = save_model(tiny_qwen2(3, 32, 4, 2, seed=2), tok, root / "edge")
    return cloud, edge


def same_model_exact(dtype: str, model: str, device: str, tokens: int = 16) -> dict:
    """Spliced same-model greedy vs generate on the concatenation, on `device`."""
    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    system, user = article(CHARS[model == "default-edge"]), "Summarise the article in one sentence."
    out = Path("runs/gpu-smoke/kv-same")
    layers = 1 if model != "default-edge" else 12
    run_compress(CompressConfig(out=str(out), cloud=model, edge=model, system_prompt=system,
                                dtype=dtype, device=device, quant="fp32" if dtype == "float32" else "bf16",
                                start_layer=layers))
    edge = load_model(model, dtype, device=device)
    session = EdgeSession(edge, str(out), cache_dir="runs/gpu-smoke/copies")
    session.eos_ids.clear()
    got = session.complete(user, SamplingParams(max_new_tokens=tokens)).token_ids
    ids = edge.tokenizer(system)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = edge.model.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    return {"tokens": tokens, "agree": sum(a == b for a, b in zip(got, want)), "equal": got == want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/gpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pair", choices=("default", "tiny"), default="default")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: no CUDA GPU visible to torch {torch.__version__}; this smoke test needs one", file=sys.stderr)
        raise SystemExit(2)
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "none (cpu)"
    log: dict = {"gpu": gpu, "torch": torch.__version__, "dtype": a.dtype, "pair": a.pair, "device": a.device}
    root = Path("runs/gpu-smoke")
    root.mkdir(parents=True, exist_ok=True)
    cloud, edge = tiny_pair(root / "pair") if a.pair == "tiny" else ("default-cloud", "default-edge")
    common = ["--dtype", a.dtype, "--device", a.device]
    pair = ["--cloud", cloud, "--edge", edge]
    texts = []  # the tiny pair calibrates on XSum documents (the default pair on ShareGPT, a 120 MB package)
    if a.pair == "tiny":
        docs = (ROOT / "data/xsum/xsum_sample.jsonl").read_text(encoding="utf-8").splitlines()[5:25]
        (root / "texts.txt").write_text("".join(json.loads(d)["document"][:CHARS[False]].replace("\n", " ") + "\n"
                                                for d in docs), encoding="utf-8")
        texts = ["--texts", str(root / "texts.txt")]
    _step("align", ["align", *pair, "--out", str(root / "align"), "--num-texts", "8", *texts, *common], log)
    (root / "system.txt").write_text(article(CHARS[a.pair == "default"]), encoding="utf-8")
    (root / "eval.yaml").write_text(f"eval:\n  align_dir: {root / 'align'}\n  align_config: null\n")
    _step("compress", ["compress", *pair, "--system-prompt", f"@{root / 'system.txt'}", "--out", str(root / "kv"),
                       "--mapping", str(root / "align/mapping.json"), "--quant", "int8",
                       *(["--calib", texts[1]] if texts else []), *common], log)
    (root / "batch.jsonl").write_text(json.dumps({"prompt": "Summarise the article.", "max_tokens": 16}))
    _step("serve-edge", ["serve-edge", "--edge", edge, "--kv", str(root / "kv"), "--batch", str(root / "batch.jsonl"),
                         "--output", str(root / "answers.jsonl"), *common], log)
    if a.pair == "default":
        _step("eval", ["eval", "--config", str(root / "eval.yaml"), "--limit", "1", "--dataset", "xsum",
                       "--strategies", "edge-only,edgeprompt,ce-lslm", "--out", str(root / "eval"), *common], log)
    else:
        small = ["--queries", "6", "--steps", "4", "--batch", "2"]
        _step("distill", ["distill", *pair, "--system-prompt", f"@{root / 'system.txt'}", "--out",
                          str(root / "distill"), *small, *common], log)
        docs = (ROOT / "data/xsum/xsum_sample.jsonl").read_text(encoding="utf-8").splitlines()[1:5]
        (root / "prompts.jsonl").write_text("".join(
            json.dumps({"name": f"doc{i}", "system_prompt": json.loads(d)["document"][:CHARS[False]]}) + "\n"
            for i, d in enumerate(docs)))
        _step("distill-shared", ["distill", *pair, "--train-shared", "--prompts", str(root / "prompts.jsonl"),
                                 "--shared-tokens", "4", "--held-prompts", "1", "--out", str(root / "shared"),
                                 *small, *common], log)
        _step("distill-on-shared", ["distill", *pair, "--shared", str(root / "shared/prefix"), "--system-prompt",
                                    f"@{root / 'system.txt'}", "--out", str(root / "distill-shared"), *small,
                                    *common], log)
    log["same_model_exact"] = same_model_exact(a.dtype, edge, a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: v for k, v in log.items() if k != "stderr_tail"}, indent=1))


if __name__ == "__main__":
    main()
