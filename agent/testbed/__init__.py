"""Emulators for tests, the bench and the demo: IMDS, strict EC2 (over moto), device plane.

They ship in the package but the agent proper never imports them.
"""
