"""The nanoserve command line: argument parsing and printing over the engine core."""
