"""`edgekv compress --prompts FILE.jsonl --catalog URL`: one export per system prompt into a catalog, each under
its content address, skipping those already there (resumable, idempotent); a prompt that fails is reported and
skipped, never left as a half entry (the catalog writes an entry's manifest last)."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from edgekv.cluster import run_items
from edgekv.config import to_dict
from edgekv.kv.catalog import Catalog, export_key
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.kv.export import token_ids_sha256
from edgekv.models.loading import check_tokenizers, load_model, load_pair
from edgekv.models.packaged import files_sha256
from edgekv.progress import Tasks
from edgekv.texts import read_prompts

# settings that never change an export's bytes (where it goes, how it is packaged, where the prompts came from)
NOT_IDENTITY = {"out", "tar", "system_prompt", "prompts", "catalog", "ray", "workers"}


def _digest(path: str | None) -> str | None:
    """sha256 of a file, or of a directory's files (a mapping, a saved translator), so the key follows content."""
    if not path:
        return None
    p = Path(path)
    return files_sha256(sorted([p] if p.is_file() else (q for q in p.rglob("*") if q.is_file())))


def identity(cfg: CompressConfig, cloud_fingerprint: str, edge_fingerprint: str, prompt_sha256: str) -> dict:
    """Everything that determines one prompt's export."""
    settings = {k: v for k, v in to_dict(cfg).items() if k not in NOT_IDENTITY}
    settings.update(mapping=_digest(cfg.mapping), translator_path=_digest(cfg.translator_path),
                    calib=_digest(cfg.calib))
    return {"cloud": cloud_fingerprint, "edge": edge_fingerprint, "prompt": prompt_sha256, "settings": settings}


class PromptWorker:
    """Compresses one (name, prompt) into the catalog; built once per process (it loads the models)."""

    def __init__(self, cfg: CompressConfig, models=None):
        self.cfg, self.catalog = cfg, Catalog(cfg.catalog)
        self.cloud, self.edge = models if models is not None else load_pair(
            cfg.cloud, cfg.edge, cfg.dtype, cfg.device_map, cfg.device, cfg.weights)
        check_tokenizers(self.cloud.tokenizer, self.edge.tokenizer)
        self.teacher = load_model(cfg.shared_gate, cfg.dtype, cfg.device_map, cfg.device) if cfg.shared_gate else None

    def __call__(self, item: tuple[str, str]) -> dict:
        """{status: computed | repaired | skipped, row}; the entry is written (a damaged one again), the index left
        to the caller. Skipped means there and verified."""
        name, prompt = item
        ids = self.edge.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        sha = token_ids_sha256(ids)
        key = export_key(identity(self.cfg, self.cloud.fingerprint, self.edge.fingerprint, sha))
        before = self.catalog.status(key)
        if before == "ok":
            return {"status": "skipped", "row": {"key": key, "name": name, "prompt_sha256": sha}}
        with tempfile.TemporaryDirectory(prefix="edgekv-batch-") as tmp:
            one = replace(self.cfg, out=str(Path(tmp) / "kv"), system_prompt=prompt, prompts=None, catalog=None,
                          tar=False, ray=None, workers=1)
            run_compress(one, None, (self.cloud, self.edge), teacher=self.teacher)
            row = self.catalog.put(key, name, Path(tmp) / "kv", sha, index=False)
        return {"status": "repaired" if before == "damaged" else "computed", "row": row}


def run_compress_batch(cfg: CompressConfig, progress=None, models=None) -> dict:
    """Every prompt of cfg.prompts into cfg.catalog, in this process or on Ray (`cfg.ray`, `cfg.workers` actors
    that each load the models once); returns {computed, repaired, skipped, failed: [{name, error}], entries}. The
    index is written here, once, from what the workers report, under the catalog's index lock."""
    prompts = read_prompts(cfg.prompts)
    catalog = Catalog(cfg.catalog)
    advance = Tasks(progress).task(f"compress → {cfg.catalog}", len(prompts))
    use_ray = cfg.ray is not None
    results = run_items(lambda: PromptWorker(cfg, None if use_ray else models), prompts,
                        address=cfg.ray or None, workers=cfg.workers, on_done=lambda r: advance(), use_ray=use_ray)
    out = {"computed": 0, "repaired": 0, "skipped": 0, "failed": [], "entries": []}
    written = []
    for r in results:
        name = r["item"][0]
        if "error" in r:
            out["failed"].append({"name": name, "error": r["error"]})
            continue
        out[r["status"]] += 1
        out["entries"].append({k: r["row"][k] for k in ("name", "key", "prompt_sha256")})
        written.append((r["row"], r["status"] != "skipped"))
    catalog.list_written(written)
    return out
