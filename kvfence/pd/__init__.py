"""Disaggregated prefill/decode: the KV transfer protocol (sans-IO state machines) and, later, its transports."""
