"""`python -m indexer` runs the command line."""

from indexer.cli import main

main(prog_name="indexer")  # not "python -m indexer" in usage lines
