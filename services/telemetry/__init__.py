"""Telemetry: Prometheus metrics and a cluster view from heartbeats and request records."""
