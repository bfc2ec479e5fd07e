"""The gateway: OpenAI HTTP API and NATS request API."""
