"""The embedded default configuration (`indexer.toml`), shipped inside the package."""

from importlib.resources import files


def default_config_text() -> str:
    """The text of the default configuration file."""
    return files(__name__).joinpath("indexer.toml").read_text(encoding="utf-8")
