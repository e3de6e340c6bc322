"""Chaos tests of the running mesh: fuzzing every door (fuzz.py) and killing processes under load."""
