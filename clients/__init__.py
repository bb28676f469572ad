"""Clients for the served models: request builders, a command-line client and
perf_analyzer input generators. They use Triton's own ``tritonclient`` (HTTP/gRPC)."""
