"""The simulator: one tier hardware model, an emulated cache layer running its own default policy, a
``memory`` actuator that applies a sidecar's moves to it, and a discrete-event serving model (simpy) that
turns placement into TTFT and throughput. ``kvtier demo`` wires the unchanged sidecar to it."""
