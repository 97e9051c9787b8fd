"""The runtime layer: process setup for every command (`kvfence/cli.py` parses, this runs).

The only package that may import both the HTTP server (kvfence/server) and the PD cluster (kvfence/pd);
tests/test_imports.py enforces it. `colocated.py`: generate, preflight and `serve`; `pd.py`: `serve --mode pd`,
`router`, `prefill` and `decode`; `http.py`: the HTTP front both modes share; `process.py`: environment
defaults, child processes.
"""
