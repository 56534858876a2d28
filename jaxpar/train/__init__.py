"""The train step: gradient strategies, the update (optimizer, loss scaling, spikes), the train state, the metrics writers."""
