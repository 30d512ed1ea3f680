"""The API by endpoint: one module each, each with its router (api/app.py includes them)."""
