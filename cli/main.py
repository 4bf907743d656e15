"""The `edgekv` Typer app: one sub-command per module."""

from __future__ import annotations

import logging

import typer
from transformers.utils import logging as hf_logging

from cli.align import align
from cli.common import fail
from cli.compress import compress

app = typer.Typer(
    name="edgekv",
    help="Cloud-edge LLM inference through KV-cache reuse between heterogeneous models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("align")(align)
app.command("compress")(compress)
hf_logging.disable_progress_bar()  # our own rich bars report progress; HF's tqdm lines would interleave
_handler = logging.StreamHandler()  # stderr: one-time notices such as the first conversion of a default model
_handler.setFormatter(logging.Formatter("edgekv: %(message)s"))
logging.getLogger("edgekv").addHandler(_handler)
logging.getLogger("edgekv").setLevel(logging.INFO)


def _not_yet(name: str, issue: str):
    def command() -> None:
        fail(f"'edgekv {name}' is not yet available (planned: {issue})", 2)

    command.__doc__ = f"(not yet available) {issue}."
    return command


app.command("serve-edge")(_not_yet("serve-edge", "decoding on spliced caches, pipelined loading, HTTP/batch"))
app.command("eval")(_not_yet("eval", "strategies × XSum/MMLU/ShareGPT, Table II, latency curves"))

if __name__ == "__main__":
    app()
