"""The API's state: the daemon as the API sees it (`DaemonView`) and what it counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from indexer.build import IndexBuild
from indexer.catalog import IndexCatalog
from indexer.cluster.standing import ClusterStanding
from indexer.collector import CollectorPauses
from indexer.compaction import Compactor
from indexer.config import LimitsConfig, SecurityConfig
from indexer.metrics import SCAN_BUCKETS_S, Histogram, process_started_at, version
from indexer.pipeline import Pipeline
from indexer.rollback import Rollback
from indexer.snapshots import SnapshotStore
from indexer.storage import IndexStore, StoredIndex
from indexer.streams import StreamRegistry
from indexer.timekeeper import Timekeeper
from indexer.timestamps import HighWaterTimestamp
from slab import MemoryThrottle, SlabPool
from workers.worker import Worker


@dataclass
class DaemonView:
    """The parts of the running daemon the API reads; it changes nothing but pins."""

    pipeline: Pipeline
    hwt: HighWaterTimestamp
    pool: SlabPool
    throttle: MemoryThrottle
    in_memory_interval_s: float
    catalog: IndexCatalog | None = None
    compactor: Compactor | None = None
    collector: CollectorPauses | None = None
    rollback: Rollback | None = None
    ready: bool = False
    standing: ClusterStanding | None = None  # in a cluster in etcd: may it answer, and for what

    @property
    def store(self) -> IndexStore:
        return self.pipeline.store

    @property
    def indexes(self) -> list[StoredIndex]:
        return self.pipeline.indexes

    @property
    def snapshots(self) -> SnapshotStore:
        return self.pipeline.snapshots

    @property
    def registry(self) -> StreamRegistry:
        return self.pipeline.registry

    @property
    def workers(self) -> list[Worker]:
        return self.pipeline.workers

    @property
    def timekeeper(self) -> Timekeeper:
        return self.pipeline.timekeeper


@dataclass
class IndexReads:
    """The scan and count requests one index answered: /stats' and /metrics' per-index view."""

    scans: int = 0
    rows: int = 0
    latency: Histogram = field(default_factory=lambda: Histogram(SCAN_BUCKETS_S))


class ApiState:
    """What the API keeps between requests: the daemon's view, its limits and token, and the
    counters of reads and refusals; and what the indexes are."""

    def __init__(
        self,
        view: DaemonView,
        security: SecurityConfig | None = None,
        limits: LimitsConfig | None = None,
    ) -> None:
        self.view = view
        self.security = security or SecurityConfig()
        self.limits = limits or LimitsConfig()
        # The app's own registry: two apps in one process (the tests) never share metrics.
        self.metrics = CollectorRegistry()
        ProcessCollector(registry=self.metrics)
        self.started_at = process_started_at()
        self.version = version()
        self.active_scans = 0  # streaming rows now
        self.scans_in_flight = 0  # scan, count and split requests being served now
        self.scans_served = 0  # scan and count requests answered since start
        self.reads: dict[str, IndexReads] = {}  # by index name
        self.bytes_on_disk: dict[str, int] = {}  # by index name, as last measured
        self.refused = {"unauthorized": 0, "too_many_scans": 0, "too_many_rows": 0}
        # GET /indexes/NAME/types answers, by (index name, snapshot number): a walk each.
        self.types_cache: dict[tuple[str, int], list[set[str]]] = {}

    def _builds(self) -> list[tuple[str, IndexBuild]]:
        """(index name, its build) of every index being built; one build may hold several."""
        catalog = self.view.catalog
        return [] if catalog is None else list(catalog.builds.items())

    def _deferred(self) -> list[StoredIndex]:
        """The deferred indexes: stored, holding nothing until built."""
        catalog = self.view.catalog
        return [] if catalog is None else catalog.deferred_indexes()

    def _all_indexes(self) -> list[StoredIndex]:
        """Every index of the store: those maintained, those being built and deferred ones."""
        built = [build.index(name) for name, build in self._builds()]
        return [*self.view.indexes, *built, *self._deferred()]

    def index_list(self) -> list[dict[str, Any]]:
        counts = self.view.timekeeper.statistics().entry_counts
        out = [self._index_entry(i, counts[j]) for j, i in enumerate(self.view.indexes)]
        for name, build in self._builds():
            out.append(self._build_entry(build, name))
        out.extend(self._index_entry(i, 0) for i in self._deferred())
        return out

    def _index_entry(self, index: StoredIndex, entries: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": index.definition.name,
            "keys": list(index.definition.keys),
            "state": index.state,
            "entries": entries,
        }
        if index.definition.where is not None:
            out["where"] = index.definition.where
        if index.state == "incremental":
            out["note"] = "created at run time: holds the mutations streamed since its creation"
        return out

    def _build_entry(self, build: IndexBuild, name: str) -> dict[str, Any]:
        """Index `name`'s entry of /indexes while `build` builds it."""
        status = build.status()
        j = build.names.index(name)
        out = self._index_entry(build.indexes[j], build.entries[j])
        out["state"] = status.state
        out["build"] = asdict(status)
        return out
