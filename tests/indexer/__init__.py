"""Indexer tests: the pure index, sequence tracking, subscriptions over real ZMQ."""
