"""What a model is: its architecture config (`config`) and the named presets (`presets`)."""
