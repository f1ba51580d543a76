"""A router as K processes: the parent reads the input and serves HTTP, each shard owns a range of
vbuckets with its own source and node streams; what they say over the shard's pipes.
"""
