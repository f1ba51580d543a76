"""The router side of the feed: documents -> vbuckets, seqnos and index keys -> frames over TCP."""

from indexer.router.documents import Document, read_jsonl, vbucket_of
from indexer.router.feed import FeedError, FeedResult, feed, feed_log
from indexer.router.mutations import MutationManager
from indexer.router.source import SourceError, SourceLog
from indexer.router.workload import Workload, generate

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
