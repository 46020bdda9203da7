"""Fuzz targets for every parser of untrusted bytes in shardkit (README.md here says how to run and add one)."""
