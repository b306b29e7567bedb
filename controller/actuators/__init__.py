"""Actuators: one interface (:mod:`.base`), one adapter per cache layer."""
