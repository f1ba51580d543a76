"""The change feed's reads that are not its history: the snapshot start, in pages."""
