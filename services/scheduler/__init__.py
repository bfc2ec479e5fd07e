"""The scheduler service: worker registry, admission and placement."""
