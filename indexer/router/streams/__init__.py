"""The router's node streams: documents to mutation records and frames, backfill chunks from the
source log, the build encoder, and one task per indexer node (the DCP-like feed).
"""
