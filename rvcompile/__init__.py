"""rvcompile: compile Gemma 4 once into a frozen artifact; run it anywhere it fits."""

__version__ = "0.1.0"
