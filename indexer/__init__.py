"""A secondary-index service: router feeds over TCP, LevelDB stores, stability snapshots."""

__version__ = "0.1.0"
