"""The `edgekv` Typer app: one sub-command per module."""

from __future__ import annotations

import logging

import typer
from transformers.utils import logging as hf_logging

from cli.align import align
from cli.catalog import catalog
from cli.compress import compress
from cli.distill import distill
from cli.eval import eval_, report
from cli.plan import plan
from cli.serve_edge import serve_edge
from cli.train_fuser import train_fuser

app = typer.Typer(
    name="edgekv",
    help="Cloud-edge LLM inference through KV-cache reuse between heterogeneous models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("align")(align)
app.command("compress")(compress)
app.command("serve-edge")(serve_edge)
app.command("eval")(eval_)
app.command("report")(report)
app.command("plan")(plan)
app.command("train-fuser")(train_fuser)
app.command("distill")(distill)
app.command("catalog")(catalog)
hf_logging.disable_progress_bar()  # our own rich bars report progress; HF's tqdm lines would interleave
_handler = logging.StreamHandler()  # stderr: one-time notices such as the first conversion of a default model
_handler.setFormatter(logging.Formatter("edgekv: %(message)s"))
logging.getLogger("edgekv").addHandler(_handler)
logging.getLogger("edgekv").setLevel(logging.INFO)


if __name__ == "__main__":
    app()
