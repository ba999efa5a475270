"""Mixture-of-experts layers: routing, the experts' compute backends, expert parallelism."""
