"""Routed experts from SSD: page-cache residency, pread on reader threads, the bounded pool, the store."""
