"""The router side of the feed: documents -> vbuckets, seqnos and index keys -> frames over TCP."""

from indexer.router.documents import Document, read_jsonl, vbucket_of
from indexer.router.inputs.workload import Workload, generate
from indexer.router.source.log import SourceError, SourceLog
from indexer.router.source.mutations import MutationManager
from indexer.router.streams.feed import FeedError, FeedResult, feed, feed_log

__all__ = [
    "Document",
    "FeedError",
    "FeedResult",
    "MutationManager",
    "SourceError",
    "SourceLog",
    "Workload",
    "feed",
    "feed_log",
    "generate",
    "read_jsonl",
    "vbucket_of",
]
