"""`edgekv catalog verify|rebuild URL`: an operator's check of an export catalog, and its index rebuilt."""

from __future__ import annotations

import json

import typer

from cli.common import console, one_line_errors
from edgekv import EdgeKVError
from edgekv.kv.catalog import Catalog


@one_line_errors
def catalog(
    action: str = typer.Argument(..., help="verify (check every entry and the index) or rebuild (the index from "
                                 "the whole entries)."),
    url: str = typer.Argument(..., help="The catalog: a folder or an fsspec URL."),
) -> None:
    """Verify a catalog's entries (manifest and every file's sha256) or rebuild its index from them; exits 1 when
    an entry is damaged or the index is not the whole entries."""
    if action not in ("verify", "rebuild"):
        raise EdgeKVError(f"unknown action '{action}' (choose verify or rebuild)")
    store = Catalog(url)
    try:
        store.keys()
    except (OSError, ValueError) as exc:
        raise EdgeKVError(f"{url}: cannot list the catalog ({type(exc).__name__}: {exc})") from exc
    if action == "rebuild":
        got = store.rebuild_index()
        console.print(f"index rebuilt: {len(got['rows'])} entries, {len(got['damaged'])} damaged left out")
        for key, why in got["damaged"].items():
            console.print(f"[red]damaged {key}: {why}[/red]")
        print(json.dumps({"entries": len(got["rows"]), "damaged": got["damaged"]}))
        if got["damaged"]:
            raise typer.Exit(1)
        return
    got = store.verify()
    console.print(f"{len(got['ok'])} whole, {len(got['damaged'])} damaged, {len(got['incomplete'])} incomplete; "
                  f"index: {len(got['unlisted'])} whole entries unlisted, {len(got['listed_not_whole'])} listed "
                  "but not whole")
    for key, why in got["damaged"].items():
        console.print(f"[red]damaged {key}: {why}[/red]")
    print(json.dumps(got))
    if got["damaged"] or got["unlisted"] or got["listed_not_whole"]:
        raise typer.Exit(1)
