"""`edgekv align`: layer-similarity maps between a cloud and an edge model, and the chosen mapping."""

from __future__ import annotations

from rich.table import Table

from cli.common import config_command, console, progress_bar
from edgekv.align.align_job import AlignConfig, run_align


@config_command(AlignConfig, "align")
def align(cfg: AlignConfig) -> None:
    """Compare every cloud×edge layer pair (linear CKA, debiased CKA, RSA) and choose a layer mapping."""
    with progress_bar() as progress:
        result = run_align(cfg, progress)

    sim, mapping = result.similarity, result.mapping
    console.print(f"[bold]{sim['text_source']}[/]; {sim['num_texts']} texts, {sim['num_tokens']} tokens "
                  f"({len(sim['dropped_tokens'])} massive-activation tokens left out)")
    table = Table(title=f"mapping: {mapping['strategy']} (max {mapping['metric']}, from edge layer "
                        f"{mapping['start_layer']})")
    for column in ("edge layer", "← cloud layer", "linear CKA", "debiased CKA", "RSA"):
        table.add_column(column, justify="right")
    for p in mapping["pairs"]:
        table.add_row(str(p["edge_layer"]), str(p["cloud_layer"]), f"{p['linear_cka']:.3f}",
                      f"{p['debiased_cka']:.3f}", f"{p['rsa']:.3f}")
    console.print(table)
    t = result.timings
    console.print(f"forward: cloud {t['cloud_forward_s']:.1f} s, edge {t['edge_forward_s']:.1f} s; "
                  f"similarity {t['similarity_s']:.1f} s → wrote {result.out}/")
