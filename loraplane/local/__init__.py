"""Embedded servers for a local cluster and for tests: Valkey (Redis protocol) and the SeaweedFS S3 gateway."""
