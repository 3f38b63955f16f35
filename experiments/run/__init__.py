"""The run loop: configuration, data preparation, training, run directories, recorded views, and the Flower runtime's entry points."""
