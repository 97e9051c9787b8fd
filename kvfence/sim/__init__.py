"""Deterministic simulation of a PD cluster running the real router, role and engine code (docs/verification.md)."""
