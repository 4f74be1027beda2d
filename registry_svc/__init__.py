"""The adapter registry service: versioned adapter blobs in S3, metadata and events in Redis."""
