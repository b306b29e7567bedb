"""The reconcile tick's stages, one job per module, passing one :class:`TickContext` per tick.

``observe`` (index -> :class:`BlockView`, with the layer-residency overlay of ``residency``) ->
``overlay`` (the placement policy's desired set and P(reuse)) -> ``predict`` (fallback P(reuse), on a
worker thread when worth it; admittable rows) -> ``plan`` (the planner) -> ``act`` (decisions, actuator
routing, per-key outcomes) -> ``score`` (counterfactual scoring of shadow decisions).
:class:`kvtier.controller.loop.ReconcileLoop` only sequences, times and maps failures
(:class:`StageFailed`) to outcomes.
"""
