"""The [security] and [limits] tables: defaults (everything off, limits generous), each way of
giving the token, and one-line errors naming the key (without showing a secret)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trustme

from indexer.config import ConfigError, parse_config
from indexer.daemon import _log_security
from tests.security.conftest import TOKEN, write_token


def test_defaults_bind_loopback_with_security_off_and_generous_limits() -> None:
    config = parse_config()
    assert config.server.host == "127.0.0.1"
    security = config.security
    assert security.token is None and not security.scan_token_required and not security.tls
    assert security.server_ssl_context() is None and security.client_ssl_context() is None
    limits = config.limits
    assert (limits.max_feed_connections, limits.handshake_timeout_s) == (256, 10.0)
    assert (limits.max_concurrent_scans, limits.max_scan_rows) == (64, 0)
    assert config.server.max_frame_bytes == 1 << 20


def test_a_configured_host_and_limits_are_taken() -> None:
    config = parse_config(
        '[server]\nhost = "0.0.0.0"\n[limits]\nmax_feed_connections = 3\n'
        "handshake_timeout_ms = 250\nmax_concurrent_scans = 2\nmax_scan_rows = 10\n"
    )
    assert config.server.host == "0.0.0.0"
    assert config.limits.max_feed_connections == 3 and config.limits.handshake_timeout_s == 0.25
    assert config.limits.max_concurrent_scans == 2 and config.limits.max_scan_rows == 10


def test_the_token_from_the_file_the_environment_or_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = write_token(tmp_path / "token")
    from_file = parse_config(f'[security]\ntoken_file = "{secret}"\n').security
    assert from_file.token == TOKEN and from_file.token_source == "security.token_file"
    monkeypatch.setenv("SECRET_FOR_TEST", f"  {TOKEN}\n")
    from_env = parse_config('[security]\ntoken_env = "SECRET_FOR_TEST"\n').security
    assert from_env.token == TOKEN and from_env.token_source == "security.token_env"
    inline = parse_config(f'[security]\ntoken = "{TOKEN}"\nscan_token_required = true\n')
    assert inline.security.token == TOKEN and inline.security.scan_token_required
    assert TOKEN not in repr(inline) and TOKEN not in repr(inline.security)


LIMIT_KEYS = {
    "max_feed_connections",
    "handshake_timeout_ms",
    "max_concurrent_scans",
    "max_scan_rows",
    "unknown_limit",
}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('token = "short"', "security.token: a token has 16 to 4096 characters, not 5"),
        (f'token = "{"x" * 10} {"y" * 10}"', "security.token: a token is visible ASCII"),
        ("token = 42", "security.token: must be a string, not int"),
        (
            f'token = "{TOKEN}"\ntoken_env = "HOME"',
            "security.token_env: give one of token, token_file and token_env",
        ),
        ('token_env = "NO_SUCH_VARIABLE_HERE"', "security.token_env: the environment variable"),
        ('token_file = "/nonexistent/token"', "security.token_file: cannot read"),
        ("scan_token_required = true", "security.scan_token_required: needs a token"),
        ('scan_token_required = "yes"', "security.scan_token_required: must be true or false"),
        ('tls_cert = "cert.pem"', "security.tls_key: tls_cert and tls_key go together"),
        (
            'tls_cert = "/nonexistent/c.pem"\ntls_key = "/nonexistent/k.pem"',
            "security.tls_cert: cannot load /nonexistent/c.pem",
        ),
        ('tls_ca = "/nonexistent/ca.pem"', "security.tls_ca: cannot load /nonexistent/ca.pem"),
        ("max_feed_connections = 0", "limits.max_feed_connections: must be an integer from 1"),
        ("handshake_timeout_ms = 5", "limits.handshake_timeout_ms: must be an integer from 100"),
        ("max_concurrent_scans = -1", "limits.max_concurrent_scans: must be an integer from 1"),
        ("max_scan_rows = 1.5", "limits.max_scan_rows: must be an integer from 0"),
        ("unknown_limit = 1", "limits.unknown_limit: unknown key"),
    ],
)
def test_bad_values_name_the_key(text: str, message: str) -> None:
    table = "limits" if text.split(" ")[0] in LIMIT_KEYS else "security"
    with pytest.raises(ConfigError) as info:
        parse_config(f"[{table}]\n{text}\n")
    assert str(info.value).startswith(message), str(info.value)


def test_a_wrong_token_file_or_key_never_shows_the_secret(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("tiny-secret\n")
    with pytest.raises(ConfigError) as info:
        parse_config(f'[security]\ntoken_file = "{short}"\n')
    assert "tiny-secret" not in str(info.value) and "not 11" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config('[security]\ntoken = "0123456789 abcdefgh"\n')
    assert "0123456789" not in str(info.value)


def test_a_certificate_and_key_that_load_give_contexts(tmp_path: Path) -> None:
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1")
    cert, key, ca = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    authority.cert_pem.write_to_path(str(ca))
    security = parse_config(
        f'[security]\ntls_cert = "{cert}"\ntls_key = "{key}"\ntls_ca = "{ca}"\n'
    ).security
    assert security.tls and security.server_ssl_context() is not None
    assert security.client_ssl_context() is not None
    # A key that does not belong to the certificate stops start-up.
    other = tmp_path / "other.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other))
    with pytest.raises(ConfigError, match=r"security\.tls_cert: cannot load"):
        parse_config(f'[security]\ntls_cert = "{cert}"\ntls_key = "{other}"\n')


@pytest.mark.parametrize(
    ("host", "warned"),
    [
        ("0.0.0.0", True),
        ("10.1.2.3", True),
        ("127.0.0.1", False),
        ("::1", False),
        ("localhost", False),
    ],
)
def test_start_up_warns_of_a_reachable_address_without_a_token(
    host: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="indexer.daemon"):
        _log_security(parse_config(f'[server]\nhost = "{host}"\n'))
    assert "authentication off" in caplog.text
    assert (f"listening on {host} without a token" in caplog.text) is warned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="indexer.daemon"):
        _log_security(parse_config(f'[server]\nhost = "{host}"\n[security]\ntoken = "{TOKEN}"\n'))
    assert "without a token" not in caplog.text and TOKEN not in caplog.text
    assert "token from security.token required for feeds and HTTP changes" in caplog.text
