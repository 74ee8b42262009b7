"""Isolated places where a harness runs a task: the bubblewrap sandbox (default), Docker, Apptainer."""
