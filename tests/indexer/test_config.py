"""Configuration: the embedded default, overrides, and one-line errors naming the key."""

from __future__ import annotations

import pytest

from indexer.config import ConfigError, parse_config


def test_embedded_default_is_valid_and_documented() -> None:
    config = parse_config()
    assert config.server.feed_port == 9105 and config.server.http_port == 9102
    assert config.server.host == "127.0.0.1"
    assert len(config.server.owned_vbuckets) == config.server.num_vbuckets == 1024
    assert [i.name for i in config.indexes] == ["by_city", "by_age"]
    assert config.compaction.thread_nice == 10
    assert parse_config("[compaction]\nthread_nice = 0\n").compaction.thread_nice == 0
    assert config.compaction.compression is None
    snappy = parse_config('[compaction]\ncompression = "snappy"\n')
    assert snappy.compaction.compression == "snappy"
    from config import default_config_text

    lines = default_config_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and not line.startswith("keys"):
            assert lines[i - 1].startswith("#"), f"undocumented key: {line}"


def test_override_keeps_other_defaults_and_replaces_indexes() -> None:
    config = parse_config('[server]\nfeed_port = 1234\n[indexes.by_zip]\nkeys = ["address.zip"]\n')
    assert config.server.feed_port == 1234
    assert config.server.http_port == 9102
    assert [i.name for i in config.indexes] == ["by_zip"]


def test_sizes_and_vbucket_ranges() -> None:
    config = parse_config(
        '[server]\nowned_vbuckets = ["0-3", 9]\nnum_vbuckets = 16\n[slab]\npool = "8MiB"\n'
    )
    assert config.server.owned_vbuckets == (0, 1, 2, 3, 9)
    assert config.slab.pool_bytes == 8 << 20


def test_retention_takes_durations_and_sizes_and_the_old_names() -> None:
    changes = parse_config('[changes]\nretention = "90s"\nretention_size = "512MiB"\n').changes
    assert (changes.retention_s, changes.retention_bytes) == (90.0, 512 << 20)
    assert parse_config('[changes]\nretention = "0s"\n').changes.retention_s == 0.0
    assert parse_config('[changes]\nretention = "2h"\n').changes.retention_s == 7200.0
    assert parse_config('[changes]\nretention = "500ms"\n').changes.retention_s == 0.5
    assert parse_config("").changes.retention_bytes is None  # the default: "none"
    old = parse_config("[changes]\nretention_minutes = 15\nretention_mb = 2\n").changes
    assert (old.retention_s, old.retention_bytes) == (900.0, 2 << 20)
    assert parse_config("[changes]\nretention_mb = 0\n").changes.retention_bytes is None


@pytest.mark.parametrize(
    "text, key",
    [
        ("[server]\nport = 1\n", "server.port"),
        ("[server]\nfeed_port = 70000\n", "server.feed_port"),
        ('[server]\nowned_vbuckets = ["5-2000"]\n', "server.owned_vbuckets"),
        ('[server]\nlog_level = "loud"\n', "server.log_level"),
        ("[snapshots]\npersist_interval_ms = true\n", "snapshots.persist_interval_ms"),
        ("[slab]\npool = 1000\n", "slab.pool"),
        ("[compaction]\nthread_nice = 20\n", "compaction.thread_nice"),
        ('[compaction]\ncompression = "zlib"\n', "compaction.compression"),
        ("[indexes.x]\nkeys = []\n", "indexes.x.keys"),
        ('[indexes."../etc"]\nkeys = ["a"]\n', "indexes.../etc"),
        ('[indexes.x]\nkeys = ["a"]\nwhere = 1\n', "indexes.x.where"),
        ("server = 5\n", "server"),
        ("[changes]\nretention = 90\n", "changes.retention"),
        ('[changes]\nretention = "0.5 minutes"\n', "changes.retention"),
        ('[changes]\nretention = "20000d"\n', "changes.retention"),
        ('[changes]\nretention_size = "0MiB"\n', "changes.retention_size"),
        ('[changes]\nretention_size = "lots"\n', "changes.retention_size"),
        ("[changes]\nretention_minutes = 0.5\n", "changes.retention_minutes"),
        ('[changes]\nretention_minutes = 5\nretention = "5m"\n', "changes.retention_minutes"),
        ("not toml at all [", "not valid TOML"),
    ],
)
def test_errors_name_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert key in str(info.value)
    assert "\n" not in str(info.value)


def test_defer_build_is_a_state_of_the_index_not_part_of_its_definition() -> None:
    config = parse_config(
        '[indexes.a]\nkeys = ["x"]\ndefer_build = true\n'
        '[indexes.b]\nkeys = ["y"]\ndefer_build = false\n[indexes.c]\nkeys = ["z"]\n'
    )
    assert config.deferred == frozenset({"a"})
    assert [i.name for i in config.indexes] == ["a", "b", "c"]
    assert parse_config().deferred == frozenset()
    with pytest.raises(ConfigError) as info:
        parse_config('[indexes.a]\nkeys = ["x"]\ndefer_build = "yes"\n')
    assert "indexes.a.defer_build" in str(info.value) and "\n" not in str(info.value)
