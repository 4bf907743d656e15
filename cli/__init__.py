"""The `edgekv` command line: thin Typer commands over the edgekv library."""
