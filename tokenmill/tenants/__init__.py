"""Tenants: who a key belongs to (keys.py), what it may still spend (limits.py), what it has used (usage.py).

The API authenticates and limits at its edge; the engine only sees each sequence's owner (its fair-share weight,
prefix-cache namespace and token quota, engine/request.py)."""
