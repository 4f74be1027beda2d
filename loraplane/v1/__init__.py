"""Generated protobuf and gRPC stubs of the loraplane.v1 contract (do not edit; `make protos`)."""
