"""Serving: one request (one user's history, N candidates, the looked-up user representation) scored by an
exported program that needs only torch (graph.py, export.py, client.py), its latency (latency.py), the
serving alias and its latency gate in the registry (registry.py), and the history cap chosen per request
under a compute budget (adaptive.py)."""
