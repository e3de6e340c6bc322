"""voicemesh: low-latency voice AI over a gRPC mesh. The shared core: stubs, audio, config, serving, clients."""

__version__ = "0.1.0"
