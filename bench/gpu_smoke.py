"""GPU smoke test: align → compress → serve-edge → eval on the default pair with `--device cuda`, and same-model
exactness on CUDA (float32, greedy: the spliced export answers as `generate` on the concatenation).

    python -m bench.gpu_smoke [--out reports/gpu] [--dtype float32]

Needs a CUDA GPU (it says so in one line and exits 2 without one); CI never runs it. Writes `smoke.json` (each
step's exit status, seconds and the checks) into --out.
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


def article() -> str:
    """The first XSum sample document (a system prompt of a few hundred tokens)."""
    first = (ROOT / "data/xsum/xsum_sample.jsonl").read_text(encoding="utf-8").splitlines()[0]
    return json.loads(first)["document"][:1500]


def _step(name: str, args: list[str], log: dict) -> None:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True)
    log[name] = {"rc": done.returncode, "seconds": round(time.perf_counter() - start, 1),
                 "stderr_tail": done.stderr[-800:]}
    print(f"{name}: rc {done.returncode} in {log[name]['seconds']} s", flush=True)


def same_model_exact(dtype: str, tokens: int = 16) -> dict:
    """Spliced same-model greedy vs generate on the concatenation, on CUDA."""
    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    system, user = article(), "Summarise the article in one sentence."
    out = Path("runs/gpu-smoke/kv-same")
    run_compress(CompressConfig(out=str(out), cloud="default-edge", edge="default-edge", system_prompt=system,
                                dtype=dtype, device="cuda", quant="fp32" if dtype == "float32" else "bf16",
                                start_layer=12))
    edge = load_model("default-edge", dtype, device="cuda")
    session = EdgeSession(edge, str(out), cache_dir="runs/gpu-smoke/copies")
    session.eos_ids.clear()
    got = session.complete(user, SamplingParams(max_new_tokens=tokens)).token_ids
    ids = edge.tokenizer(system)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = edge.model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    return {"tokens": tokens, "agree": sum(a == b for a, b in zip(got, want)), "equal": got == want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/gpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"error: no CUDA GPU visible to torch {torch.__version__}; this smoke test needs one", file=sys.stderr)
        raise SystemExit(2)
    log: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": a.dtype}
    common = ["--dtype", a.dtype, "--device", "cuda"]
    _step("align", ["align", "--cloud", "default-cloud", "--edge", "default-edge", "--out", "runs/gpu-smoke/align",
                    "--num-texts", "8", *common], log)
    Path("runs/gpu-smoke").mkdir(parents=True, exist_ok=True)
    Path("runs/gpu-smoke/system.txt").write_text(article(), encoding="utf-8")
    Path("runs/gpu-smoke/eval.yaml").write_text("eval:\n  align_dir: runs/gpu-smoke/align\n  align_config: null\n")
    _step("compress", ["compress", "--system-prompt", "@runs/gpu-smoke/system.txt", "--out", "runs/gpu-smoke/kv",
                       "--mapping", "runs/gpu-smoke/align/mapping.json", "--quant", "int8", *common], log)
    Path("runs/gpu-smoke/batch.jsonl").write_text(json.dumps({"prompt": "Summarise the article.", "max_tokens": 16}))
    _step("serve-edge", ["serve-edge", "--kv", "runs/gpu-smoke/kv", "--batch", "runs/gpu-smoke/batch.jsonl",
                         "--output", "runs/gpu-smoke/answers.jsonl", *common], log)
    _step("eval", ["eval", "--config", "runs/gpu-smoke/eval.yaml", "--limit", "1", "--dataset", "xsum",
                   "--strategies", "edge-only,edgeprompt,ce-lslm", "--out", "runs/gpu-smoke/eval", *common], log)
    log["same_model_exact"] = same_model_exact(a.dtype)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smoke.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: v for k, v in log.items() if k != "stderr_tail"}, indent=1))


if __name__ == "__main__":
    main()
