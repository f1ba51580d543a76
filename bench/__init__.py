"""Benchmarks of the indexer; run them as scripts, e.g. `python bench/ingest.py`."""
