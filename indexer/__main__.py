"""`python -m indexer` runs the command line."""

from indexer.cli import main

main()
