"""What the commands share: one-line failures, the configuration, tokens and TLS, the
placeholders and options used by several commands, and the client of the daemon's API."""

from __future__ import annotations

import dataclasses
import functools
import os
import ssl
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from indexer.config import (
    LOG_LEVELS,
    TOKEN_ENV,
    Config,
    ConfigError,
    check_index_name,
    check_path,
    check_token,
    client_ssl_context,
    load_config,
    read_token_file,
)
from indexer.logs import LOG_FORMATS

if TYPE_CHECKING:
    from indexer.router.streams.feed import FeedSecurity


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"indexer: error: {message}", err=True)
    sys.exit(code)


def _config(config_file: Path | None, **overrides: Any) -> Config:
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        fail(str(exc), 2)
    server = {k: v for k, v in overrides.items() if v is not None}
    if server:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **server))
    return config


def _data_dir(value: Path | None, option: str = "--data-dir") -> Path | None:
    """A data directory given on the command line, refused (exit 2) if it has `..` steps."""
    if value is None:
        return None
    try:
        return check_path(value, option)
    except ConfigError as exc:
        fail(str(exc), 2)


def _index_name(name: str) -> str:
    """An index name given on the command line, refused (exit 2) unless it is one."""
    problem = check_index_name(name)
    if problem is not None:
        fail(problem, 2)
    return name


def _token(token: str | None, token_file: Path | None, fallback: str | None = None) -> str | None:
    """The shared token to present: --token-file, else --token, else $INDEXER_TOKEN, else
    `fallback` (a configuration's); None if none. Exit 2 when it is malformed."""
    if token is not None and token_file is not None:
        fail("give --token or --token-file, not both", 2)
    try:
        if token_file is not None:
            return read_token_file(token_file, "--token-file")
        if token is not None:
            return check_token(token.strip(), "--token")
        from_env = os.environ.get(TOKEN_ENV)
        if from_env:
            return check_token(from_env.strip(), TOKEN_ENV)
    except ConfigError as exc:
        fail(str(exc), 2)
    return fallback


def _tls_context(tls: bool, tls_ca: Path | None) -> ssl.SSLContext | None:
    """The client TLS context of --tls / --tls-ca (None: plain); exit 2 if the CA is bad."""
    if not tls and tls_ca is None:
        return None
    try:
        return client_ssl_context(tls_ca, "--tls-ca")
    except ConfigError as exc:
        fail(str(exc), 2)


def _feed_security(
    token: str | None, token_file: Path | None, tls: bool, tls_ca: Path | None
) -> FeedSecurity:
    """What `feed` and `router` present to the daemon (token) and check it with (TLS)."""
    from indexer.router.streams.feed import FeedSecurity

    return FeedSecurity(_token(token, token_file) or "", _tls_context(tls, tls_ca))


TOKEN_HELP = (
    "The indexer's shared token (default: $INDEXER_TOKEN). On the command line it shows in the "
    "process list: prefer --token-file or the variable."
)
TOKEN_OPTION = click.option("--token", metavar="TOKEN", help=TOKEN_HELP)
TOKEN_FILE_OPTION = click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="A file holding the indexer's shared token (its first line).",
)
TLS_CA_OPTION = click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="A PEM file of CA certificates to check the indexer's TLS certificate with (for a "
    "self-signed certificate, the certificate itself).",
)
TLS_OPTION = click.option(
    "--tls",
    is_flag=True,
    help="Connect to the feed port with TLS, checking its certificate with the system's CAs "
    "(or --tls-ca, which implies --tls).",
)
FILE = click.Path(dir_okay=False, path_type=Path)
DIR = click.Path(file_okay=False, path_type=Path)
PORT = click.IntRange(0, 65535)
SERVE_CONFIG_HELP = "A TOML configuration overriding the embedded default's keys."


def log_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add --log-level and --log-format (the long-running commands' log on stderr)."""
    level = click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        help="Log records of this level and above (default: server.log_level for serve, info "
        "for router).",
    )
    form = click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        help="text: one line per record; json: one JSON object per line (time, level, logger, "
        "message).",
    )
    return level(form(command))


def _address(value: str, allow_zero: bool = False) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not int(not allow_zero) <= int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class Api:
    """Where and how the CLI calls the daemon's HTTP API: the base URL, the bearer token (kept
    out of reprs) and how its TLS certificate is checked."""

    base: str
    token: str | None = field(default=None, repr=False)
    verify: ssl.SSLContext | bool = True

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header of the token, if any."""
        from indexer.client import bearer

        return bearer(self.token)


def _api(
    url: str | None,
    config_file: Path | None,
    token: str | None = None,
    token_file: Path | None = None,
    tls_ca: Path | None = None,
) -> Api:
    """The API of --url, else the configured address (https when the configuration has TLS),
    with the token and certificate check of `_client_security`."""
    config = _config(config_file) if url is None or config_file is not None else None
    if url:
        base = url.rstrip("/")
    else:
        assert config is not None
        scheme = "https" if config.security.tls else "http"
        base = f"{scheme}://{config.server.host}:{config.server.http_port}"
    bearer, context = _client_security(config, token, token_file, tls_ca)
    return Api(base, bearer, context if context is not None else True)


def _client_security(
    config: Config | None, token: str | None, token_file: Path | None, tls_ca: Path | None
) -> tuple[str | None, ssl.SSLContext | None]:
    """The token to present (the options, $INDEXER_TOKEN or the configuration's) and the TLS
    context to check the daemon with (--tls-ca, or the configuration's when it has TLS)."""
    security = config.security if config is not None else None
    context = None
    if tls_ca is not None:
        context = _tls_context(True, tls_ca)
    elif security is not None and security.tls:
        try:
            context = security.client_ssl_context()
        except ConfigError as exc:
            fail(str(exc), 2)
    fallback = security.token if security is not None else None
    return _token(token, token_file, fallback), context


def _http_error(response: Any) -> NoReturn:
    from indexer.client import error_text

    fail(f"HTTP {response.status_code}: {error_text(response.content)}")


def print_lines(api: Api, path: str, params: dict[str, Any], timeout: float) -> str | None:
    """GET `path` and copy its NDJSON lines to stdout as they come; the answer's
    X-Indexer-Next (None without one). An answer other than 200 ends the command with its
    one-line error; a daemon that cannot be reached raises httpx.HTTPError."""
    import httpx

    from indexer.client import NEXT_HEADER

    with httpx.stream(
        "GET",
        api.base + path,
        params=params,
        timeout=timeout,
        headers=api.headers,
        verify=api.verify,
    ) as response:
        if response.status_code != 200:
            response.read()
            _http_error(response)
        out = sys.stdout
        for line in response.iter_lines():
            if line:
                out.write(line + "\n")
        out.flush()
        next_token: str | None = response.headers.get(NEXT_HEADER)
        return next_token


def _call(
    api: Api,
    method: str,
    path: str,
    *,
    params: dict[str, Any] | None = None,
    body: Any = None,
    timeout: float | None = 30,
) -> Any:
    """One request to the daemon (its httpx response); a failure to reach it ends the command
    with one line."""
    import httpx

    try:
        return httpx.request(
            method,
            api.base + path,
            params=params,
            json=body,
            timeout=timeout,
            headers=api.headers,
            verify=api.verify,
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach the daemon at {api.base}: {exc}")


def _get_json(
    api: Api, path: str, params: dict[str, Any] | None = None, timeout: float = 30
) -> Any:
    response = _call(api, "GET", path, params=params, timeout=timeout)
    if response.status_code != 200:
        _http_error(response)
    return response.json()


URL_ENV = "INDEXER_URL"
URL_OPTION = click.option(
    "--url",
    metavar="URL",
    envvar=URL_ENV,
    show_envvar=True,
    help="The daemon's HTTP API, like http://127.0.0.1:9102 (default: the address of --config "
    "if given, else $INDEXER_URL, else the embedded configuration's).",
)
CONFIG_OPTION = click.option(
    "--config",
    "config_file",
    type=FILE,
    metavar="FILE",
    help="A TOML configuration: its address, token and tls_ca are used unless given otherwise.",
)


@dataclass(frozen=True)
class ApiOptions:
    """How to reach the HTTP API as the command line says: --url, --config, --token,
    --token-file and --tls-ca (see `api_options`)."""

    url: str | None
    config_file: Path | None
    token: str | None = field(repr=False)
    token_file: Path | None
    tls_ca: Path | None
    env_url: str | None = None  # $INDEXER_URL: below --url and --config

    def connect(self) -> Api:
        url = self.url or (self.env_url if self.config_file is None else None)
        return _api(url, self.config_file, self.token, self.token_file, self.tls_ca)


def api_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the options of `ApiOptions` to a command, which gets them as one `daemon` argument."""

    @functools.wraps(command)
    def with_api(
        *args: Any,
        url: str | None,
        config_file: Path | None,
        token: str | None,
        token_file: Path | None,
        tls_ca: Path | None,
        **kwargs: Any,
    ) -> Any:
        env_url = None
        source = click.get_current_context().get_parameter_source("url")
        if source is click.core.ParameterSource.ENVIRONMENT:
            url, env_url = None, url  # --cluster-map or --data-dir may go with it
        daemon = ApiOptions(url, config_file, token, token_file, tls_ca, env_url)
        return command(*args, daemon=daemon, **kwargs)

    wrapped: Callable[..., Any] = with_api
    for option in (TLS_CA_OPTION, TOKEN_FILE_OPTION, TOKEN_OPTION, CONFIG_OPTION, URL_OPTION):
        wrapped = option(wrapped)
    return wrapped


JSON_OUTPUT_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print the API's answer as JSON instead of a table."
)
