"""Benchmarks behind `kvroute bench`."""
