"""Generated gRPC stubs (`make protos`); the sources are protos/voicemesh/v1/*.proto."""
