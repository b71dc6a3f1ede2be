"""Inference side of the R3 pipeline: wire codec, engine, server and client."""
