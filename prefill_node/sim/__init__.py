"""Discrete-event simulator of WavePP pipelines, driving the real sans-IO admission core."""
