"""The HTTP routes (indexer/routes.py) are the ones the README's table and both `--help`
texts list; tests/e2e/test_router_service.py checks that the servers serve each."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from indexer.cli import main
from indexer.routes import DAEMON_ROUTES, ROUTER_ROUTES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_lists_every_route_once() -> None:
    text = README.read_text()
    table = text[text.index("<!-- routes:start -->") : text.index("<!-- routes:end -->")]
    rows = re.findall(r"^\| (daemon|router) \| (\w+) \| `([^`]+)` \|", table, re.MULTILINE)
    want = [("daemon", r.method, r.path) for r in DAEMON_ROUTES]
    want += [("router", r.method, r.path) for r in ROUTER_ROUTES]
    assert rows == want


def test_each_help_lists_its_routes() -> None:
    for command, routes in (("serve", DAEMON_ROUTES), ("router", ROUTER_ROUTES)):
        result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        for route in routes:
            assert re.search(rf"^\s+{route.method} {re.escape(route.path)}\s", result.output, re.M)
    assert "POST /docs/_bulk" in CliRunner().invoke(main, ["router", "--help"]).output
