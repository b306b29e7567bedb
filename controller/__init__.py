"""Controller: the reconcile loop, actuators, REST API, metrics, tracing, settings."""
