"""The live KV page map (docs/dashboard.md): who owns which page, per worker, in a browser and a terminal.

- `snapshot.py`: one engine's pool, page by page, as plain JSON-ready data (engine thread, between steps).
- `routes.py`: `GET /dashboard` (the page) and `GET /debug/kv` (the data, admin key only) on the HTTP front.
- `static/`: the page itself (HTML, CSS, JS; no third-party assets).
- `top.py`: `kvfence top`, the same view in a terminal.
"""
