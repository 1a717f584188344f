"""Collectives between ranks: the shared-memory all-reduce and all-gather for ranks on one machine."""
