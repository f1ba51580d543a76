"""Configuration: the embedded default merged with an optional TOML file, validated once.

Every stage receives only its typed part. An unknown key or a bad value raises `ConfigError`
with a message naming the key, which the CLI prints as one line before exiting non-zero.
"""

from __future__ import annotations

import os
import re
import ssl
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import psutil

from config import default_config_text
from indexer.cluster.map import ClusterMapError, parse_vbuckets
from indexer.expressions import ExpressionError, normalize_keys
from indexer.protocol import MAX_TOKEN_CHARS, PRIMARY_KEY, IndexDefinition
from indexer.storage import COMPACTION_NICE
from indexer.where import WhereError, normalize_where
from slab import parse_size

INDEX_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
PRIMARY_NAME = "#primary"  # GSI's name for a primary index, allowed for one only
MAX_INDEXES = 64
MAX_KEYS = 16
LOG_LEVELS = ("debug", "info", "warning", "error")
MIN_TOKEN_CHARS = 16
TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: fits a header and a JSON string
TOKEN_ENV = "INDEXER_TOKEN"  # the variable clients (router, feed, CLI) read a token from


class ConfigError(ValueError):
    """A configuration key is unknown or has a bad value."""


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    host: str
    feed_port: int
    http_port: int
    max_frame_bytes: int
    num_vbuckets: int
    owned_vbuckets: tuple[int, ...]
    log_level: str
    flow_control_bytes: int = 4 << 20
    cluster_lease_s: int = 10  # a node's registration in etcd, and its failover's delay
    # Set by `indexer serve --cluster-map F --node N` (or --cluster etcd://...): the node
    # follows the map's changes.
    cluster_map: Path | str | None = None
    cluster_node: str | None = None


@dataclass(frozen=True)
class PipelineConfig:
    workers: int
    channel_batches: int
    ring_slots: int
    back_index_cache: int


@dataclass(frozen=True)
class SnapshotConfig:
    in_memory_interval_s: float
    persist_interval_s: float
    recovery_points: int = 5


@dataclass(frozen=True)
class ChangesConfig:
    """The change history the feed reads (indexer/changes.py)."""

    history: bool = True  # written by every flush; off: no feed, a little cheaper ingest
    retention_s: float = 3600.0  # history older than this is dropped...
    retention_snapshots: int = 10  # ...but the latest persisted snapshots' is always kept
    retention_bytes: int | None = None  # the oldest beyond this much store is dropped too


@dataclass(frozen=True)
class CompactionConfig:
    interval_s: float  # 0: only on demand
    thread_nice: int = COMPACTION_NICE  # LevelDB's compaction thread; 0: as the daemon
    compression: str | None = None  # of the table files LevelDB writes: None or "snappy"


@dataclass(frozen=True)
class SlabConfig:
    pool_bytes: int
    slab_bytes: int
    min_chunk: int


@dataclass(frozen=True)
class MemoryConfig:
    quota_bytes: int
    high_mark: float
    low_mark: float
    min_available_bytes: int
    sample_interval_s: float


@dataclass(frozen=True)
class SecurityConfig:
    """Who may feed and call the API (a shared token) and whether both ports speak TLS.

    The token is kept out of reprs so that no log line or traceback shows it.
    """

    token: str | None = field(default=None, repr=False)  # None: no authentication
    token_source: str = ""  # the key it came from, for the start-up log
    scan_token_required: bool = False  # reads (scans, stats, ...) need the token too
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None  # what clients reading this configuration trust

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context both ports serve with (None without TLS); ConfigError if the
        certificate or key cannot be loaded."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"security.tls_cert: cannot load {self.tls_cert} with key {self.tls_key}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        return context

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """How a client reading this configuration checks the daemon (None without TLS)."""
        return client_ssl_context(self.tls_ca) if self.tls else None


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on what one peer can make the daemon hold: connections, scans, rows."""

    max_feed_connections: int = 256
    handshake_timeout_s: float = 10.0
    max_concurrent_scans: int = 64
    max_scan_rows: int = 0  # 0: no limit


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    pipeline: PipelineConfig
    snapshots: SnapshotConfig
    slab: SlabConfig
    memory: MemoryConfig
    indexes: tuple[IndexDefinition, ...]
    compaction: CompactionConfig = CompactionConfig(3600.0)
    security: SecurityConfig = SecurityConfig()
    limits: LimitsConfig = LimitsConfig()
    # The indexes with `defer_build = true`: stored "deferred" when new, built on request.
    deferred: frozenset[str] = frozenset()
    changes: ChangesConfig = ChangesConfig()


def check_index_name(name: str) -> str | None:
    """Why `name` cannot name an index (None if it can): a letter, then up to 63 letters,
    digits or _, so it never reads as a path or a route; or #primary, a primary index's."""
    if INDEX_NAME.match(name) or name == PRIMARY_NAME:
        return None
    shown = name if len(name) <= 80 else name[:80] + "..."
    return f"index name {shown!r}: a letter, then up to 63 letters, digits or _ (or {PRIMARY_NAME})"


def check_path(value: str | PurePath, key: str) -> Path:
    """A file or directory path as given, refused (ConfigError naming `key`) when empty, when it
    holds a NUL byte or when a `..` component would lead out of where it points."""
    text = str(value)
    if not text:
        raise ConfigError(f"{key}: must be a non-empty path")
    if "\x00" in text:
        raise ConfigError(f"{key}: a path may not contain a NUL byte")
    if ".." in PurePath(text).parts:
        raise ConfigError(
            f"{key}: {text!r} contains '..': give the path without parent steps "
            "(an absolute path, or one below the working directory)"
        )
    return Path(text)


def check_token(token: str, key: str) -> str:
    """A shared token as the daemon and its clients accept it (ConfigError naming `key`); the
    message never shows the token."""
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ConfigError(
            f"{key}: a token has {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters, not "
            f"{len(token)} (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if not TOKEN_CHARS.match(token):
        raise ConfigError(f"{key}: a token is visible ASCII characters (no spaces)")
    return token


def read_token_file(path: str | PurePath, key: str) -> str:
    """The token in a file: its first line, surrounding whitespace stripped."""
    where = check_path(path, key)
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{key}: cannot read {where}: {why}") from None
    lines = text.strip().splitlines()
    return check_token(lines[0].strip() if lines else "", f"{key} ({where})")


def client_ssl_context(
    ca_file: str | PurePath | None, key: str = "security.tls_ca"
) -> ssl.SSLContext:
    """A client's TLS context: the daemon's certificate must chain to `ca_file` (PEM; for a
    self-signed certificate, the certificate itself), or to the system's CAs when None.
    Errors name `key`, where the file was given."""
    context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file is not None:
        where = check_path(ca_file, key)
        try:
            context.load_verify_locations(cafile=where)
        except (ssl.SSLError, OSError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"{key}: cannot load {where}: {why}") from None
    return context


def _merge(base: dict[str, Any], override: dict[str, Any], where: str = "") -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        name = f"{where}{key}"
        if where == "indexes.":
            merged[key] = value  # index tables are user-defined names
        elif key not in base:
            raise ConfigError(f"{name}: unknown key")
        elif isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: must be a table")
            merged[key] = _merge(base[key], value, f"{name}.")
        else:
            merged[key] = value
    return merged


COMPRESSIONS = {"none": None, "snappy": "snappy"}


def _compression(section: _Section) -> str | None:
    value = section.table["compression"]
    if value not in COMPRESSIONS:
        raise section.fail("compression", f'must be "none" or "snappy", not {value!r}')
    return COMPRESSIONS[value]


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_RETENTION_S = 3650 * 86400.0  # ten years


def _aliases(override: dict[str, Any]) -> None:
    """The old names of options, read as the new ones: `changes.retention_minutes` (whole
    minutes) as `retention`, `changes.retention_mb` (0: no bound) as `retention_size`."""
    changes = override.get("changes")
    if not isinstance(changes, dict):
        return
    for old, new in (("retention_minutes", "retention"), ("retention_mb", "retention_size")):
        if old not in changes:
            continue
        if new in changes:
            raise ConfigError(f"changes.{old}: the old name of changes.{new}; give only one")
        value = changes.pop(old)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"changes.{old}: must be a whole number of {old.split('_')[1]} (0 or more), "
                f"not {value!r}; changes.{new} takes "
                + ('a duration such as "90s"' if new == "retention" else 'a size such as "512MiB"')
            )
        if new == "retention":
            changes[new] = f"{value}m"
        else:
            changes[new] = f"{value}MiB" if value else "none"


class _Section:
    """Typed reads of one table, each naming the key on error."""

    def __init__(self, table: dict[str, Any], name: str) -> None:
        self.table = table
        self.name = name

    def fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.name}.{key}: {why}")

    def integer(self, key: str, low: int, high: int) -> int:
        value = self.table[key]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.fail(key, f"must be an integer from {low} to {high}, not {value!r}")
        return value

    def number(self, key: str, low: float, high: float) -> float:
        value = self.table[key]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(key, f"must be a number, not {value!r}")
        if not low <= value <= high:
            raise self.fail(key, f"must be from {low} to {high}, not {value!r}")
        return float(value)

    def duration(self, key: str, most_s: float) -> float:
        """A duration as "90s", "15m", "2h", "7d" or "500ms", in seconds."""
        value = self.table[key]
        found = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
        if found is None:
            raise self.fail(
                key, f'must be a duration such as "90s", "15m", "2h" or "0s", not {value!r}'
            )
        seconds = float(found[1]) * _DURATION_UNITS[found[2]]
        if seconds > most_s:
            raise self.fail(key, f"must be at most {most_s / 86400:g} days, not {value!r}")
        return seconds

    def size_or_none(self, key: str) -> int | None:
        """A size in bytes ("512MiB", "2GB"; KiB, MiB, GiB, TiB or KB, MB, GB, TB), or None for
        "none"."""
        value = self.table[key]
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        try:
            size = parse_size(value, 0) if isinstance(value, str) else 0
        except ValueError:
            size = 0
        if size <= 0:
            raise self.fail(
                key, f'must be "none" (no bound) or a size over 0 such as "512MiB", not {value!r}'
            )
        return size

    def text(self, key: str) -> str:
        value = self.table[key]
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, not {value!r}")
        return value

    def optional_text(self, key: str) -> str:
        """A string that may be empty ("" = not set); never shown in the error (a secret)."""
        value = self.table[key]
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, not {type(value).__name__}")
        return value

    def size(self, key: str, total: int) -> int:
        try:
            size = parse_size(self.table[key], total)
        except (ValueError, TypeError) as exc:
            raise self.fail(key, str(exc)) from None
        if size <= 0:
            raise self.fail(key, "must be positive")
        return size


def _vbuckets(spec: Any, num: int) -> tuple[int, ...]:
    try:
        return parse_vbuckets(spec, num, "server.owned_vbuckets")
    except ClusterMapError as exc:
        raise ConfigError(str(exc)) from None


def _indexes(tables: Any) -> tuple[IndexDefinition, ...]:
    if not isinstance(tables, dict):
        raise ConfigError("indexes: must be a table of index tables")
    if len(tables) > MAX_INDEXES:
        raise ConfigError(f"indexes: at most {MAX_INDEXES} indexes")
    out = []
    for name, table in tables.items():
        where = f"indexes.{name}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table with `keys`")
        unknown = set(table) - {"keys", "where", "primary"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown key")
        try:
            out.append(
                index_definition(
                    name, table.get("keys"), table.get("where"), table.get("primary"), f"{where}."
                )
            )
        except DefinitionError as exc:
            raise ConfigError(str(exc)) from None
    return tuple(out)


class DefinitionError(ValueError):
    """An index definition is not valid; the message names the member and says why."""


def index_definition(
    name: Any, keys: Any, where: Any, primary: Any, at: str = ""
) -> IndexDefinition:
    """An index definition from its members as given (a TOML table, a JSON body), checked and
    in canonical form: `primary` makes the index on `META().id`. Messages start with `at`."""
    if not isinstance(name, str) or check_index_name(name) is not None:
        raise DefinitionError(
            f"{at}name: a letter, then up to 63 letters, digits or _ (or {PRIMARY_NAME})"
        )
    if primary is not None and not isinstance(primary, bool):
        raise DefinitionError(f"{at}primary: true or false")
    if primary:
        if keys is not None:
            raise DefinitionError(f"{at}keys: a primary index has none (its key is META().id)")
        if where is not None:
            raise DefinitionError(f"{at}where: a primary index holds every document")
        return IndexDefinition(name, (PRIMARY_KEY,))
    if name == PRIMARY_NAME:
        raise DefinitionError(f"{at}name: {PRIMARY_NAME} names a primary index (primary: true)")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS:
        raise DefinitionError(
            f"{at}keys: a list of 1 to {MAX_KEYS} key expressions (field paths like address.zip)"
        )
    try:
        canonical = normalize_keys(keys)
    except ExpressionError as exc:
        raise DefinitionError(f"{at}keys: {exc}") from None
    if where is not None:
        if not isinstance(where, str):
            raise DefinitionError(f'{at}where: a condition as a string, like "age >= 18"')
        try:
            where = normalize_where(where)
        except WhereError as exc:
            raise DefinitionError(f"{at}where: {exc}") from None
    return IndexDefinition(name, canonical, where)


def parse_config(text: str | None = None, source: str = "configuration") -> Config:
    """The default configuration overridden by `text` (TOML), validated."""
    default = tomllib.loads(default_config_text())
    if text is None:
        raw = default
    else:
        try:
            override = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
        if "indexes" in override:
            default.pop("indexes")
            default["indexes"] = {}
        _aliases(override)
        raw = _merge(default, override)
    total = psutil.virtual_memory().total

    s = _Section(raw["server"], "server")
    num_vbuckets = s.integer("num_vbuckets", 1, 65536)
    log_level = s.text("log_level").lower()
    if log_level not in LOG_LEVELS:
        raise s.fail("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    server = ServerConfig(
        data_dir=check_path(s.text("data_dir"), "server.data_dir"),
        host=s.text("host"),
        feed_port=s.integer("feed_port", 0, 65535),
        http_port=s.integer("http_port", 0, 65535),
        max_frame_bytes=s.integer("max_frame_bytes", 1024, 64 << 20),
        num_vbuckets=num_vbuckets,
        owned_vbuckets=_vbuckets(raw["server"]["owned_vbuckets"], num_vbuckets),
        log_level=log_level,
        flow_control_bytes=s.integer("flow_control_bytes", 1024, 1 << 30),
        cluster_lease_s=s.integer("cluster_lease_s", 2, 3600),
    )
    if server.flow_control_bytes < server.max_frame_bytes:
        raise s.fail("flow_control_bytes", "must be at least max_frame_bytes")
    p = _Section(raw["pipeline"], "pipeline")
    pipeline = PipelineConfig(
        workers=p.integer("workers", 1, 256),
        channel_batches=p.integer("channel_batches", 1, 1 << 16),
        ring_slots=p.integer("ring_slots", 16, 1 << 26),
        back_index_cache=p.integer("back_index_cache", 0, 1 << 30),
    )
    n = _Section(raw["snapshots"], "snapshots")
    snapshots = SnapshotConfig(
        in_memory_interval_s=n.integer("in_memory_interval_ms", 1, 60_000) / 1000,
        persist_interval_s=n.integer("persist_interval_ms", 10, 3_600_000) / 1000,
        recovery_points=n.integer("recovery_points", 0, 1000),
    )
    b = _Section(raw["slab"], "slab")
    slab_bytes = b.integer("slab_bytes", 4096, 1 << 30)
    if slab_bytes < server.max_frame_bytes:
        raise b.fail("slab_bytes", "must be at least server.max_frame_bytes")
    slab = SlabConfig(
        pool_bytes=b.size("pool", total),
        slab_bytes=slab_bytes,
        min_chunk=b.integer("min_chunk", 16, 4096),
    )
    if slab.pool_bytes < slab.slab_bytes:
        raise b.fail("pool", "must hold at least one slab (slab.slab_bytes)")
    m = _Section(raw["memory"], "memory")
    high = m.number("high_mark", 0.05, 1.0)
    low = m.number("low_mark", 0.01, 1.0)
    if low >= high:
        raise m.fail("low_mark", "must be below memory.high_mark")
    memory = MemoryConfig(
        quota_bytes=m.size("quota", total),
        high_mark=high,
        low_mark=low,
        min_available_bytes=m.size("min_available", total),
        sample_interval_s=m.integer("sample_interval_ms", 1, 60_000) / 1000,
    )
    c = _Section(raw["compaction"], "compaction")
    compaction = CompactionConfig(
        interval_s=c.integer("interval_minutes", 0, 525_600) * 60.0,
        thread_nice=c.integer("thread_nice", 0, 19),
        compression=_compression(c),
    )
    deferred, tables = _deferred_builds(raw.get("indexes", {}))
    indexes = _indexes(tables)
    security = _security(_Section(raw["security"], "security"))
    lim = _Section(raw["limits"], "limits")
    limits = LimitsConfig(
        max_feed_connections=lim.integer("max_feed_connections", 1, 65_536),
        handshake_timeout_s=lim.integer("handshake_timeout_ms", 100, 3_600_000) / 1000,
        max_concurrent_scans=lim.integer("max_concurrent_scans", 1, 100_000),
        max_scan_rows=lim.integer("max_scan_rows", 0, 1 << 62),
    )
    ch = _Section(raw["changes"], "changes")
    history = raw["changes"]["history"]
    if not isinstance(history, bool):
        raise ch.fail("history", "must be true or false")
    changes = ChangesConfig(
        history=history,
        retention_s=ch.duration("retention", MAX_RETENTION_S),
        retention_snapshots=ch.integer("retention_snapshots", 1, 1_000_000),
        retention_bytes=ch.size_or_none("retention_size"),
    )
    return Config(
        server,
        pipeline,
        snapshots,
        slab,
        memory,
        indexes,
        compaction,
        security,
        limits,
        deferred,
        changes,
    )


def _deferred_builds(tables: Any) -> tuple[frozenset[str], Any]:
    """The names of the index tables with `defer_build = true`, and the tables without that
    key: it is a state of the stored index, not part of its definition."""
    if not isinstance(tables, dict):
        return frozenset(), tables  # `_indexes` says what is wrong
    deferred = set()
    rest: dict[str, Any] = {}
    for name, table in tables.items():
        if isinstance(table, dict) and "defer_build" in table:
            flag = table["defer_build"]
            if not isinstance(flag, bool):
                raise ConfigError(f"indexes.{name}.defer_build: must be true or false")
            if flag:
                deferred.add(name)
            table = {k: v for k, v in table.items() if k != "defer_build"}
        rest[name] = table
    return frozenset(deferred), rest


def _security(s: _Section) -> SecurityConfig:
    """The [security] table: at most one token source, TLS certificate and key together."""
    sources = [k for k in ("token", "token_file", "token_env") if s.optional_text(k)]
    if len(sources) > 1:
        raise s.fail(sources[1], f"give one of token, token_file and token_env, not {sources}")
    token = None
    source = sources[0] if sources else ""
    if source == "token":
        token = check_token(s.table["token"], "security.token")
    elif source == "token_file":
        token = read_token_file(s.table["token_file"], "security.token_file")
    elif source == "token_env":
        name = s.table["token_env"]
        value = os.environ.get(name)
        if value is None:
            raise s.fail("token_env", f"the environment variable {name} is not set")
        token = check_token(value.strip(), f"security.token_env ({name})")
    required = s.table["scan_token_required"]
    if not isinstance(required, bool):
        raise s.fail("scan_token_required", f"must be true or false, not {required!r}")
    if required and token is None:
        raise s.fail("scan_token_required", "needs a token (token, token_file or token_env)")
    paths = {}
    for key in ("tls_cert", "tls_key", "tls_ca"):
        text = s.optional_text(key)
        paths[key] = check_path(text, f"security.{key}") if text else None
    if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
        raise s.fail("tls_key", "tls_cert and tls_key go together (both or neither)")
    security = SecurityConfig(
        token,
        f"security.{source}" if source else "",
        required,
        paths["tls_cert"],
        paths["tls_key"],
        paths["tls_ca"],
    )
    security.server_ssl_context()  # a certificate that does not load stops start-up here
    if paths["tls_ca"] is not None:
        client_ssl_context(paths["tls_ca"])
    return security


def load_config(path: Path | None) -> Config:
    """The configuration from `path`, or the embedded default when None."""
    if path is None:
        return parse_config()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_config(text, str(path))
